"""Greedy agreement of the quantized CPU formats with float32, on a fixed prompt set.

The embedded SmolLM2 GGUF; for each (weights, kernel activations) format, forced instead of
probed (quantized kernels at every batch size), each prompt is decoded greedily alone and
compared with the dense float32 model's tokens: reported per format, the tokens equal before
the first difference per prompt, their mean, and how many prompts agree over the whole length.

    python bench/greedy_agreement.py [--quick] [--max-new-tokens 32]
Writes bench/results/greedy_agreement.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmprog_runtime.config import ServerArgs  # noqa: E402  (before torch: sets OpenMP's wait policy)
import torch  # noqa: E402

from lmprog_runtime.model_executor import probe, qgemm  # noqa: E402
from lmprog_runtime.model_executor.forward_batch import ForwardBatch  # noqa: E402
from lmprog_runtime.model_executor.runner import ModelRunner  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The quick brown fox",
           "Water boils at", "The three primary colors are", "import numpy as np\n", "My favourite book is",
           "The largest planet in the solar system is", "To make a cup of tea,", "In 1969,",
           "SELECT name FROM users WHERE"]


def runner_for(weights: str, act: str) -> ModelRunner:
    """A runner with `weights` at `act` kernels, the probe replaced by 'act is fastest'."""
    real = probe.measure_cached
    probe.measure_cached = lambda config, formats: {
        f: {b: (0.5 if f[1] == act else 1.0) * b for b in probe.PROBE_BATCHES} for f in formats}
    try:
        return ModelRunner(ServerArgs(model_path="default", dtype="float32", quantization=weights,
                                      max_total_tokens=512, max_running_requests=2, context_length=1024))
    finally:
        probe.measure_cached = real


def greedy(runner: ModelRunner, prompt, new_tokens: int):
    """One request alone in table row 1, slots 1..: prefill, then one token per step."""
    table = runner.req_to_token_pool.table
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    ids, out = list(prompt), []
    table[1, :len(ids) + new_tokens] = torch.arange(1, len(ids) + new_tokens + 1)
    cached, new = 0, ids
    for _ in range(new_tokens):
        pos = list(range(cached, cached + len(new)))
        fb = ForwardBatch(input_ids=i64(new), positions=i64(pos), out_cache_loc=i64([p + 1 for p in pos]),
                          req_pool_indices=i64([1]), seq_lens=i64([cached + len(new)]),
                          extend_lens=i64([len(new)]), req_to_token=table,
                          seq_lens_cpu=[cached + len(new)], extend_lens_cpu=[len(new)])
        tok = int(runner.forward(fb)[-1].argmax())
        out.append(tok)
        cached, new = cached + len(new), [tok]
    return out


def agreement(got, want) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens")
    ap.add_argument("--results-dir", default=RESULTS)
    args = ap.parse_args()
    prompts, n = (PROMPTS[:4], 16) if args.quick else (PROMPTS, args.max_new_tokens)
    formats = [("int4", "float32"), ("int4", "bfloat16"), ("int8", "float32")]
    if qgemm.dot_available():
        formats += [("int4", "int8"), ("int8", "int8")]
    ref = ModelRunner(ServerArgs(model_path="default", dtype="float32", quantization="none",
                                 max_total_tokens=512, max_running_requests=2, context_length=1024))
    ids = [ref.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    want = [greedy(ref, p, n) for p in ids]
    result = {"max_new_tokens": n, "prompts": prompts, "formats": {}}
    for weights, act in formats:
        runner = runner_for(weights, act)
        agree = [agreement(greedy(runner, p, n), w) for p, w in zip(ids, want)]
        row = {"agree": agree, "mean": statistics.mean(agree), "whole": sum(a == n for a in agree)}
        result["formats"][f"{weights}/{act}"] = row
        print(f"{weights}/{act:<9} tokens equal to fp32 before the first difference: {agree} "
              f"(mean {row['mean']:.1f} of {n}; {row['whole']}/{len(agree)} prompts whole)")
        del runner
    os.makedirs(args.results_dir, exist_ok=True)
    with open(os.path.join(args.results_dir, "greedy_agreement.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
