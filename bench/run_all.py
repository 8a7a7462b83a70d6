"""Every benchmark, in sequence, then the plots and `docs/benchmarks.md` (what `make bench` runs).

    python bench/run_all.py                 # the full suite (~50 min on 2 cores; run on a quiet machine)
    python bench/run_all.py --quick         # reduced sizes (~12 min), same tables
    python bench/run_all.py --report-only   # redraw plots and rewrite the doc from existing JSON
    python bench/run_all.py --systems lmprog llama.cpp --skip-one-batch

Systems: `lmprog` (the server), `lmprog-nocache` (`--disable-radix-cache`), `llama.cpp`
(llama-cpp-python's server on the same GGUF; skipped with a message where it is not
installed), `hf-sequential` and `hf-batched` (transformers `generate`). Each benchmark runs
as a subprocess whose exact command goes into the report; one that fails is recorded
and the suite goes on. Results: `bench/results/{serving,programs}/<workload>__<system>.json`,
`bench/results/manifest.json`, logs in `bench/results/logs/`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.baselines.servers import LlamaCppServer, LmprogServer, Unavailable, llama_cpp_available  # noqa: E402
from bench.report import machine_info, write_report  # noqa: E402

RESULTS = os.path.join(HERE, "results")
SYSTEMS = ("lmprog", "lmprog-nocache", "llama.cpp", "hf-sequential", "hf-batched")
PROGRAMS_NEEDING_SELECT = ("hellaswag", "tot")  # llama.cpp must echo prompt logprobs (--logits_all)
EOS_BIAS = {"0": -100, "2": -100}  # llama.cpp has no ignore_eos: ban SmolLM2's end tokens instead

# Sizes for 2 CPU cores: each workload should take at most ~2-3 min per system.
FULL = {
    "serving": {
        "random": ["--dataset-name", "random", "--num-prompts", "24", "--random-input-len", "256",
                   "--random-output-len", "32", "--random-range-ratio", "0.5"],
        "shared-prefix": ["--dataset-name", "shared-prefix", "--gsp-num-groups", "4", "--gsp-prompts-per-group", "8",
                          "--gsp-system-prompt-len", "512", "--gsp-question-len", "32", "--gsp-output-len", "32"],
        "document-assistant": ["--dataset-name", "document-assistant", "--num-prompts", "24", "--doc-tokens", "1000",
                               "--doc-output-len", "32"],
    },
    "hf_sequential_requests": {"random": 8, "shared-prefix": 8, "document-assistant": 6},
    "hf_batch_size": 8,
    "programs": {"mmlu": 32, "hellaswag": 24, "tot": 8, "json": 16, "chat": 12},
    "hf_programs": {"mmlu": 32, "hellaswag": 24, "tot": 3, "json": 8, "chat": 4},
    "parallel": 16,
    "one_batch": ["--batch-sizes", "1", "8", "32", "--input-len", "256", "--output-len", "8"],
}
QUICK = {
    "serving": {
        "random": ["--dataset-name", "random", "--num-prompts", "8", "--random-input-len", "128",
                   "--random-output-len", "16", "--random-range-ratio", "0.5"],
        "shared-prefix": ["--dataset-name", "shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "4",
                          "--gsp-system-prompt-len", "256", "--gsp-question-len", "16", "--gsp-output-len", "16"],
        "document-assistant": ["--dataset-name", "document-assistant", "--num-prompts", "8", "--doc-tokens", "500",
                               "--doc-output-len", "16"],
    },
    "hf_sequential_requests": {"random": 4, "shared-prefix": 4, "document-assistant": 3},
    "hf_batch_size": 4,
    "programs": {"mmlu": 8, "hellaswag": 8, "tot": 2, "json": 4, "chat": 4},
    "hf_programs": {"mmlu": 8, "hellaswag": 8, "tot": 1, "json": 2, "chat": 2},
    "parallel": 8,
    "one_batch": ["--batch-sizes", "1", "8", "--input-len", "128", "--output-len", "4"],
}

SMOKE = {  # proves the pipeline end to end in a few minutes; the figures mean nothing
    "serving": {
        "random": ["--dataset-name", "random", "--num-prompts", "2", "--random-input-len", "32",
                   "--random-output-len", "4"],
        "shared-prefix": ["--dataset-name", "shared-prefix", "--gsp-num-groups", "1", "--gsp-prompts-per-group", "3",
                          "--gsp-system-prompt-len", "64", "--gsp-question-len", "8", "--gsp-output-len", "4"],
        "document-assistant": ["--dataset-name", "document-assistant", "--num-prompts", "2", "--doc-tokens", "96",
                               "--doc-output-len", "4"],
    },
    "hf_sequential_requests": {"random": 1, "shared-prefix": 2, "document-assistant": 1},
    "hf_batch_size": 2,
    "programs": {"mmlu": 2, "hellaswag": 2, "tot": 1, "json": 1, "chat": 1},
    "hf_programs": {"mmlu": 1, "hellaswag": 1, "tot": 1, "json": 1, "chat": 1},
    "parallel": 2,
    "one_batch": ["--batch-sizes", "1", "2", "--input-len", "16", "--output-len", "2"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Suite:
    """Runs steps as subprocesses and keeps the manifest (command, status, seconds per step)."""

    def __init__(self, sizes: dict, mode: str, step_timeout: float):
        self.sizes, self.mode, self.step_timeout = sizes, mode, step_timeout
        self.server = None  # the server the current steps talk to; steps are not run once it has died
        self.manifest = {"mode": mode, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": [],
                         "servers": {}, "skipped": {}}

    def step(self, kind: str, system: str, workload: str, argv: List[str]) -> None:
        out = os.path.join(RESULTS, kind, f"{workload}__{system}.json")
        argv = argv + ["--system", system, "--output-file", os.path.relpath(out, ROOT)]
        command = shlex.join(["python"] + argv)
        n = len(self.manifest["steps"]) + 1
        print(f"\n[{n}] {kind} / {workload} / {system}\n    $ {command}", flush=True)
        t0 = time.perf_counter()
        if self.server is not None and not self.server.alive:
            status = f"not run: the {self.server.name} server had exited (see {self.server.log_path})"
        else:
            try:
                rc = subprocess.run([sys.executable] + argv, cwd=ROOT, timeout=self.step_timeout).returncode
                status = "ok" if rc == 0 else f"exit code {rc}"
            except subprocess.TimeoutExpired:
                status = f"timed out after {self.step_timeout:.0f}s"
        self.manifest["steps"].append({"kind": kind, "system": system, "workload": workload, "command": command,
                                       "status": status, "seconds": round(time.perf_counter() - t0, 1),
                                       "result": os.path.relpath(out, ROOT)})
        if status != "ok":
            print(f"    !! {status}", flush=True)

    def serving(self, system: str, base_url: str, backend: str, extra: Optional[List[str]] = None) -> None:
        for workload, dataset_args in self.sizes["serving"].items():
            argv = ["bench/bench_serving.py", "--backend", backend, "--base-url", base_url, *dataset_args,
                    "--ready-timeout", "600"] + (extra or [])
            self.step("serving", system, workload, argv)

    def programs(self, system: str, backend_args: List[str], workloads, sizes: dict, parallel: int) -> None:
        for workload in workloads:
            argv = ["bench/bench_programs.py", "--workload", workload, *backend_args,
                    "--num-programs", str(sizes[workload]), "--parallel", str(parallel)]
            self.step("programs", system, workload, argv)


def run_servers(suite: Suite, systems) -> None:
    all_programs = list(suite.sizes["programs"])
    for system in ("lmprog", "lmprog-nocache"):
        if system not in systems:
            continue
        server = LmprogServer(free_port(), disable_radix_cache=system == "lmprog-nocache")
        suite.manifest["servers"][system] = server.command
        print(f"\n== starting {system}: {server.command}", flush=True)
        with server as url:
            suite.server = server
            suite.serving(system, url, "lmprog", ["--flush-cache"])
            suite.programs(system, ["--backend", "lmprog", "--base-url", url], all_programs,
                           suite.sizes["programs"], suite.sizes["parallel"])
    if "llama.cpp" not in systems:
        return
    reason = llama_cpp_available()
    if reason:
        print(f"\n== skipping llama.cpp: {reason}", flush=True)
        suite.manifest["skipped"]["llama.cpp"] = reason
        return
    oai = ["--backend", "oai", "--oai-grammar", "gbnf"]
    plain = [w for w in all_programs if w not in PROGRAMS_NEEDING_SELECT]
    for logits_all, workloads in ((False, plain), (True, [w for w in all_programs if w in PROGRAMS_NEEDING_SELECT])):
        try:
            server = LlamaCppServer(free_port(), logits_all=logits_all)
        except Unavailable as e:
            suite.manifest["skipped"]["llama.cpp"] = str(e)
            return
        suite.manifest["servers"]["llama.cpp" + (" (logits_all, for select)" if logits_all else "")] = server.command
        print(f"\n== starting llama.cpp: {server.command}", flush=True)
        with server as url:
            suite.server = server
            if not logits_all:
                suite.serving("llama.cpp", url, "oai", ["--model", "SmolLM2-135M-Instruct",
                                                        "--extra-request-body", json.dumps({"logit_bias": EOS_BIAS})])
            # llama.cpp's server evaluates one request at a time; more threads only queue
            suite.programs("llama.cpp", oai + ["--base-url", url], workloads, suite.sizes["programs"],
                           suite.sizes["parallel"])


def run_hf(suite: Suite, systems) -> None:
    sizes = suite.sizes
    suite.server = None
    for mode in ("sequential", "batched"):
        system = f"hf-{mode}"
        if system not in systems:
            continue
        for workload, dataset_args in sizes["serving"].items():
            argv = ["bench/baselines/hf_generate.py", "--mode", mode, *dataset_args]
            argv += (["--max-requests", str(sizes["hf_sequential_requests"][workload])] if mode == "sequential"
                     else ["--batch-size", str(sizes["hf_batch_size"])])
            suite.step("serving", system, workload, argv)
    if "hf-sequential" in systems:
        suite.programs("hf-sequential", ["--backend", "hf"], list(sizes["programs"]), sizes["hf_programs"], 1)


def run_one_batch(suite: Suite) -> None:
    argv = ["bench/one_batch.py", *suite.sizes["one_batch"]]
    command = shlex.join(["python"] + argv)
    print(f"\n[one_batch]\n    $ {command}", flush=True)
    t0 = time.perf_counter()
    try:
        rc = subprocess.run([sys.executable] + argv, cwd=ROOT, timeout=suite.step_timeout).returncode
        status = "ok" if rc == 0 else f"exit code {rc}"
    except subprocess.TimeoutExpired:
        status = "timed out"
    suite.manifest["one_batch"] = {"command": command, "status": status, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced sizes")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the pipeline, not the speed")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--skip-one-batch", action="store_true")
    ap.add_argument("--report-only", action="store_true", help="only redraw plots and rewrite the doc")
    ap.add_argument("--step-timeout", type=float, default=900.0, help="seconds before a step is abandoned")
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    args = ap.parse_args()

    manifest_path = os.path.join(RESULTS, "manifest.json")
    if not args.report_only:
        for kind in ("serving", "programs"):  # a report never mixes two runs
            shutil.rmtree(os.path.join(RESULTS, kind), ignore_errors=True)
        mode = "smoke" if args.smoke else "quick" if args.quick else "full"
        suite = Suite({"smoke": SMOKE, "quick": QUICK, "full": FULL}[mode], mode, args.step_timeout)
        suite.manifest["invocation"] = shlex.join(["python", "bench/run_all.py"] + sys.argv[1:])
        suite.manifest["machine"] = machine_info()
        t0 = time.perf_counter()
        run_servers(suite, args.systems)
        run_hf(suite, args.systems)
        if not args.skip_one_batch:
            run_one_batch(suite)
        suite.manifest["total_seconds"] = round(time.perf_counter() - t0, 1)
        os.makedirs(RESULTS, exist_ok=True)
        with open(manifest_path, "w") as f:
            json.dump(suite.manifest, f, indent=1)

    from bench import plots
    plots.make_all(RESULTS)
    with open(manifest_path) as f:
        manifest = json.load(f)
    write_report(manifest, RESULTS, args.doc)
    print(f"\nwrote {os.path.relpath(args.doc, ROOT)}")
    failed = [s for s in manifest["steps"] if s["status"] != "ok"]
    for s in failed:
        print(f"  failed: {s['kind']} / {s['workload']} / {s['system']}: {s['status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
