"""Paired A/B of a cfg engine mechanism on bench_grammar.py's corpora and loop.

The host's speed drifts by ~10% between identical runs minutes apart, more than most single
changes to the mask engine move the figures. So both variants run in one process, each with
a backend of its own, and every schema is compiled and its valid instances' masks timed
under both, in alternating order: the drift falls on both alike, and the per-schema ratio
of mask time is read beside the totals. A variant is a switch the engine reads at run time
(VARIANTS: the mechanism off for "old", on for "new").

    python bench/ab_grammar.py --variant bind --corpus suite
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_grammar as bg  # noqa: E402
from lmprog_runtime.constrained import GrammarBackendConfig, create_grammar_backend  # noqa: E402
from lmprog_runtime.constrained.base import GrammarError  # noqa: E402
from lmprog_runtime.constrained.cfg import table as table_mod  # noqa: E402


def _bind_switch():
    """TableWalker._bind (a value's end in the walk root's own open-object member, bound for the walk)."""
    bind, on = table_mod.TableWalker._bind, [True]

    def switched(self, *args):
        if on[0]:
            bind(self, *args)
    table_mod.TableWalker._bind = switched
    return lambda v: on.__setitem__(0, v)


def _first_states_switch():
    """A new table's room: 256 states (new) or 64 (old)."""
    def set_variant(v: bool) -> None:
        table_mod.FIRST_STATES = 256 if v else 64
    return set_variant


VARIANTS = {"bind": _bind_switch, "first-states": _first_states_switch}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    ap.add_argument("--corpus", default="suite", choices=sorted(bg.CORPORA))
    ap.add_argument("--limit", type=int, default=0, help="first N schemas (0 = all)")
    ap.add_argument("--out", default="", help="a JSON file for the figures (none by default)")
    args = ap.parse_args()
    set_variant = VARIANTS[args.variant]()
    tok = bg.load_tokenizer()
    cases = bg.load_cases(args.corpus)
    cases = cases[:args.limit] if args.limit else cases
    config = GrammarBackendConfig(schema_remotes=bg.SUITE_REMOTES if args.corpus == "suite" else ())
    backends = {v: create_grammar_backend("cfg", tok, len(tok), [tok.eos_token_id], config=config) for v in (False, True)}
    words = np.zeros(-(-len(tok) // 32), dtype=np.int32)
    masks: dict = {False: [], True: []}
    compiles: dict = {False: [], True: []}
    per: dict = {False: {}, True: {}}
    for k, case in enumerate(cases):
        if k % 50 == 0:
            print(f"{args.variant}: {k}/{len(cases)} schemas", file=sys.stderr, flush=True)
        for v in ((False, True) if k % 2 == 0 else (True, False)):
            set_variant(v)
            t0 = time.perf_counter()
            try:
                g0 = backends[v].get_future("json", json.dumps(case["schema"])).result(timeout=60)
            except Exception:  # noqa: BLE001 - refused or timed out: not timed
                continue
            compiles[v].append(time.perf_counter() - t0)
            for t in case["tests"]:
                if not t["valid"]:
                    continue
                g = g0.copy()
                for tid in tok.encode(bg.compact(t["data"]), add_special_tokens=False) + [tok.eos_token_id]:
                    t0 = time.perf_counter()
                    g.write_bitmask(words)
                    dt = time.perf_counter() - t0
                    masks[v].append(dt)
                    per[v][k] = per[v].get(k, 0.0) + dt
                    if not (words[tid >> 5] >> (tid & 31)) & 1:
                        break
                    try:
                        g.accept_token(tid)
                    except GrammarError:
                        break
    for b in backends.values():
        b.shutdown()
    out = {"variant": args.variant, "corpus": args.corpus}
    for v, name in ((False, "old"), (True, "new")):
        m, c = sorted(masks[v]), sorted(compiles[v])
        out[name] = {"masks": len(m), "mask_us_mean": round(1e6 * sum(m) / len(m), 1),
                     "mask_us_p99": round(1e6 * m[int(0.99 * len(m))], 1),
                     "compile_ms_p50": round(1e3 * statistics.median(c), 2),
                     "compile_ms_p95": round(1e3 * c[int(0.95 * len(c))], 2)}
    both = [k for k in per[False] if k in per[True]]
    out["schemas"] = len(both)
    out["mask_time_ratio"] = round(sum(per[True][k] for k in both) / sum(per[False][k] for k in both), 3)
    out["mask_time_ratio_less_5_slowest"] = round(sum(sorted(masks[True])[:-5]) / sum(sorted(masks[False])[:-5]), 3)
    out["median_schema_ratio"] = round(statistics.median(per[True][k] / per[False][k] for k in both), 3)
    print(json.dumps(out, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
