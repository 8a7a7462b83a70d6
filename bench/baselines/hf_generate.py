"""The plain-Python alternative: Hugging Face `transformers` `generate` on the serving workloads.

    python -m bench.baselines.hf_generate --mode sequential --dataset-name shared-prefix --max-requests 16
    python -m bench.baselines.hf_generate --mode batched --batch-size 8 --dataset-name random

Same model file (the SmolLM2 GGUF, dequantized by transformers), same prompts as
`bench_serving.py` (same dataset flags and seed), greedy, exactly `output_len` new tokens
per request (`min_new_tokens` = `max_new_tokens`, like `ignore_eos`).
- `sequential`: one request at a time, as a script calling `generate` in a loop does.
  `--max-requests` runs a prefix of the dataset; the rates are per request, so they
  compare with the full runs of the servers.
- `batched`: requests in dataset order, `--batch-size` at a time, left-padded, each batch
  generating the longest output of its members (static batching).
All requests are "sent" at t=0; a request's latency counts from the moment its batch
starts (time in the queue is not counted, which favours this baseline). TTFT is the time
of the first logits-processor call (prefill done); ITL the gaps between later calls.
No prefix cache: the cache hit rate is 0 by construction.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.bench_serving import (RequestRecord, add_dataset_args, build_requests,  # noqa: E402
                                 compute_metrics, print_metrics, write_result)


def load_hf_model(model_path: str = "default", dtype: str = "float32", num_threads=None):
    """(model, tokenizer) from an HF folder or a GGUF file ("default" = the embedded SmolLM2)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmprog_runtime.model_paths import resolve_model_path

    if num_threads:
        torch.set_num_threads(num_threads)
    path = resolve_model_path(model_path)
    folder, kwargs = (os.path.dirname(path), {"gguf_file": os.path.basename(path)}) if path.endswith(".gguf") \
        else (path, {})
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **kwargs).eval()
    return model, tokenizer


class StepClock:
    """A logits processor that changes nothing and records when each decoding step's logits exist."""

    def __init__(self):
        self.times: List[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def generate_timed(model, tokenizer, prompts: List[str], new_tokens: int):
    """One `generate` call over `prompts` (padded): (start, step times, prompt token counts)."""
    import torch
    from transformers import LogitsProcessorList

    clock = StepClock()
    t0 = time.perf_counter()
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id, logits_processor=LogitsProcessorList([clock]))
    clock.times.append(time.perf_counter())  # the end of the last step
    return t0, clock.times, enc["attention_mask"].sum(dim=1).tolist()


def run(model, tokenizer, requests, mode: str, batch_size: int, progress: bool = True):
    from tqdm.auto import tqdm

    size = 1 if mode == "sequential" else batch_size
    records: List[RequestRecord] = []
    bar = tqdm(total=len(requests), desc=f"hf-{mode}", disable=not progress)
    t_run = time.perf_counter()
    for i in range(0, len(requests), size):
        batch = requests[i:i + size]
        t0, times, prompt_lens = generate_timed(model, tokenizer, [r.prompt for r in batch],
                                                max(r.output_len for r in batch))
        steps = len(times) - 1  # tokens generated per row (fewer than asked only if EOS could not be held off)
        for req, prompt_len in zip(batch, prompt_lens):
            out_len = min(req.output_len, steps)
            end = times[-1] if mode == "batched" else times[out_len]  # batch members wait for the longest
            records.append(RequestRecord(
                ok=True, start=t0 - t_run, ttft=times[0] - t0, latency=end - t0,
                itl=[b - a for a, b in zip(times[:out_len], times[1:out_len])],
                prompt_tokens=int(prompt_len), output_tokens=out_len, cached_tokens=0))
        bar.update(len(batch))
    bar.close()
    return records, time.perf_counter() - t_run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(ap)
    ap.add_argument("--mode", choices=("sequential", "batched"), default="sequential")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-requests", type=int, default=None, help="run only the first N requests")
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--system", default=None)
    ap.add_argument("--output-file", default=None)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    requests = build_requests(args)
    if args.max_requests:
        requests = requests[:args.max_requests]
    model, tokenizer = load_hf_model(args.model_path, args.dtype, args.num_threads)
    generate_timed(model, tokenizer, ["Warm-up request: say hello."], 2)  # not timed
    records, duration = run(model, tokenizer, requests, args.mode, args.batch_size, not args.no_progress)
    metrics = compute_metrics(records, duration)
    metrics["subset"] = {"ran": len(requests), "of": len(build_requests(args))}
    system = args.system or f"hf-{args.mode}"
    print_metrics(f"{system} / {args.dataset_name}", metrics)
    if args.output_file:
        write_result(args.output_file, system, args.dataset_name, vars(args), metrics, records, None)
        print(f"wrote {args.output_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
