"""Sections of `docs/benchmarks.md` for the component benchmarks (one per issue), each read
from its JSON under `bench/results/`; a missing file leaves its section out."""

from __future__ import annotations

import json
import os
from typing import List, Optional

from bench.report import _f


def _load(results_dir: str, name: str) -> Optional[dict]:
    path = os.path.join(results_dir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def one_batch_dtypes(results_dir: str) -> List[str]:
    rows = []
    for name in ("one_batch_fp32.json", "one_batch.json", "one_batch_kv_bf16.json"):
        d = _load(results_dir, name)
        if not d:
            continue
        peak = d["matmul_peak_gflops"]
        dec = d["decode"]
        kv = d.get("kv_cache_dtype", d["dtype"])
        label = d["dtype"] + (", `--kv-cache-dtype bf16`" if kv == "bfloat16" and d["dtype"] != "bfloat16" else "")
        rows.append(
            f"| {label} | {d.get('quantization', 'none')} | {_f(peak.get('float32'), 0)} / {_f(peak.get('bfloat16'), 0)} | {_f(d['copy_bandwidth_gbps'], 1)} / {_f(d.get('read_bandwidth_gbps'), 1)} | "
            f"{_f(d['prefill']['tokens_per_s'], 0)} ({_f(d['prefill']['pct_of_matmul_peak'], 0)}% of its peak) | "
            + " | ".join(f"{_f(dec[b]['step_ms'], 1)} ms / {_f(dec[b]['tokens_per_s'], 0)}" if b in dec else "–"
                         for b in ("1", "8", "32", "64"))
            + f" | {_f(d['decode_b1_vs_bandwidth_floor']['ratio'], 2)}x | {_f(d['decode_b32_over_b1_throughput'], 1)}x |")
    if not rows:
        return []
    return ["## Runtime core: one batch per dtype (`bench/one_batch.py`)", "",
            "The model runner alone (no scheduler), SmolLM2-135M, 512-token prompt, decode steps at the batch "
            "sizes shown, 2 threads. Aims: prefill ≥ 50% of the matmul peak of its dtype; batch-1 decode step "
            "≤ 1.5x the weight-bytes/bandwidth floor of its weight format; batch-32 decode ≥ 8x batch-1 tokens/s. "
            "The first row is dense float32; the second is what `--dtype auto --quantization auto` picks here "
            "by measuring at start-up.", "",
            "| dtype | weights | matmul peak fp32 / bf16 (GFLOP/s) | copy / read GB/s | prefill tok/s | decode b1 | b8 | b32 | b64 "
            "| b1 step / floor | b32/b1 |",
            "|---|---|---|---:|---|---|---|---|---|---:|---:|", *rows, "",
            "```\npython bench/one_batch.py --dtype float32 --quantization none --batch-sizes 1 8 32 64 --input-len 512 --output-len 16\n"
            "python bench/one_batch.py --dtype auto --batch-sizes 1 8 32 64 --input-len 512 --output-len 16\n"
            "python bench/one_batch.py --dtype auto --kv-cache-dtype bf16 --batch-sizes 1 8 32 64 --input-len 512 "
            "--output-len 16\n```", ""]


def prefix_cache(results_dir: str) -> List[str]:
    d = _load(results_dir, "prefix_cache.json")
    if not d:
        return []
    cfg, da, ns = d["config"], d["document_assistant"], d.get("no_sharing") or {}
    out = ["## RadixAttention: document assistant, cache on vs off (`bench/bench_prefix_cache.py`)", "",
           f"{cfg['num_requests']} requests share one ~{cfg['doc_tokens']}-token handbook, each with its own "
           f"question, {cfg['output_len']} output tokens, all submitted at once to the in-process Engine "
           f"(policy `{cfg['policy']}`).", "",
           "| workload | cache | requests/s | output tok/s | mean TTFT (s) | hit rate | scheduler share of step |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for wname, w in (("document assistant", da), ("no sharing", ns)):
        for key in ("cache_on", "cache_off"):
            if key in w:
                r = w[key]
                out.append(f"| {wname} | {key.split('_')[1]} | {_f(r['request_throughput'], 2)} | "
                           f"{_f(r['output_throughput'], 1)} | {_f(r['mean_ttft_s'], 2)} | {_f(100 * r['hit_rate'], 1)}% | "
                           f"{_f(100 * r.get('scheduler_share', 0), 1)}% |")
    out += ["", f"Document assistant: **{_f(da['throughput_ratio'], 2)}x** throughput and "
                f"**{_f(da['ttft_ratio'], 2)}x** lower mean TTFT with the cache."]
    if "overhead" in ns:
        out.append(f"No sharing: the cache costs **{_f(100 * ns['overhead'], 2)}%** of throughput "
                   "(negative = faster with the cache; run-to-run noise on this machine is a few %).")
    out += ["", "```\npython bench/bench_prefix_cache.py\n```", "![prefix cache](../bench/results/prefix_cache.png)", ""]
    return out


def jump_forward(results_dir: str) -> List[str]:
    d = _load(results_dir, "jump_forward.json")
    if not d:
        return []
    cfg = d["config"]
    ws = repr(cfg["whitespace"])
    out = ["## Constrained decoding: JSON extraction, jump-forward on vs off (`bench/bench_jump_forward.py`)", "",
           f"{cfg['num_requests']} chat-templated extraction requests, a 6-field JSON Schema, greedy, all at once "
           f"(whitespace pattern {ws}); mask cost from the scheduler's counters (wall time of building the "
           "step's mask rows, per constrained row). At batch 1 on this CPU each step's Python work runs "
           "right after a forward that streamed the weights through the caches: a 100-lookup Python "
           "function measured 2.7 µs warm and 28 µs there, which is most of the batch-1 figure.", "",
           "| jump-forward | decode steps | requests/s | mean latency (s) | sampled / forced tokens | valid | "
           "mask µs per constrained token, batch "
           f"{cfg['num_requests']} / 32 / 1 |", "|---|---:|---:|---:|---:|---:|---:|"]
    for key in ("jump_forward_on", "jump_forward_off"):
        b, s = d[key]["batch"], d[key]["batch1"]
        b32 = d[key].get("batch32", {}).get("mask_us_per_constrained_token")
        out.append(f"| {key.split('_')[-1]} | {b['decode_steps']} | {_f(b['requests_per_s'], 2)} | "
                   f"{_f(b['mean_latency_s'], 2)} | {b['sampled_tokens']} / {b['jump_forward_tokens']} | "
                   f"{b['valid']}/{b['requests']} | {_f(b['mask_us_per_constrained_token'], 1)} / "
                   f"{_f(b32, 1)} / {_f(s['mask_us_per_constrained_token'], 1)} |")
    out += ["", f"Jump-forward: **{_f(d['steps_ratio'], 2)}x** fewer decode steps, **{_f(d['throughput_ratio'], 2)}x** "
                f"throughput (`--dtype {cfg['dtype']}`){_jf_identity(d)}.", *_jf_fp32(results_dir),
            "", "```\npython bench/bench_jump_forward.py\n```",
            "![jump-forward](../bench/results/jump_forward.png)", ""]
    return out


def _jf_identity(d: dict) -> str:
    if "outputs_differing" not in d:
        return ""
    n = d["config"]["num_requests"]
    return (f"; greedy outputs with it on equal those with it off for {n - d['outputs_differing']} of {n} "
            "requests")


def _jf_fp32(results_dir: str) -> List[str]:
    """The float32 run, where the forward is batch-invariant: jump-forward must change nothing."""
    d = _load(results_dir, "jump_forward_fp32.json")
    if not d:
        return []
    return ["", f"With `--dtype float32` (`bench/results/jump_forward_fp32.json`): {_f(d['steps_ratio'], 2)}x fewer decode "
                f"steps, {_f(d['throughput_ratio'], 2)}x throughput{_jf_identity(d)}. Jump-forward drafts the forced "
                "text and verifies it in the forward (docs/constrained.md), so outputs differ only where the "
                "forward itself is not batch-invariant: under `--dtype auto` a multi-row verify step rounds "
                "differently from a one-token decode (`--enable-deterministic-inference` removes that)."]


def grammar_coverage(results_dir: str) -> List[str]:
    d = _load(results_dir, "grammar.json")
    if not d or "corpora" not in d:
        return []
    out = ["## Constrained decoding: JSON Schema coverage (`bench/bench_grammar.py`)", "",
           "Two corpora: `dev` (tests/data/jsonschemabench-dev, real-world schemas) and `suite` "
           "(JSON-Schema-Test-Suite draft 2020-12, keyword semantics), every engine in the same run, "
           f"tokenizer {d.get('tokenizer', 'SmolLM2')}. Token level: each instance's compact JSON is walked "
           "through the engine's masks and `accept_token`, then EOS. Valid accepted / invalid rejected are "
           "over compiled schemas; fully correct = compiled and every instance right, over all schemas. "
           "Compile time is the first request's wait for its grammar (cold cache); mask µs/token is the "
           "scheduler's `write_bitmask` (an int32 bitmask row, SGLang's layout) per token of the valid "
           "instances, first visits of states included. "
           "`cfg` is lmprog's grammar engine and the default backend, `outlines` the regex-DFA backend "
           "(the default before cfg); llguidance and xgrammar are the optional adapters behind the same "
           "interface (an engine missing from the table was not installed for that run)."
           + (f" Run on a {d['note']}." if d.get("note") else ""), "",
           "| corpus | engine | compiles % | valid accepted % | invalid rejected % | fully correct % | "
           "compile p50 / p95 ms | mask µs/token mean / p99 |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for corpus, per in d["corpora"].items():
        for name, r in per.items():
            out.append(f"| {corpus} | {name} | {_f(r['compile_pct'], 1)} | {_f(r['valid_accepted_pct'], 1)} | "
                       f"{_f(r['invalid_rejected_pct'], 1)} | {_f(r['fully_correct_pct'], 1)} | "
                       f"{_f(r['compile_ms_p50'], 1)} / {_f(r['compile_ms_p95'], 1)} | "
                       f"{_f(r['mask_us_mean'], 1)} / {_f(r['mask_us_p99'], 1)} |")
    out += ["", "```\npython bench/bench_grammar.py\n```", "![grammar](../bench/results/grammar.png)", ""]
    return out


def frontend_overhead(results_dir: str) -> List[str]:
    d = _load(results_dir, "frontend_overhead.json")
    if not d:
        return []
    return ["## Frontend overhead (`bench/bench_frontend_overhead.py`)", "",
            f"A one-`gen(max_tokens=1)` program vs the same raw `POST /generate` (keep-alive), medians of {d['runs']} "
            "interleaved runs against a live server.", "",
            "| raw HTTP median (ms) | lmprog median (ms) | overhead (ms) | target |", "|---:|---:|---:|---:|",
            f"| {_f(d['raw_http_median_ms'], 2)} | {_f(d['lmprog_median_ms'], 2)} | {_f(d['overhead_ms'], 2)} | "
            f"< {d['target_ms']} ms |", "", "```\npython bench/bench_frontend_overhead.py --url http://127.0.0.1:PORT\n```", ""]


def _speculative_steps(d: dict) -> List[str]:
    """Step counts per point (runs since #13 record them): what the cost rule decided."""
    pts = [p for p in d["points"] if p.get("counters_on")]
    if not pts:
        return []
    out = ["", "Steps of those runs (summed over the repeats): the plain engine's, the speculative one's, and of "
               "the latter how many verified drafts, were declined by the cost rule, were decided by its "
               "heuristic (verify costs not yet measured at that batch size) or ran plain to measure it:", "",
           "| workload | batch | topk | steps off | steps on | verifying | declined | heuristic | calibrating |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in pts:
        c = p["counters_on"]
        out.append(f"| {p['workload']} | {p['batch']} | {p.get('topk', 1)} | {p['steps_off']} | {c.get('num_steps')} | "
                   f"{c.get('spec_num_steps_drafted')} | {c.get('spec_num_steps_declined')} | "
                   f"{c.get('spec_num_steps_heuristic')} | {c.get('spec_num_steps_calibrating')} |")
    return out


def _speculative_busy(results_dir: str) -> List[str]:
    """A run on the busy development machine (bench/results/speculative_busy.json), labelled as such."""
    d = _load(results_dir, "speculative_busy.json")
    if not d:
        return []
    out = ["", f"On the busy development machine (`--quick --repeats {d['config'].get('repeats', 1)}`, other jobs "
               "sharing its 2 cores: ratios of interleaved runs, not figures), after the #13 cost-rule changes. "
               "Read the step counts: where steps on = off and (nearly) nothing verified, the two engines did "
               "the same work, so the ratio there is the machine's noise:", "",
           "| workload | batch | off tok/s | on tok/s | speedup | accept length | steps off | steps on |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in d["points"]:
        out.append(f"| {p['workload']} | {p['batch']} | {_f(p['tokens_per_s_off'], 1)} | {_f(p['tokens_per_s_on'], 1)} | "
                   f"{_f(p['speedup'], 2)}x | {_f(p['mean_accept_length'], 2)} | {p.get('steps_off', '')} | "
                   f"{p.get('counters_on', {}).get('num_steps', '')} |")
    return out


def speculative(results_dir: str) -> List[str]:
    d = _load(results_dir, "speculative.json")
    if not d:
        return []
    quick = " (`--quick`: a smoke-sized run)" if d["config"].get("quick") else ""
    out = ["## Speculative decoding: NGRAM on vs off (`bench/bench_speculative.py`)", "",
           f"SmolLM2-135M, greedy{quick}; requests run in groups of the batch size. Accept length = tokens per "
           "verify step (accepted drafts + 1), the mean of the requests' `meta_info.spec_accept_length`. "
           "Aim: ≥ 1.8x at batch 1 on document QA and JSON extraction, ≥ 0.95x on free chat. "
           f"Weights: `--dtype {d['config'].get('dtype', 'auto')}`.", "",
           "| workload | batch | topk | requests | off tok/s | on tok/s | speedup | accept length | identical outputs |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in d["points"]:
        out.append(f"| {p['workload']} | {p['batch']} | {p.get('topk', 1)} | {p['requests']} | "
                   f"{_f(p['tokens_per_s_off'], 1)} | "
                   f"{_f(p['tokens_per_s_on'], 1)} | **{_f(p['speedup'], 2)}x** | {_f(p['mean_accept_length'], 2)} | "
                   f"{'yes' if p['identical_outputs'] else 'no'} |")
    if d.get("llama_cpp"):
        note = f" ({d['llama_cpp_note']})" if d.get("llama_cpp_note") else ""
        out += ["", "llama.cpp `llama-server -np 1` on the same prompts at batch 1 (its `--spec-type`; drafts "
                    f"accepted / proposed from its own timings){note}:", "",
                "| workload | spec type | tok/s | drafts accepted / proposed |", "|---|---|---:|---:|"]
        for r in d["llama_cpp"]:
            out.append(f"| {r['workload']} | {r['spec_type']} | {_f(r['tokens_per_s'], 1)} | "
                       f"{r['draft_n_accepted']} / {r['draft_n']} |")
    fp32 = _load(results_dir, "speculative_fp32.json")
    if fp32 and fp32 is not d:
        out += ["", "The same with `--dtype float32` (dense float32 weights: outputs are token-identical, as measured here; "
                    "with the quantized formats "
                    "`--dtype auto` picks, a step's kernel and activation rounding depend on how many rows it "
                    "has, so outputs drift when a verify step adds rows, as they do between batch sizes "
                    "without speculation):", "",
                "| workload | batch | off tok/s | on tok/s | speedup | accept length | identical outputs |",
                "|---|---:|---:|---:|---:|---:|---|"]
        for p in fp32["points"]:
            out.append(f"| {p['workload']} | {p['batch']} | {_f(p['tokens_per_s_off'], 1)} | "
                       f"{_f(p['tokens_per_s_on'], 1)} | **{_f(p['speedup'], 2)}x** | "
                       f"{_f(p['mean_accept_length'], 2)} | {'yes' if p['identical_outputs'] else 'no'} |")
    out += _speculative_steps(d) + _speculative_busy(results_dir)
    out += ["", "```\npython bench/bench_speculative.py [--quick] [--llama-spec-types ngram-simple,ngram-mod]\n"
            "python bench/bench_speculative.py --dtype float32 --out bench/results/speculative_fp32.json\n```",
            "![speculative](../bench/results/speculative.png)", ""]
    return out


def component_sections(results_dir: str) -> List[str]:
    return [*vs_llamacpp(results_dir), *one_batch_dtypes(results_dir), *prefix_cache(results_dir),
            *hicache(results_dir), *overlap(results_dir), *jump_forward(results_dir),
            *speculative(results_dir), *grammar_coverage(results_dir), *frontend_overhead(results_dir),
            *disaggregation(results_dir), *router(results_dir)]


def _disagg_verdict(setups: List[dict]) -> List[str]:
    """Where the split wins and where it loses, read off the numbers (colocated first)."""
    if len(setups) != 2:
        return []
    colo, pd = setups
    lines = []
    for metric, what in (("short_itl", "inter-token latency"), ("short_ttft", "time to first token")):
        for stat in ("median_ms", "p99_ms"):
            a, b = colo[metric][stat], pd[metric][stat]
            if a and b:
                lines.append(f"{what} {stat[:-3]}: {'lower' if b < a else 'higher'} split "
                             f"({_f(b / a, 2)}x colocated)")
    return ["On these cores, with one thread per half: " + "; ".join(lines) + ". A prompt waits for the "
            "single prefill thread where the colocated server uses both; the decode steps no longer "
            "wait for long prefills."]


def disaggregation(results_dir: str) -> List[str]:
    d = _load(results_dir, "disagg.json")
    if not d:
        return []
    out = ["## Prefill/decode disaggregation (`bench/bench_disagg.py`)", "",
           f"{d['workload']}; {d['model_path']}, KV over {d['transfer_backend']}"
           + (" (quick sizes, `--quick`)" if d.get("quick") else "") + ". Latencies of the short requests, ms.", "",
           "| setup | TTFT median | TTFT p99 | ITL median | ITL p99 | KV per request | transfer per request |",
           "|---|---|---|---|---|---|---|"]
    for name, r in d["setups"].items():
        mb = r.get("bytes_per_request")
        ms = r.get("transfer_ms_per_request")
        out.append(f"| {name} | {_f(r['short_ttft']['median_ms'], 0)} | {_f(r['short_ttft']['p99_ms'], 0)} | "
                   f"{_f(r['short_itl']['median_ms'], 0)} | {_f(r['short_itl']['p99_ms'], 0)} | "
                   f"{'-' if mb is None else _f(mb / 1e6, 1) + ' MB'} | {'-' if ms is None else _f(ms, 1) + ' ms'} |")
    out += ["", *_disagg_verdict(list(d["setups"].values())), "", *_planner_beside(results_dir),
            "```\npython bench/bench_disagg.py" + (" --quick" if d.get("quick") else "") + "\n```",
            "![disagg](../bench/results/disagg.png)", ""]
    return out


def _planner_beside(results_dir: str) -> List[str]:
    """`plan-kv`'s prediction for the same workload (bench/results/plan_kv.json), if it was run."""
    p = _load(results_dir, "plan_kv.json")
    if not p:
        return []
    row = next(r for r in p["links"] if r["topology"] == "tcp-same-host")
    v, r, m = row["verdict"], p["rates"], p.get("measured_link")
    out = [f"The planner for this workload (`lmprog-runtime plan-kv --prompt-tokens {p['prompt_tokens']} "
           f"--output-tokens {p['output_tokens']} --arrival-rate {p['arrival_rate']} --measure-link`, rates "
           f"{r['source']}: prefill {_f(r['prefill_s'] * 1000, 0)} ms, decode step {_f(r['decode_step_s'] * 1000, 1)} ms): "
           f"{_f(p['bytes_per_request_transferred'] / 2**20, 1)} MiB of KV per long request, "
           f"{_f(row['transfer_s'] * 1000, 1)} ms over same-host TCP; ITL colocated {_f(v['colocated_itl_s'] * 1000, 1)} ms "
           f"vs split {_f(v['disagg_itl_s'] * 1000, 1)} ms; pays off: {'yes' if v['pays_off'] else 'no'} ({v['reason']})."]
    if m:
        out.append(f"Its same-host TCP time against a measured Mooncake TCP transfer of the same bytes: "
                   f"{_f(m['transfer_s'] * 1000, 1)} ms measured vs {_f(m['predicted_s'] * 1000, 1)} ms predicted "
                   f"(measured / predicted = {_f(m['factor_measured_over_predicted'], 2)}).")
    out.append("The planner models utilization, not queues: it gets the inter-token latency's direction "
               "right and misses the time to first token, which here is the wait behind the one prefill thread.")
    return [*out, ""]


def router(results_dir: str) -> List[str]:
    d = _load(results_dir, "router.json")
    if d is None or d["config"].get("quick"):
        return []
    c, runs = d["config"], d["runs"]
    out = ["## Data parallel behind SGLang's router (`bench/bench_router.py`)", "",
           f"{c['docs']} documents (~{c['doc_tokens']} tokens) x {c['questions']} questions in random order, "
           f"{c['clients']} clients, {c['output_len']} output tokens; two SmolLM2 replicas with one thread each "
           f"and a KV pool of {c['max_total_tokens']} tokens (about half the documents) each, behind the real "
           "`sglang-router`; and one `--dp-size 2` server balancing the same two replicas in-process.", "",
           "| setup | requests/s | prefix hit rate | mean TTFT (s) | median TTFT (s) |", "|---|---:|---:|---:|---:|"]
    for name, r in runs.items():
        out.append(f"| {name} | {_f(r['request_throughput'], 2)} | {r['hit_rate']:.0%} | "
                   f"{_f(r['mean_ttft_s'], 2)} | {_f(r['median_ttft_s'], 2)} |")
    cmp = d.get("cache_aware_vs_round_robin")
    if cmp:
        out += ["", f"cache_aware vs round_robin: {_f(cmp['throughput'], 2)}x the throughput, hit rate "
                    f"{cmp['hit_rate'][0]:.0%} vs {cmp['hit_rate'][1]:.0%} (SGLang reports 1.9x and 75% vs 20%)."]
    out += ["", "```\npython bench/bench_router.py\n```", "![router](../bench/results/router.png)", ""]
    return out


def hicache(results_dir: str) -> List[str]:
    d = _load(results_dir, "hicache.json")
    if not d:
        return []
    cfg, runs = d["config"], d["runs"]
    issue = cfg["docs"] == 32 and cfg["questions"] == 8 and cfg["doc_tokens"] == 1500
    size = ("quick sizes (`--quick`)" if cfg.get("quick") else "the issue's sizes" if issue
            else "smaller than the issue's 32 documents x 8 questions")
    out = ["## HiCache: documents beyond L1 (`bench/bench_hicache.py`)", "",
           f"{cfg['docs']} distinct ~{cfg['doc_tokens']}-token documents x {cfg['questions']} questions in one "
           f"random order, {cfg['concurrency']} requests in flight, {cfg['output_len']} output tokens, L1 = "
           f"{cfg['l1_tokens']} tokens (~{cfg['l1_docs']} documents), L2 = {cfg['hicache_ratio']} x L1, "
           f"{size}. Hit rates: share of prompt tokens served from each tier.", "",
           "| config | requests/s | total tok/s | mean TTFT (s) | L1 | L2 | L3 | recomputed | x throughput | x TTFT |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in runs.items():
        h = r["hit_rate"]
        out.append(f"| {name} | {_f(r['request_throughput'], 2)} | {_f(r['total_token_throughput'], 0)} | "
                   f"{_f(r['mean_ttft_s'], 3)} | {_f(100 * h['L1'], 1)}% | {_f(100 * h['L2'], 1)}% | "
                   f"{_f(100 * h['L3'], 1)}% | {_f(100 * h['recomputed'], 1)}% | "
                   f"{_f(r.get('throughput_vs_off'), 2)} | {_f(r.get('ttft_vs_off'), 2)} |")
    out += ["", *_hicache_why(cfg, runs),
            "", "```\npython bench/bench_hicache.py" + (" --quick" if cfg.get("quick") else "") + "\n```",
            "![hicache](../bench/results/hicache.png)", ""]
    return out


def _hicache_why(cfg: dict, runs: dict) -> List[str]:
    """What bounds the gain here, from the run's own numbers (SGLang reports up to 6x
    throughput and -80% TTFT on reuse-heavy GPU workloads)."""
    top = runs.get("L2+L3") or runs.get("L2")
    if not top or "off" not in runs:
        return []
    cm, loaded = top["cost_model"], (top["hit_rate"]["L2"] + top["hit_rate"]["L3"]) * top["prompt_tokens"]
    per_token = top["bytes"]["l2_load_bytes"] / loaded if loaded else 0
    cheaper = (cm["hicache_l2_load_bytes_per_s"] / (per_token * cm["hicache_prefill_tokens_per_s"])
               if per_token and cm["hicache_prefill_tokens_per_s"] else None)
    floor = 1 / cfg["questions"]
    return [f"Why this size of gain: on this CPU a prompt token is prefilled at "
            f"~{_f(cm['hicache_prefill_tokens_per_s'], 0)} tokens/s while loading its KV back from L2 moves "
            f"{_f(per_token / 1024, 0)} KiB at {_f(cm['hicache_l2_load_bytes_per_s'] / 1e9, 2)} GB/s, "
            f"so a load-back is ~{_f(cheaper, 0)}x cheaper than recomputing and every L2/L3 hit pays. What "
            f"is left is compulsory: each document's first prefill, about 1/{cfg['questions']} = {_f(100 * floor, 0)}% "
            f"of the prompt tokens here (roughly the best possible recomputed share), against "
            f"{_f(100 * runs['off']['hit_rate']['recomputed'], 0)}% recomputed with the radix cache alone and "
            f"{_f(100 * top['hit_rate']['recomputed'], 0)}% with HiCache. The throughput gain is bounded by "
            "that prefill saving (decode steps cost the same), and TTFT also carries queueing behind other "
            "prefills. SGLang's up-to-6x figures come from GPUs with many more reuses per document and from "
            "overlapping the copies with the forward layer by layer on CUDA streams; here the copies are "
            "synchronous memcpys."]


def overlap(results_dir: str) -> List[str]:
    d = _load(results_dir, "overlap.json")
    if not d:
        return []
    rows = [f"| {k} | {_f(100 * d[k]['scheduler_share'], 1)}% | {_f(d[k]['request_throughput'], 2)} | "
            f"{_f(d[k]['mean_ttft_s'], 2)} |" for k in ("on", "off")]
    return ["## Overlap scheduling on vs off (`bench/bench_overlap.py`)", "",
            f"{d['config']['num_requests']} distinct ~200-token prompts, {d['config']['output_len']} output tokens, "
            "Engine with the radix cache on. Scheduler share = 1 - forward time / step time (with overlap on, the CPU "
            "work done during the forward is hidden). On this 2-core CPU the forward thread and the scheduler "
            "compete for the cores and overlap is slower, so it is on by default only on GPUs "
            "(`--force-overlap-schedule` turns it on anyway).", "",
            "| overlap | scheduler share of step time | requests/s | mean TTFT (s) |", "|---|---:|---:|---:|", *rows,
            "", "```\npython bench/bench_overlap.py\n```", ""]


def vs_llamacpp(results_dir: str) -> List[str]:
    """lmprog against llama.cpp's llama-server (`bench/bench_vs_llamacpp.py`): its own table."""
    d = _load(results_dir, "vs_llamacpp.json")
    if not d:
        return []
    size = "quick sizes (`--quick`)" if d.get("quick") else "the issue's sizes"
    cmds = [f"- {name}: `{r.get('command', '')}`" for name, r in d["results"].items()]
    plot = ["", "![lmprog / llama.cpp](../bench/results/vs_llamacpp.png)"] \
        if os.path.exists(os.path.join(results_dir, "vs_llamacpp.png")) else []
    return ["## lmprog against llama.cpp (`bench/bench_vs_llamacpp.py`)", "",
            f"Same GGUF (the embedded SmolLM2-135M-Instruct Q4_1), same CPU, greedy, fixed output lengths, "
            f"{d['threads']} threads each, {size}. Aims: batch-1 decode >= 1.0x llama.cpp, document assistant "
            ">= 2x llama.cpp's best setting, cold prefill >= 1.0x, ready <= 5 s warm. Rates are higher-is-better "
            "(decode-b1: tokens/s; prefill: prompt tokens/s; the rest: requests/s).", "",
            d["table"], *plot, "", "Servers:", *cmds, "", "```\npython bench/bench_vs_llamacpp.py\n```", ""]
