"""JSON extraction under a JSON Schema through the Engine, jump-forward on vs off.

    python bench/bench_jump_forward.py                 # SmolLM2, 64 requests, 6-field schema
    python bench/bench_jump_forward.py --quick         # 8 requests (step counts; rough timings)

Reports decode steps (scheduler forwards), mean latency, throughput, the grammar-mask
cost per constrained token at batch 1 and at batch 32, checks every output against
the schema, and checks that jump-forward is exact: the greedy outputs (token ids) with it
on equal those with it off. That holds exactly with --dtype float32; with bfloat16 or the
quantized CPU weights `--dtype auto` may pick, a forward over a draft's tokens and a
one-token decode round differently, and a near-tie can flip (as it does for speculative
decoding). Writes bench/results/jump_forward.json and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "occupation": {"type": "string", "maxLength": 24},
        "is_employed": {"type": "boolean"},
        "favorite_color": {"enum": ["red", "green", "blue", "yellow", "black", "white"]},
    },
    "required": ["name", "age", "city", "occupation", "is_employed", "favorite_color"],
    "additionalProperties": False,
}
NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "Deepak Rao", "Emma Stone", "Farid Haddad", "Grace Lee"]
CITIES = ["Paris", "Toronto", "Osaka", "Lima", "Nairobi", "Berlin", "Austin"]
JOBS = ["nurse", "teacher", "engineer", "chef", "pilot", "lawyer", "artist"]


def prompts(n: int, tokenizer) -> list:
    rng = random.Random(0)
    out = []
    for i in range(n):
        bio = (f"{rng.choice(NAMES)} is {rng.randint(20, 70)} years old, lives in {rng.choice(CITIES)} "
               f"and works as a {rng.choice(JOBS)}. Their favorite color is {rng.choice(['red', 'blue', 'green'])}.")
        messages = [{"role": "user", "content": f"Extract the person's details as JSON.\n{bio} (record {i})"}]
        out.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


def run(engine, texts, params, batch: bool) -> dict:
    state0 = engine.get_internal_state()
    t0 = time.perf_counter()
    latencies, outs = [], []
    if batch:
        outs = engine.generate(texts, params)
        latencies = [o["meta_info"]["e2e_latency"] for o in outs]
    else:
        for text in tqdm(texts, desc="batch 1", leave=False):
            o = engine.generate(text, params)
            outs.append(o)
            latencies.append(o["meta_info"]["e2e_latency"])
    wall = time.perf_counter() - t0
    state = engine.get_internal_state()
    import jsonschema
    valid = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o["text"]), SCHEMA)
            valid += 1
        except Exception:
            pass
    d = {k: state.get(k, 0) - state0.get(k, 0) for k in (
        "num_steps", "mask_s", "mask_rows", "num_generated_tokens", "num_jump_forward_tokens",
        "num_jump_forward_drafted", "forward_s", "step_s")}
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "requests": len(texts), "wall_s": wall, "requests_per_s": len(texts) / wall,
        "output_tokens_per_s": tokens / wall, "mean_latency_s": statistics.mean(latencies),
        "decode_steps": d["num_steps"], "completion_tokens": tokens,
        # sampled: tokens the model chose itself (generated counts accepted forced tokens too)
        "sampled_tokens": d["num_generated_tokens"] - d["num_jump_forward_tokens"],
        "jump_forward_tokens": d["num_jump_forward_tokens"],
        "jump_forward_drafted": d["num_jump_forward_drafted"],
        "mask_us_per_constrained_token": 1e6 * d["mask_s"] / d["mask_rows"] if d["mask_rows"] else None,
        "valid": valid, "output_ids": [o["output_ids"] for o in outs],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--batch1-requests", type=int, default=8, help="requests timed one at a time (mask cost at batch 1)")
    ap.add_argument("--whitespace", default="", help="JSON whitespace pattern ('' = compact JSON)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--quick", action="store_true", help="8 requests, batch 32 of 8, 2 at batch 1")
    ap.add_argument("--grammar-backend", default=None, help="the server's --grammar-backend (default: its default)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "jump_forward.json"))
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.batch1_requests = min(args.num_requests, 8), min(args.batch1_requests, 2)

    from lmprog_runtime import Engine

    params = {"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": args.max_new_tokens}
    results = {"config": vars(args), "schema": SCHEMA}
    for jf in (True, False):
        key = "jump_forward_on" if jf else "jump_forward_off"
        backend = {"grammar_backend": args.grammar_backend} if args.grammar_backend else {}
        with Engine(model_path=args.model_path, dtype=args.dtype, disable_jump_forward=not jf,
                    constrained_json_whitespace_pattern=args.whitespace, **backend) as engine:
            texts = prompts(args.num_requests, engine.tokenizer)
            t0 = time.perf_counter()
            engine.generate(texts[0], {**params, "max_new_tokens": 1})  # compile the grammar, untimed
            compile_s = time.perf_counter() - t0
            engine.flush_cache()
            print(f"{key}: batch of {args.num_requests} ...", flush=True)
            batch = run(engine, texts, params, batch=True)
            engine.flush_cache()
            batch32 = run(engine, texts[:32], params, batch=True)  # (all of them with --quick)
            engine.flush_cache()
            single = run(engine, texts[: args.batch1_requests], params, batch=False)
            engine.check_integrity()
        results[key] = {"batch": batch, "batch32": batch32, "batch1": single,
                        "first_request_with_compile_s": compile_s}
        print(json.dumps({k: {m: v for m, v in d.items() if m != "output_ids"} if isinstance(d, dict) else d
                          for k, d in results[key].items()}, indent=1), flush=True)
    on, off = results["jump_forward_on"]["batch"], results["jump_forward_off"]["batch"]
    results["steps_ratio"] = off["decode_steps"] / on["decode_steps"]
    results["throughput_ratio"] = on["requests_per_s"] / off["requests_per_s"]
    results["outputs_differing"] = sum(
        a != b for part in ("batch", "batch32", "batch1")
        for a, b in zip(results["jump_forward_on"][part]["output_ids"],
                        results["jump_forward_off"][part]["output_ids"]))
    results["outputs_identical"] = results["outputs_differing"] == 0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out.replace(".json", ".png"))
    print(f"\njump-forward: {results['steps_ratio']:.2f}x fewer decode steps, "
          f"{results['throughput_ratio']:.2f}x throughput; valid {on['valid']}/{on['requests']} (on), "
          f"{off['valid']}/{off['requests']} (off); greedy outputs identical: {results['outputs_identical']}")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["jump_forward_on", "jump_forward_off"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, metric, label in zip(axes, ("decode_steps", "requests_per_s", "mean_latency_s"),
                                 ("decode steps", "requests/s", "mean latency (s)")):
        ax.bar(["on", "off"], [results[k]["batch"][metric] for k in keys], color=["tab:green", "tab:gray"])
        ax.set_title(label)
    fig.suptitle("JSON extraction, jump-forward on vs off (lmprog Engine, SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
