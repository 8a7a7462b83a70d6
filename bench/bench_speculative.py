"""NGRAM speculative decoding on vs off through the Engine (SmolLM2-135M, greedy).

    python bench/bench_speculative.py            # all three workloads, batch 1 / 4 / 16
    python bench/bench_speculative.py --quick    # a few requests per point (a smoke run)
    python bench/bench_speculative.py --topk 1,4 --repeats 3   # chains and draft trees, 3 rounds

Each point runs the plain engine and the speculative ones (one per --topk) interleaved,
off then on, --repeats times, so a busy machine slows both alike: the speedups are ratios
of the mean tokens/s of those interleaved runs.

Workloads: (a) document QA whose answers quote the document, (b) JSON extraction with a
schema (values copied from the prompt), (c) free chat. For each batch size the requests
run in groups of that size (one `generate` call per group). Reports output tokens/s with
speculation on and off, the speedup, the mean accept length (tokens per verify step,
meta_info.spec_accept_length averaged over requests), whether the greedy outputs were
identical, and the step counts: steps off / on, and of the speculative engine's steps how
many verified drafts, were declined by the cost rule, were decided by its heuristic (verify
costs not yet measured) or ran plain to measure the batch size's plain step time
(`counters_on`: the scheduler's spec_num_* counters summed over the runs). Writes bench/results/speculative.json and speculative.png.

The peer, with `--llama-spec-types ngram-simple,ngram-mod` (needs the llama-server that
bench_vs_llamacpp.py builds, or `--llama-server PATH`): the same prompts at batch 1 through
llama.cpp's `llama-server -np 1` on the same GGUF, with no speculation and with each
`--spec-type`; tokens/s and llama.cpp's own draft counts (`timings.draft_n[_accepted]`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 32}, "city": {"type": "string", "maxLength": 32},
                   "occupation": {"type": "string", "maxLength": 32},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "city", "occupation", "age"], "additionalProperties": False,
}
NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "Deepak Rao", "Emma Stone", "Farid Haddad", "Grace Lee"]
CITIES = ["Paris", "Toronto", "Osaka", "Lima", "Nairobi", "Berlin", "Austin"]
JOBS = ["nurse", "teacher", "software engineer", "chef", "airline pilot", "lawyer", "painter"]
TOPICS = ["the ocean", "autumn leaves", "a city at night", "learning to cook", "an old friend", "the moon",
          "a rainy day", "mountains", "a train journey", "coffee", "the first snow", "a library"]
FACTS = [
    "The Lumen Bridge was completed in 1931 and spans 412 meters across the Varn river.",
    "Its architect, Helena Strauss, designed the bridge with three steel arches painted dark green.",
    "During the flood of 1957 the bridge stayed open while every other crossing closed for a week.",
    "The city council renovated the bridge in 2004, replacing the wooden walkway with granite slabs.",
    "Every June the Lumen Bridge festival brings street musicians and food stalls to both banks.",
    "A small museum at the north end displays the original blueprints and a model of the arches.",
]
QUESTIONS = ["When was the bridge completed and how long is it?", "Who designed the bridge?",
             "What happened during the flood of 1957?", "What changed in 2004?",
             "What happens every June?", "What is at the north end of the bridge?"]


def _chat(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def workloads(tokenizer, n: int) -> dict:
    rng = random.Random(0)
    doc = " ".join(FACTS)
    qa = [_chat(tokenizer, f"Document:\n{doc}\n\nAnswer by quoting the sentence of the document that "
                           f"answers the question.\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}") for i in range(n)]
    extract = []
    for i in range(n):
        bio = (f"{rng.choice(NAMES)} is {rng.randint(20, 70)} years old, lives in {rng.choice(CITIES)} and "
               f"works as a {rng.choice(JOBS)}.")
        extract.append(_chat(tokenizer, f"Extract the person's details as JSON.\n{bio} (record {i})"))
    chat = [_chat(tokenizer, f"Write a few sentences about {TOPICS[i % len(TOPICS)]}.") for i in range(n)]
    return {"doc_qa": (qa, {}), "json": (extract, {"json_schema": json.dumps(SCHEMA)}), "chat": (chat, {})}


def _counters(engine) -> dict:
    """The scheduler's step and speculation counters (internal state)."""
    st = engine.get_internal_state()
    return {k: v for k, v in st.items() if k == "num_steps" or k.startswith("spec_num_")}


def run(engine, texts, params, batch: int) -> dict:
    before = _counters(engine)
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(texts), batch):
        group = engine.generate(texts[i:i + batch], params)
        outs.extend(group if isinstance(group, list) else [group])
    wall = time.perf_counter() - t0
    after = _counters(engine)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    accept = [o["meta_info"]["spec_accept_length"] for o in outs if o["meta_info"].get("spec_verify_ct")]
    return {"requests": len(texts), "wall_s": wall, "completion_tokens": tokens,
            "output_tokens_per_s": tokens / wall,
            "mean_accept_length": statistics.mean(accept) if accept else None,
            "counters": {k: after[k] - before.get(k, 0) for k in after},
            "output_ids": [o["output_ids"] for o in outs]}


def llama_peer(opts, loads: dict, max_new: int) -> list:
    """Batch-1 tokens/s of llama-server on the same prompts, per --spec-type (and none)."""
    import requests
    from bench.bench_vs_llamacpp import LlamaServerBinary, ensure_llama_server, free_port

    binary = opts.llama_server or ensure_llama_server(os.path.expanduser("~/.cache/lmprog-bench"))

    class SpecLlama(LlamaServerBinary):
        def __init__(self, port, spec_type, **kw):
            self.spec_type = spec_type
            super().__init__(port, binary, opts.threads, 1, 8192, **kw)

        def argv(self):
            return super().argv() + (["--spec-type", self.spec_type] if self.spec_type else [])

    rows = []
    for spec_type in [None] + opts.llama_spec_types.split(","):
        log = os.path.join(HERE, "results", "logs", f"speculative_llama_{spec_type or 'none'}.log")
        with SpecLlama(free_port(), spec_type, log_path=log, ready_timeout=300) as url:
            for name, (texts, extra) in loads.items():
                n = opts.llama_requests
                body = {"n_predict": max_new, "temperature": 0, "cache_prompt": False}
                if "json_schema" in extra:
                    body["json_schema"] = json.loads(extra["json_schema"])
                t0, tokens, drafted, accepted = time.perf_counter(), 0, 0, 0
                for text in texts[:n]:
                    out = requests.post(url + "/completion", json={**body, "prompt": text}, timeout=600).json()
                    tokens += out["tokens_predicted"]
                    drafted += out.get("timings", {}).get("draft_n", 0)
                    accepted += out.get("timings", {}).get("draft_n_accepted", 0)
                wall = time.perf_counter() - t0
                rows.append({"workload": name, "spec_type": spec_type or "none", "requests": n,
                             "tokens_per_s": tokens / wall, "draft_n": drafted, "draft_n_accepted": accepted})
                print(f"llama.cpp {spec_type or 'none'} {name}: {tokens / wall:.1f} tok/s "
                      f"(drafts {accepted}/{drafted})", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quick", action="store_true", help="few requests per point, short outputs")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--workloads", default="doc_qa,json,chat")
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="--speculative-num-draft-tokens")
    ap.add_argument("--topk", default="1", help="--speculative-eagle-topk values, e.g. 1,4 (> 1: draft trees); "
                                                "one speculative engine each")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved off/on rounds per point")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "speculative.json"))
    ap.add_argument("--llama-spec-types", default="", help="e.g. ngram-simple,ngram-mod: also run llama.cpp")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: bench_vs_llamacpp's build)")
    ap.add_argument("--llama-requests", type=int, default=8, help="requests per workload for llama.cpp")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp -t")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    max_new = 48 if args.quick else 128
    n_for = (lambda b: max(2, b)) if args.quick else (lambda b: max(8, 2 * b))
    results = {"config": vars(args), "points": []}
    with _engines(args) as engines:
        loads = workloads(engines["off"].tokenizer, max([n_for(b) for b in batches] + [args.llama_requests]))
        loads = {k: v for k, v in loads.items() if k in args.workloads.split(",")}
        for name, (texts, extra) in loads.items():
            params = {"temperature": 0, "max_new_tokens": max_new, **extra}
            for eng in engines.values():
                eng.generate(texts[0], {**params, "max_new_tokens": 4})  # warm-up (grammar compile)
            for b in batches:
                results["points"].extend(_point(engines, name, texts[:n_for(b)], params, b, args.repeats))
        for eng in engines.values():
            eng.check_integrity()
    if args.llama_spec_types:
        results["llama_cpp"] = llama_peer(args, loads, max_new)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out.replace(".json", ".png"))
    for p in results["points"]:
        print(f"{p['workload']:>7} b={p['batch']:<3} topk={p['topk']} off {p['tokens_per_s_off']:7.1f}  on "
              f"{p['tokens_per_s_on']:7.1f} tok/s  speedup {p['speedup']:.2f}x  accept "
              f"{p['mean_accept_length'] or 0:.2f}  identical {p['identical_outputs']}")


class _engines:
    """The plain engine ("off") and one NGRAM engine per --topk value, alive together so the
    runs of one point interleave (off, on, off, on...): a busy machine slows both alike."""

    def __init__(self, args):
        from lmprog_runtime import Engine
        self.engines = {"off": Engine(model_path=args.model_path, dtype=args.dtype)}
        for topk in [int(t) for t in args.topk.split(",")]:
            kw = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.num_draft_tokens,
                      speculative_eagle_topk=topk if topk > 1 else None)
            self.engines[topk] = Engine(model_path=args.model_path, dtype=args.dtype, **kw)

    def __enter__(self):
        return self.engines

    def __exit__(self, *exc):
        for eng in self.engines.values():
            eng.shutdown()


def _point(engines, name, texts, params, b: int, repeats: int) -> list:
    """Interleaved off/on runs of one (workload, batch): per topk the ratio of summed tokens/s."""
    runs = {key: [] for key in engines}
    for _ in range(repeats):
        for key, eng in engines.items():
            eng.flush_cache()
            runs[key].append(run(eng, texts, params, b))
    off = runs.pop("off")
    off_tps = statistics.mean(r["output_tokens_per_s"] for r in off)
    points = []
    for topk, rs in runs.items():
        on_tps = statistics.mean(r["output_tokens_per_s"] for r in rs)
        accepts = [r["mean_accept_length"] for r in rs if r["mean_accept_length"] is not None]
        points.append({"workload": name, "batch": b, "topk": topk, "requests": len(texts),
                       "tokens_per_s_off": off_tps, "tokens_per_s_on": on_tps, "speedup": on_tps / off_tps,
                       "mean_accept_length": statistics.mean(accepts) if accepts else None,
                       "steps_off": sum(r["counters"]["num_steps"] for r in off),
                       "counters_on": _summed([r["counters"] for r in rs]),
                       "identical_outputs": all(r["output_ids"] == off[0]["output_ids"] for r in rs)})
        c = points[-1]["counters_on"]
        print(f"{name} batch {b} topk {topk}: off {off_tps:.1f} on {on_tps:.1f} tok/s "
              f"({on_tps / off_tps:.2f}x), accept {points[-1]['mean_accept_length']}; steps off "
              f"{points[-1]['steps_off']} on {c.get('num_steps')} (verifying {c.get('spec_num_steps_drafted')}, "
              f"declined {c.get('spec_num_steps_declined')}, heuristic {c.get('spec_num_steps_heuristic')}, "
              f"calibrating {c.get('spec_num_steps_calibrating')})", flush=True)
    return points


def _summed(counters: list) -> dict:
    return {k: sum(c.get(k, 0) for c in counters) for k in counters[0]} if counters else {}


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({p["workload"] for p in results["points"]}, key=["doc_qa", "json", "chat"].index)
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [p for p in results["points"] if p["workload"] == name]
        topks = sorted({p["topk"] for p in mine})
        batches = sorted({p["batch"] for p in mine})
        width = 0.8 / (len(topks) + 1)
        xs = range(len(batches))
        first = [next(p for p in mine if p["batch"] == b) for b in batches]
        ax.bar([x - 0.4 + width / 2 for x in xs], [p["tokens_per_s_off"] for p in first], width, label="off",
               color="tab:gray")
        for i, topk in enumerate(topks):
            pts = [next(p for p in mine if p["batch"] == b and p["topk"] == topk) for b in batches]
            bars = ax.bar([x - 0.4 + width * (i + 1.5) for x in xs], [p["tokens_per_s_on"] for p in pts], width,
                          label=f"NGRAM topk {topk}")
            ax.bar_label(bars, labels=[f"{p['speedup']:.2f}x\nacc {p['mean_accept_length'] or 0:.1f}"
                                       for p in pts], fontsize=6)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"batch {b}" for b in batches])
        ax.set_title(name)
        ax.set_ylabel("output tokens/s")
        ax.legend(fontsize=7)
    fig.suptitle("NGRAM speculative decoding, greedy (lmprog Engine, SmolLM2-135M)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
