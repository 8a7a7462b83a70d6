"""Greedy determinism on the embedded SmolLM2: does a request's output depend on its batch-mates
or on speculation? Each of bench_speculative's workloads (document QA, chat, JSON) runs 8 prompts
at batch 1 and 8, with NGRAM speculation off and on, and every run is compared with batch 1 off.

    python bench/bench_determinism.py                                  # the default formats
    python bench/bench_determinism.py --enable-deterministic-inference

Writes bench/results/determinism[_deterministic].json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.bench_speculative import workloads  # noqa: E402


def outputs(engine, texts, params, batch):
    outs = []
    for i in range(0, len(texts), batch):
        group = engine.generate(texts[i:i + batch], params)
        outs.extend(group if isinstance(group, list) else [group])
    return [o["output_ids"] for o in outs]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enable-deterministic-inference", action="store_true")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    from lmprog_runtime import Engine

    runs, formats = {}, None
    for spec in (False, True):
        kw = dict(speculative_algorithm="NGRAM") if spec else {}
        with Engine(model_path=args.model_path, dtype=args.dtype,
                    enable_deterministic_inference=args.enable_deterministic_inference, **kw) as engine:
            formats = str(engine.scheduler.runner.formats)
            for name, (texts, extra) in workloads(engine.tokenizer, args.prompts).items():
                params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, **extra}
                for batch in (1, 8):
                    engine.flush_cache()
                    runs[name, batch, spec] = outputs(engine, texts, params, batch)
    rows = []
    for (name, batch, spec), got in runs.items():
        want = runs[name, 1, False]
        rows.append({"workload": name, "batch": batch, "speculative": spec,
                     "identical": sum(a == b for a, b in zip(got, want)), "prompts": len(want)})
        print(f"{name:>7} batch {batch} NGRAM {'on ' if spec else 'off'}: "
              f"{rows[-1]['identical']}/{len(want)} identical to batch 1 without speculation")
    suffix = "_deterministic" if args.enable_deterministic_inference else ""
    path = os.path.join(HERE, "results", f"determinism{suffix}.json")
    with open(path, "w") as f:
        json.dump({"config": vars(args), "formats": formats, "rows": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
