"""bench/soak.py keeps working: a few seconds of the mixed soak against the live server."""

import json
import os
import sys

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import soak  # noqa: E402


def test_soak_runs_and_audits(live_server, tmp_path):
    out = tmp_path / "soak.json"
    code = soak.main(["--base-url", live_server, "--minutes", "0.15", "--sample-s", "3", "--concurrency", "4",
                      "--max-new-tokens", "8", "--long-words", "300", "--output-file", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report["unexpected"]
    assert report["audit"] == {"idle": True, "integrity": "ok", "num_used_tokens": 0}
    assert all(report["counts"].get(k, 0) > 0 for k in ("normal", "bad")), report["counts"]
    assert len(report["samples"]) >= 3 and report["samples"][-1]["scheduler_rss_mib"] > 0
    assert requests.get(live_server + "/health", timeout=30).status_code == 200
