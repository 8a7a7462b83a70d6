"""Frontend overhead: one `gen(max_tokens=1)` through lmprog vs the same raw HTTP call.

    python bench/bench_frontend_overhead.py --url http://127.0.0.1:30000 [--runs 200]

Both sides use a keep-alive `requests.Session`; runs are interleaved so that server
drift hits both equally; the result is the difference of the medians (target < 2 ms).
Writes bench/results/frontend_overhead.json.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import requests  # noqa: E402

import lmprog as sgl  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
TARGET_MS = 2.0


@sgl.function
def one_token(s):
    s += PROMPT + sgl.gen("x", max_tokens=1, temperature=0)


def time_raw(session, url):
    start = time.perf_counter()
    res = session.post(url + "/generate", json={"text": PROMPT,
                                                "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    res.raise_for_status()
    res.json()["text"]
    return time.perf_counter() - start


def time_lmprog(backend):
    start = time.perf_counter()
    one_token.run(backend=backend)["x"]
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "frontend_overhead.json"))
    args = parser.parse_args()
    url = args.url.rstrip("/")

    session = requests.Session()
    backend = sgl.RuntimeEndpoint(url)
    for _ in range(args.warmup):
        time_raw(session, url)
        time_lmprog(backend)
    raw, framed = [], []
    for _ in range(args.runs):
        raw.append(time_raw(session, url))
        framed.append(time_lmprog(backend))

    raw_ms, lmprog_ms = statistics.median(raw) * 1e3, statistics.median(framed) * 1e3
    result = {
        "benchmark": "frontend_overhead", "url": url, "runs": args.runs, "prompt_chars": len(PROMPT),
        "raw_http_median_ms": round(raw_ms, 3), "lmprog_median_ms": round(lmprog_ms, 3),
        "overhead_ms": round(lmprog_ms - raw_ms, 3), "target_ms": TARGET_MS,
        "meets_target": lmprog_ms - raw_ms < TARGET_MS,
        "raw_http_p90_ms": round(statistics.quantiles(raw, n=10)[-1] * 1e3, 3),
        "lmprog_p90_ms": round(statistics.quantiles(framed, n=10)[-1] * 1e3, 3),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
