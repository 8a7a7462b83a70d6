"""The speculative flags through the real two-process server: `serve --speculative-algorithm
NGRAM` starts, /generate reports SGLang's spec fields in meta_info, /server_info and
/metrics report the acceptance, and a bad flag value stops the start with its message."""

import signal
import subprocess
import sys

import requests

from server_harness import LiveServer


def test_ngram_server_reports_speculation(tiny_model_path, tmp_path):
    server = LiveServer(tiny_model_path, tmp_path, ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                                                    "6", "--speculative-disable-cost-rule"]).start()
    try:
        body = {"text": "1 2 3 4 1 2 3 4 1 2", "sampling_params": {"temperature": 0, "max_new_tokens": 32,
                                                                     "ignore_eos": True}}
        meta = requests.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1.0, meta
        assert meta["spec_draft_tokens"] >= meta["spec_accepted_tokens"] >= 0
        info = requests.get(server.url + "/server_info", timeout=30).json()
        assert info["speculative_algorithm"] == "NGRAM" and info["speculative_num_draft_tokens"] == 6
        assert "avg_spec_accept_length" in info["internal_states"][0]
        metrics = requests.get(server.url + "/metrics", timeout=30).text
        assert "sglang:spec_accept_length{" in metrics and "sglang:spec_draft_tokens_total{" in metrics
    finally:
        assert server.stop(signal.SIGTERM) == 0


def test_bad_speculative_flag_fails_the_start():
    proc = subprocess.run([sys.executable, "-m", "lmprog_runtime", "serve", "--speculative-algorithm", "NGRAM",
                           "--speculative-eagle-topk", "9"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "speculative_eagle_topk must be in [1, 8]" in proc.stdout + proc.stderr
