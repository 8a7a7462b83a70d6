"""PNG plots from the JSON results (`bench/results/serving/*.json`, `bench/results/programs/*.json`).

    python bench/plots.py [--results bench/results]

- `throughput.png`: request throughput per system per serving workload, and programs/s
  per system per program workload (log scale: the systems differ by orders of magnitude);
- `latency_cdf.png`: end-to-end latency CDF per system, one panel per serving workload;
- `cache_hit_rate.png`: cumulative prefix-cache hit rate over the run — from the
  per-request `cached_tokens` (serving) and from the server's counters sampled every
  second (programs).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
SYSTEM_ORDER = ["lmprog", "lmprog-nocache", "llama.cpp", "hf-batched", "hf-sequential"]
COLORS = {"lmprog": "tab:green", "lmprog-nocache": "tab:olive", "llama.cpp": "tab:blue",
          "hf-batched": "tab:orange", "hf-sequential": "tab:red"}


def load_results(results_dir: str = RESULTS) -> Dict[str, List[dict]]:
    out = {}
    for kind in ("serving", "programs"):
        out[kind] = []
        for path in sorted(glob.glob(os.path.join(results_dir, kind, "*.json"))):
            with open(path) as f:
                out[kind].append(json.load(f))
    return out


def _order(systems) -> List[str]:
    known = [s for s in SYSTEM_ORDER if s in systems]
    return known + sorted(set(systems) - set(known))


def _grouped_bars(ax, results, metric, ylabel, title):
    workloads = sorted({r["workload"] for r in results})
    systems = _order({r["system"] for r in results})
    width = 0.8 / max(len(systems), 1)
    for k, system in enumerate(systems):
        values = []
        for w in workloads:
            hit = [r for r in results if r["workload"] == w and r["system"] == system]
            values.append(metric(hit[0]) if hit else 0.0)
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(workloads))]
        bars = ax.bar(xs, values, width, label=system, color=COLORS.get(system))
        ax.bar_label(bars, labels=[f"{v:.3g}" if v else "" for v in values], fontsize=6)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)


def plot_throughput(results, path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    _grouped_bars(axes[0], results["serving"], lambda r: r["metrics"]["request_throughput"], "requests/s (log)",
                  "Serving workloads")
    _grouped_bars(axes[1], results["programs"], lambda r: r["metrics"]["programs_per_s"], "programs/s (log)",
                  "Program workloads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdf(results, path) -> None:
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in results["serving"]})
    if not workloads:
        return
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        rows = {r["system"]: r for r in results["serving"] if r["workload"] == w}
        for system in _order(rows):
            lat = sorted(q["latency"] for q in rows[system]["requests"] if q["ok"])
            if lat:
                ax.step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post", label=system,
                        color=COLORS.get(system))
        ax.set_xscale("log")
        ax.set_xlabel("end-to-end latency (s, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(w)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _serving_timeline(result):
    """(finish time, cumulative hit rate) from per-request cached/prompt tokens."""
    done = sorted((q["start"] + q["latency"], q["cached_tokens"], q["prompt_tokens"]) for q in result["requests"]
                  if q["ok"] and q["cached_tokens"] is not None)
    xs, ys, cached, prompt = [], [], 0, 0
    for t, c, p in done:
        cached, prompt = cached + c, prompt + p
        xs.append(t)
        ys.append(cached / prompt if prompt else 0.0)
    return xs, ys


def _program_timeline(result):
    samples = result.get("hit_rate_timeline") or []
    if len(samples) < 2:
        return [], []
    p0, c0 = samples[0]["num_prompt_tokens"], samples[0]["num_cached_tokens"]
    xs, ys = [], []
    for s in samples[1:]:
        dp = s["num_prompt_tokens"] - p0
        if dp > 0:
            xs.append(s["t"])
            ys.append((s["num_cached_tokens"] - c0) / dp)
    return xs, ys


def plot_hit_rate(results, path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, kind, timeline, title in ((axes[0], "serving", _serving_timeline, "Serving (per-request cached tokens)"),
                                      (axes[1], "programs", _program_timeline, "Programs (server counters, 1 s)")):
        for r in results[kind]:
            if not r["system"].startswith("lmprog"):
                continue
            xs, ys = timeline(r)
            if xs:
                ax.plot(xs, ys, label=f"{r['workload']} / {r['system']}",
                        linestyle="-" if r["system"] == "lmprog" else ":")
        ax.set_ylim(0, 1)
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel("cumulative cache hit rate")
        ax.set_title(title)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_all(results_dir: str = RESULTS) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")

    results = load_results(results_dir)
    paths = []
    for name, fn in (("throughput.png", plot_throughput), ("latency_cdf.png", plot_latency_cdf),
                     ("cache_hit_rate.png", plot_hit_rate)):
        path = os.path.join(results_dir, name)
        fn(results, path)
        if os.path.exists(path):
            paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=RESULTS)
    args = ap.parse_args()
    for path in make_all(args.results):
        print("wrote", path)


if __name__ == "__main__":
    main()
