"""Write `docs/benchmarks.md` from the JSON results: every figure comes from a run.

Called by `bench/run_all.py` (also with `--report-only`). Reads the manifest (commands,
servers, machine) and `bench/results/{serving,programs}/*.json`, `one_batch.json`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
from typing import Dict, List, Optional

from bench.plots import _order, load_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AIM_SERVING = ("shared-prefix", "document-assistant")


def machine_info() -> Dict[str, str]:
    """CPU, cores, RAM and software versions of this machine (taken when the suite runs)."""
    info = {"cpu": platform.processor() or "unknown", "cores": str(os.cpu_count()), "ram": "unknown",
            "os": platform.platform(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        with open("/proc/meminfo") as f:
            kb = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            info["ram"] = f"{kb / 2 ** 20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    for dist in ("torch", "transformers", "llama_cpp_python", "lmprog"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = "not installed"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        info["commit"] = commit + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        info["commit"] = "unknown"
    return info


def _f(value, digits: int = 2, pct: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:.0%}" if pct else f"{value:.{digits}f}"


def _by(results: List[dict], workload: str) -> Dict[str, dict]:
    return {r["system"]: r for r in results if r["workload"] == workload}


def _commands(manifest: dict, kind: str, workload: str) -> List[str]:
    lines = [f"# {s['system']}: {s['status']}, {s['seconds']} s\n{s['command']}" for s in manifest["steps"]
             if s["kind"] == kind and s["workload"] == workload]
    return ["```", *lines, "```"] if lines else []


def serving_section(manifest, results) -> List[str]:
    out = ["## Serving workloads (`bench/bench_serving.py`)", "",
           "Latencies in ms. TTFT: time to first token; TPOT: time per output token after the first; ITL: "
           "gap between streamed tokens; E2E: request latency. Hit rate: prompt tokens served from the "
           "prefix cache.", ""]
    for workload in sorted({r["workload"] for r in results}):
        rows = _by(results, workload)
        out += [f"### {workload}", "",
                "| system | req/s | input tok/s | output tok/s | TTFT mean | TTFT p99 | TPOT mean | ITL median "
                "| E2E median | E2E p90 | E2E p99 | hit rate | requests |",
                "|---|" + "---:|" * 12]
        for system in _order(rows):
            m = rows[system]["metrics"]
            subset = m.get("subset")
            n = f"{m['completed']}" + (f" of {subset['of']}" if subset and subset["ran"] < subset["of"] else "")
            n += f" ({m['failed']} failed)" if m["failed"] else ""
            out.append(f"| {system} | {_f(m['request_throughput'])} | {_f(m['input_throughput'], 1)} | "
                       f"{_f(m['output_throughput'], 1)} | {_f(m['ttft_ms']['mean'], 0)} | "
                       f"{_f(m['ttft_ms']['p99'], 0)} | {_f(m['tpot_ms']['mean'], 0)} | "
                       f"{_f(m['itl_ms']['median'], 0)} | {_f(m['e2e_ms']['median'], 0)} | "
                       f"{_f(m['e2e_ms']['p90'], 0)} | {_f(m['e2e_ms']['p99'], 0)} | "
                       f"{_f(m['cache_hit_rate'], pct=True)} | {n} |")
        out += ["", *_commands(manifest, "serving", workload), ""]
    return out


def programs_section(manifest, results) -> List[str]:
    out = ["## Program workloads (`bench/bench_programs.py`)", "",
           "Quality: accuracy against the synthetic answer key (mmlu, hellaswag) or the share of outputs "
           "that parse as the requested JSON (json); a sanity signal for a 135M model, not a score.", ""]
    for workload in sorted({r["workload"] for r in results}):
        rows = _by(results, workload)
        out += [f"### {workload}", "",
                "| system | programs/s | programs | wall s | in flight | quality | hit rate | failed |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for system in _order(rows):
            m = rows[system]["metrics"]
            quality = f"{m['quality_name']} {_f(m['quality'])}" if m.get("quality_name") else "-"
            out.append(f"| {system} | {_f(m['programs_per_s'], 3)} | {m['programs']} | {_f(m['wall_s'], 1)} | "
                       f"{m['parallel']} | {quality} | {_f(m['cache_hit_rate'], pct=True)} | {m['failed']} |")
        errors = [f"- {s}: `{r['errors'][0][:160]}`" for s, r in rows.items() if r.get("errors")]
        out += ["", *(["First error per system:", *errors, ""] if errors else []),
                *_commands(manifest, "programs", workload), ""]
    return out


def _rate(result: Optional[dict]) -> Optional[float]:
    if result is None:
        return None
    m = result["metrics"]
    return m.get("request_throughput", m.get("programs_per_s"))


def _why(kind: str, lm: dict, other: dict, other_name: str) -> str:
    """What the measurements say about where lmprog's time goes (for a workload it loses)."""
    parts = []
    server = lm.get("server") or {}
    if server.get("step_s"):
        parts.append(f"lmprog spent {1 - server['scheduler_share']:.0%} of its scheduler step time in the model "
                     f"forward and {server['scheduler_share']:.0%} in scheduling/sampling/grammar work, "
                     f"{server.get('tokens_per_step', 0):.1f} generated tokens per step, "
                     f"cache hit rate {server.get('cache_hit_rate', 0):.0%}")
    if kind == "serving":
        a, b = lm["metrics"], other["metrics"]
        if a["ttft_ms"]["mean"] and b["ttft_ms"]["mean"]:
            parts.append(f"mean TTFT {a['ttft_ms']['mean']:.0f} vs {b['ttft_ms']['mean']:.0f} ms (prefill and "
                         f"queueing), mean TPOT {_f(a['tpot_ms']['mean'], 0)} vs {_f(b['tpot_ms']['mean'], 0)} ms "
                         f"(decode) against {other_name}")
    return "; ".join(parts) + "." if parts else "no server counters recorded."


def aim_section(results_by_kind, one_batch: Optional[dict]) -> List[str]:
    out = ["## Aim: lmprog against the alternatives", "",
           "Throughput of lmprog relative to each alternative on the shared-prefix serving workloads and "
           "the program workloads (requests/s or programs/s). Aim: at least 10x HF sequential `generate`, "
           "and ahead of llama.cpp's server.", "",
           "| workload | lmprog | x HF sequential | x llama.cpp | x lmprog no cache | aim |",
           "|---|---:|---:|---:|---:|---|"]
    behind = []
    for kind, workloads in (("serving", AIM_SERVING), ("programs", sorted({r["workload"] for r in
                                                                            results_by_kind["programs"]}))):
        for workload in workloads:
            rows = _by(results_by_kind[kind], workload)
            lm = rows.get("lmprog")
            if lm is None:
                continue
            ratios = {name: (_rate(lm) / _rate(rows[name]) if rows.get(name) and _rate(rows[name]) else None)
                      for name in ("hf-sequential", "llama.cpp", "lmprog-nocache")}
            met = []
            if ratios["hf-sequential"] is not None:
                met.append("10x HF: " + ("yes" if ratios["hf-sequential"] >= 10 else "no"))
            if ratios["llama.cpp"] is not None:
                met.append("ahead of llama.cpp: " + ("yes" if ratios["llama.cpp"] > 1 else "no"))
            x = {name: "n/a" if r is None else f"{r:.2f}x" for name, r in ratios.items()}
            out.append(f"| {kind}/{workload} | {_f(_rate(lm), 3)} | {x['hf-sequential']} | {x['llama.cpp']} | "
                       f"{x['lmprog-nocache']} | {', '.join(met) or '-'} |")
            for name, target in (("hf-sequential", 10.0), ("llama.cpp", 1.0)):
                r = ratios[name]
                if r is not None and r < target:
                    gap = (f"{r:.2f}x HF sequential, short of 10x by {10 / r:.1f}x" if name == "hf-sequential"
                           else f"behind llama.cpp by {1 - r:.0%} ({r:.2f}x)")
                    behind.append(f"- **{kind}/{workload}**: {gap}. {_why(kind, lm, rows[name], name)}")
    if behind:
        out += ["", "Where lmprog falls short, and what the counters say:", "", *behind]
    if one_batch:
        d1 = one_batch.get("decode_b1_vs_bandwidth_floor") or {}
        out += ["", f"Context from `one_batch` (model runner alone, {one_batch.get('dtype')}): prefill "
                f"{_f(one_batch['prefill']['tokens_per_s'], 0)} tok/s = "
                f"{_f(one_batch['prefill']['pct_of_matmul_peak'], 0)}% of the measured matmul peak; batch-1 "
                f"decode step {_f(d1.get('ratio'))}x the floor of reading its weights once at the memory-copy "
                f"bandwidth ({_f(d1.get('floor_ms'), 2)} ms; {_f(d1.get('ratio_kv'))}x with the K/V it reads, "
                f"{_f(d1.get('floor_kv_ms'), 2)} ms)."]
    return out + [""]


def one_batch_section(one_batch: Optional[dict], manifest: dict) -> List[str]:
    if not one_batch:
        return []
    out = ["## One batch (`bench/one_batch.py`)", "",
           "| measure | value |", "|---|---:|",
           *(f"| matmul peak {k} (GFLOP/s) | {_f(v, 1)} |" for k, v in one_batch.get("matmul_peak_gflops", {}).items()),
           f"| memory copy bandwidth (GB/s) | {_f(one_batch.get('copy_bandwidth_gbps'), 1)} |",
           f"| prefill ({one_batch['prefill']['input_len']} tokens), tok/s | "
           f"{_f(one_batch['prefill']['tokens_per_s'], 1)} |"]
    for bs, d in sorted(one_batch.get("decode", {}).items(), key=lambda kv: int(kv[0])):
        out.append(f"| decode batch {bs}: step ms / tok/s | {_f(d['step_ms'], 1)} / {_f(d['tokens_per_s'], 1)} |")
    cmd = (manifest.get("one_batch") or {}).get("command")
    out += ["", *([f"```\n{cmd}\n```"] if cmd else []), "![one batch](../bench/results/one_batch.png)", ""]
    return out


def write_report(manifest: dict, results_dir: str, doc_path: str) -> None:
    results = load_results(results_dir)
    one_batch = None
    if os.path.exists(os.path.join(results_dir, "one_batch.json")) and manifest.get("one_batch"):
        with open(os.path.join(results_dir, "one_batch.json")) as f:
            one_batch = json.load(f)
    machine = manifest.get("machine") or machine_info()
    lines = ["# Benchmarks", "",
             f"Generated by `{manifest.get('invocation', 'python bench/run_all.py')}` (`make bench` runs the full suite), "
             f"{manifest['mode']} sizes, started {manifest['started']}, "
             f"{_f((manifest.get('total_seconds') or 0) / 60, 1)} min in all. Do not edit: every figure comes from "
             "`bench/results/` and this file is rewritten by `python bench/run_all.py --report-only`.", "",
             "## Machine", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in machine.items()), "",
             "## Systems", "",
             "Same model everywhere: the embedded SmolLM2-135M-Instruct GGUF (Q4_1). lmprog keeps the weights "
             "4- or 8-bit where its start-up probe measures that faster (`--quantization auto`), else "
             "dequantizes to fp32; HF `transformers` dequantizes to fp32; llama.cpp runs the Q4_1 weights "
             "as stored. Greedy "
             "decoding; serving requests generate exactly their output length (`ignore_eos`; for "
             "llama.cpp a logit bias that bans the end tokens).", ""]
    for name, command in manifest.get("servers", {}).items():
        lines.append(f"- **{name}**: `{command}`")
    lines += ["- **hf-sequential**: `transformers` `generate`, one request (or one program's model call) at a "
              "time; on the slow workloads it runs the first N requests/programs and its rates are per "
              "request, comparable with the full runs (the tables say N of M).",
              "- **hf-batched**: `generate` on left-padded batches in dataset order (static batching).",
              "- Program workloads on llama.cpp go through `sgl.OpenAI` as a completion model "
              "(`/v1/completions`): the same programs; `json_schema` becomes a llama.cpp GBNF grammar; "
              "`select` scores echoed prompt logprobs, which needs the server's `--logits_all` (a second "
              "server instance, only for the workloads that select; llama.cpp takes one prompt per request, so "
              "each choice is its own request). On HF, constraints are not applied.",
              "- llama.cpp runs through `bench/baselines/llama_cpp_server.py`; `--no-extra-bufts` in its command "
              "means AMX/repacked weight buffers are off (they crash on AMX CPUs, see `bench/README.md`).", ""]
    for name, reason in manifest.get("skipped", {}).items():
        lines.append(f"- **{name} skipped**: {reason}")
    from bench.report_components import component_sections

    lines += ["", *aim_section(results, one_batch), *serving_section(manifest, results["serving"]),
              *programs_section(manifest, results["programs"]), *one_batch_section(one_batch, manifest),
              *component_sections(results_dir), "## Plots", ""]
    for name, title in (("throughput.png", "Throughput per system per workload"),
                        ("latency_cdf.png", "End-to-end latency CDFs"),
                        ("cache_hit_rate.png", "Cache hit rate over time")):
        if os.path.exists(os.path.join(results_dir, name)):
            lines += [f"### {title}", "", f"![{title}](../bench/results/{name})", ""]
    os.makedirs(os.path.dirname(doc_path), exist_ok=True)
    with open(doc_path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
