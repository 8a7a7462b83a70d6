"""HiCache misconfiguration through the real CLI: the server stops at start-up with the
reason (never a crash on the first request)."""

import pytest

from server_harness import LiveServer


def test_unwritable_storage_dir_stops_the_server_at_start_up(tiny_model_path, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    server = LiveServer(tiny_model_path, tmp_path, extra_args=[
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-dir", str(blocker / "pages")])
    with pytest.raises(RuntimeError, match="server exited with 1"):
        server.start()
    assert "is not a writable directory" in server.log_tail()


def test_flag_errors_are_reported_before_the_model_loads(tiny_model_path, tmp_path):
    server = LiveServer(tiny_model_path, tmp_path, extra_args=["--enable-hierarchical-cache",
                                                              "--hicache-ratio", "0.5"])
    with pytest.raises(RuntimeError, match="server exited with 2"):
        server.start()
    assert "hicache_ratio must be greater than 1" in server.log_tail()


def test_file_tier_survives_a_server_restart(tiny_model_path, tmp_path):
    """SIGTERM drains the queued page writes; the next server on the same directory serves
    the document from L3 with the same greedy tokens and logprobs."""
    import requests

    doc = "Manual. " + " ".join(f"step{i} turns valve {i % 5}." for i in range(40)) + "\nQ: step9?"
    body = {"text": doc, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
            "return_logprob": True}
    flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
             "--hicache-storage-dir", str(tmp_path / "pages"), "--hicache-storage-prefetch-policy", "wait_complete",
             "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 64}']
    outs = []
    for run in range(2):
        server = LiveServer(tiny_model_path, tmp_path, extra_args=flags).start()
        try:
            r = requests.post(server.url + "/generate", json=body, timeout=120)
            r.raise_for_status()
            outs.append(r.json())
            metrics = requests.get(server.url + "/metrics", timeout=30).text
        finally:
            assert server.stop() == 0, server.log_tail()
    first, second = outs
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["output_ids"] == first["output_ids"]
    l3 = [line for line in metrics.splitlines()  # the second server's /metrics
          if line.startswith("lmprog:hicache_hit_tokens{") and 'tier="L3"' in line]
    assert l3 and float(l3[0].split()[-1]) > 0, metrics
    lp = [[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outs]
    assert max(abs(a - b) for a, b in zip(*lp)) < 4e-6
