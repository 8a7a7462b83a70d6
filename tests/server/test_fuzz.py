"""Property-based fuzzing of every endpoint of a live server (hypothesis).

For every generated request: no 5xx, errors in the JSON envelope, streams closed with
[DONE], the server healthy afterwards; at the end nothing runs and the KV audit is exact.
The quick profile runs in the default suite with a fixed seed; `-m slow` runs the long one
and writes its figures (cases, 4xx, 5xx, crashes, hangs, leaked KV) to
`$LMPROG_FUZZ_REPORT` (default: the test's tmp dir, printed).
"""

import collections
import json
import os

import pytest
import requests
from hypothesis import HealthCheck, given, settings

from fuzz_requests import check_answer, requests_
from server_harness import wait_idle

REQUEST_TIMEOUT_S = 60  # a request without an answer by then counts as a hang


def _send(url, case):
    method, path, raw, headers = case
    return requests.request(method, url + path, data=raw, headers=headers, timeout=REQUEST_TIMEOUT_S)


def _run(url, examples: int, seed_fixed: bool, tally: collections.Counter):
    @settings(max_examples=examples, deadline=None, derandomize=seed_fixed, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=requests_())
    def one(case):
        tally["cases"] += 1
        try:
            resp = _send(url, case)
        except requests.Timeout:
            tally["hangs"] += 1
            raise
        tally[f"{resp.status_code // 100}xx"] += 1
        if resp.status_code >= 500:
            tally["5xx_detail:" + resp.text[:120]] += 1
        check_answer(resp)
        health = requests.get(url + "/ready", timeout=30)
        if health.status_code != 200:
            tally["crashes"] += 1
        assert health.status_code == 200, health.text

    one()


def _audit(url) -> dict:
    assert requests.get(url + "/health", timeout=60).status_code == 200
    state = wait_idle(url, timeout=120)
    assert state["integrity"] == "ok", state
    assert state["num_used_tokens"] == 0, state
    return state


def test_fuzz_quick(live_server):
    tally = collections.Counter()
    _run(live_server, examples=int(os.environ.get("LMPROG_FUZZ_EXAMPLES", "400")), seed_fixed=True, tally=tally)
    _audit(live_server)
    assert tally["cases"] > 0 and tally["5xx"] == 0


@pytest.mark.slow
def test_fuzz_long(live_server, tmp_path):
    tally = collections.Counter()
    try:
        _run(live_server, examples=int(os.environ.get("LMPROG_FUZZ_EXAMPLES", "5000")), seed_fixed=False,
             tally=tally)
    finally:
        state = wait_idle(live_server, timeout=120)
        report = {"cases": tally["cases"], "2xx": tally["2xx"], "4xx": tally["4xx"], "5xx": tally["5xx"],
                  "crashes": tally["crashes"], "hangs": tally["hangs"],
                  "leaked_kv_tokens": state["num_used_tokens"], "integrity": state["integrity"],
                  "details": {k: v for k, v in tally.items() if k.startswith("5xx_detail")}}
        path = os.environ.get("LMPROG_FUZZ_REPORT") or str(tmp_path / "fuzz_report.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print("fuzz report:", json.dumps(report))
    _audit(live_server)
