"""HiCache's `mooncake` tier: two real servers sharing one Mooncake Store (a local
`mooncake_master`): a document prefilled on server A is a cache hit on server B, with the
same greedy output. And a master that does not answer is a start-up error."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import requests

from engine_helpers import make_engine
from server_harness import LiveServer, free_port

DOC = "Shared document. " + " ".join(f"clause{i} says {i * 3}." for i in range(40)) + "\nQ: clause7?"
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _master_binary():
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a missing shared library
        pytest.skip(f"mooncake store client not importable ({type(e).__name__}: {e})")
    found = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if not os.path.exists(found):
        pytest.skip("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
    return found


@pytest.fixture
def master(tmp_path):
    binary = _master_binary()
    port = free_port()
    log = open(tmp_path / "master.log", "wb")
    argv = [binary, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}"]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    import socket
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "master.log").read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)
    log.close()


def _server(tiny_model_path, tmp_path, address):
    extra = json.dumps({"master_server_address": address, "prefetch_threshold": 64})
    return LiveServer(tiny_model_path, tmp_path, extra_args=[
        "--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", extra]).start()


def _generate(server):
    r = requests.post(server.url + "/generate", json={"text": DOC, "sampling_params": GREEDY}, timeout=120)
    r.raise_for_status()
    return r.json()


def _state(server):
    return requests.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]


def test_two_servers_share_one_store(tiny_model_path, tmp_path, master):
    a = _server(tiny_model_path, tmp_path, master)
    try:
        b = _server(tiny_model_path, tmp_path, master)
        try:
            first = _generate(a)
            assert first["meta_info"]["cached_tokens"] == 0
            deadline = time.monotonic() + 30
            while _state(a)["hicache_l3_writes_pending"]:  # A's pages are in the store
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert _state(a)["l3_write_bytes"] > 0
            second = _generate(b)
            assert second["meta_info"]["cached_tokens"] > 0  # prefilled on A, a hit on B
            assert second["output_ids"] == first["output_ids"]
            state = _state(b)
            assert state["hicache_hit_tokens_l3"] > 0 and state["integrity"] == "ok"
        finally:
            b.stop()
    finally:
        a.stop()


def test_unreachable_master_is_a_start_up_error(tiny_model_path):
    try:
        import mooncake.store  # noqa: F401
        expected = "is not reachable"
    except Exception:  # noqa: BLE001 - then the error names the missing client
        expected = "needs the Mooncake store client"
    extra = json.dumps({"master_server_address": f"127.0.0.1:{free_port()}"})
    with pytest.raises(ValueError, match=expected):
        make_engine(tiny_model_path, enable_hierarchical_cache=True, max_total_tokens=512,
                    hicache_storage_backend="mooncake", hicache_storage_backend_extra_config=extra)
