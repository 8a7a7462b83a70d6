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
