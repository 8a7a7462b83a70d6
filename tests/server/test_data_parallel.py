"""`--dp-size N`: the dispatcher's routing (unit), then a real server with two scheduler
replicas on the tiny model: greedy outputs equal the single-scheduler server's, round_robin
uses both replicas, an abort reaches the replica holding the request, flush fans out, per-
replica /get_server_info, /metrics and /get_load, a killed replica fails only its own
requests and is restarted, and the KV audit is exact on every replica at the end."""

import json
import os
import signal
import threading
import time

import pytest
import requests

from lmprog_runtime.messages import (AbortReq, BatchOutput, ControlReply, FinishReason, FlushCacheReq,
                                     GetInternalStateReq, ReqOutput, TokenizedGenerateReq)
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.server.data_parallel import Dispatcher, merge_replies, per_replica, replica_args
from server_harness import LiveServer, pid_alive


# -- the dispatcher alone ---------------------------------------------------------------------
def _dispatcher(n=2, method="round_robin"):
    sent = [[] for _ in range(n)]
    delivered = []
    d = Dispatcher([sent[r].append for r in range(n)], method, delivered.append)
    return d, sent, delivered


def _req(rid):
    return TokenizedGenerateReq(rid=rid, input_ids=[1, 2], sampling_params=SamplingParams())


def _finished(rid):
    return BatchOutput([ReqOutput(rid, 0, [5], FinishReason.length(1), 2, 1, 0)])


def test_round_robin_and_abort_routing():
    d, sent, _ = _dispatcher()
    for i in range(4):
        d.send(_req(f"r{i}"))
    assert [[m.rid for m in s] for s in sent] == [["r0", "r2"], ["r1", "r3"]]
    d.send(AbortReq(rid="r3"))  # known rid: its replica only
    assert isinstance(sent[1][-1], AbortReq) and len(sent[0]) == 2
    d.send(AbortReq(rid="r"))  # unknown (a prefix for the scheduler): every replica
    d.send(AbortReq(abort_all=True))
    assert [type(m).__name__ for m in sent[0][2:]] == ["AbortReq", "AbortReq"]
    assert len(sent[1]) == 5


def test_shortest_queue_follows_inflight_counts():
    d, sent, delivered = _dispatcher(method="shortest_queue")
    d.send(_req("a"))
    d.send(_req("b"))
    d.send(_req("c"))  # a tie: the lower rank
    assert d.owner == {"a": 0, "b": 1, "c": 0} and d.inflight == [2, 1]
    d.on_message(0, _finished("a"))
    d.on_message(0, _finished("c"))
    assert d.inflight == [0, 1] and delivered and "a" not in d.owner
    d.send(_req("d"))
    assert d.owner["d"] == 0


def test_control_fans_out_and_replies_merge():
    d, sent, delivered = _dispatcher()
    d.send(FlushCacheReq())
    assert isinstance(sent[0][0], FlushCacheReq) and isinstance(sent[1][0], FlushCacheReq)
    d.on_message(1, ControlReply("flush_cache", message="Cache flushed."))
    assert delivered == []  # waits for both
    d.on_message(0, ControlReply("flush_cache", message="Cache flushed."))
    assert delivered[0].success and delivered[0].message == "Cache flushed."
    d.send(FlushCacheReq())
    d.on_message(0, ControlReply("flush_cache", message="Cache flushed."))
    d.on_message(1, ControlReply("flush_cache", success=False, message="busy"))
    assert not delivered[1].success and delivered[1].message == "replica 1: busy"
    d.send(GetInternalStateReq())
    d.on_message(0, ControlReply("internal_state", data={"x": 0}))
    d.on_message(1, ControlReply("internal_state", data={"x": 1}))
    assert per_replica(delivered[2]) == [{"x": 0, "dp_rank": 0}, {"x": 1, "dp_rank": 1}]


def test_replica_down_fails_only_its_rids_and_unblocks_fanouts():
    d, sent, delivered = _dispatcher()
    for i in range(4):
        d.send(_req(f"r{i}"))
    d.send(GetInternalStateReq())
    d.on_message(0, ControlReply("internal_state", data={"x": 0}))
    assert d.replica_down(1) == ["r1", "r3"]
    assert per_replica(delivered[-1]) == [{"x": 0}]  # the survivor's answer alone
    d.send(_req("r4"))
    d.send(_req("r5"))
    assert d.owner["r4"] == d.owner["r5"] == 0  # the dead replica is not picked
    d.replica_up(1)
    d.send(_req("r6"))
    d.send(_req("r7"))
    assert {d.owner["r6"], d.owner["r7"]} == {0, 1}


def test_control_with_no_live_replica_fails_at_once():
    d, sent, delivered = _dispatcher()
    d.replica_down(0)
    d.replica_down(1)
    d.send(FlushCacheReq())
    assert sent == [[], []] and not delivered[0].success


def test_one_replica_passes_through():
    d, sent, delivered = _dispatcher(n=1)
    d.send(FlushCacheReq())
    reply = ControlReply("flush_cache", message="Cache flushed.")
    d.on_message(0, reply)
    assert delivered == [reply]
    assert merge_replies("x", {}).success is False


def test_replica_args_split_threads(tiny_model_path):
    from lmprog_runtime.config import ServerArgs

    args = ServerArgs(model_path=tiny_model_path, dp_size=2, num_threads=5)
    assert replica_args(args, 1).num_threads == 2
    assert replica_args(args.replace(num_threads=1), 0).num_threads == 1
    single = args.replace(dp_size=1)
    assert replica_args(single, 0) is single
    hicache = args.replace(enable_hierarchical_cache=True, hicache_storage_backend="file",
                           hicache_storage_dir="/tmp/l3", hicache_storage_max_gb=8.0)
    assert (replica_args(hicache, 1).hicache_storage_dir, replica_args(hicache, 1).hicache_storage_max_gb) == \
        ("/tmp/l3/dp1", 4.0)
    with pytest.raises(ValueError, match="load_balance_method"):
        ServerArgs(model_path=tiny_model_path, load_balance_method="random")
    with pytest.raises(ValueError, match="dp_size"):
        ServerArgs(model_path=tiny_model_path, dp_size=0)


def test_engine_refuses_dp(tiny_model_path):
    from lmprog_runtime import Engine

    with pytest.raises(ValueError, match="dp_size"):
        Engine(model_path=tiny_model_path, dp_size=2)


# -- a real server with two replicas ------------------------------------------------------------
PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def dp_server(tiny_model_path, tmp_path_factory):
    srv = LiveServer(tiny_model_path, tmp_path_factory.mktemp("dp2"),
                     ["--dp-size", "2", "--num-threads", "2", "--scheduler-restart", "1"]).start()
    yield srv
    pids = requests.get(srv.url + "/get_server_info", timeout=30).json()["scheduler_pids"]
    assert srv.stop(signal.SIGTERM) == 0, srv.log_tail()
    assert not any(pid_alive(p) for p in pids), "a replica outlived the server"


def _greedy(url, text, n=12):
    r = requests.post(url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _states(url):
    return requests.get(url + "/get_server_info", timeout=30).json()["internal_states"]


def _wait_idle_all(url, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        states = _states(url)
        if all(s["num_running_reqs"] == 0 and s["num_queue_reqs"] == 0 and s["integrity"] != "busy"
               for s in states):
            return states
        assert time.monotonic() < deadline, f"the replicas did not go idle: {states}"
        time.sleep(0.1)


def test_outputs_equal_single_scheduler_and_both_replicas_used(dp_server, live_server):
    before = requests.get(dp_server.url + "/get_load", timeout=30).json()
    for text in PROMPTS:
        assert _greedy(dp_server.url, text)["output_ids"] == _greedy(live_server, text)["output_ids"], text
    after = requests.get(dp_server.url + "/get_load", timeout=30).json()
    assert [x["dp_rank"] for x in after] == [0, 1]
    used = [a["num_dispatched"] - b["num_dispatched"] for a, b in zip(after, before)]
    assert used == [2, 2], used  # round_robin: the four prompts alternate


def test_server_info_metrics_and_load_per_replica(dp_server):
    info = requests.get(dp_server.url + "/get_server_info", timeout=30).json()
    assert info["dp_size"] == 2 and len(info["internal_states"]) == 2
    assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
    assert len(set(info["scheduler_pids"])) == 2 and info["dp_alive"] == [True, True]
    text = requests.get(dp_server.url + "/metrics", timeout=30).text
    running = [ln for ln in text.splitlines() if ln.startswith("sglang:num_running_reqs{")]
    assert [ln.split("dp_rank=")[1][:3] for ln in running] == ['"0"', '"1"'], running


def test_inspector_shows_one_replica_at_a_time(dp_server):
    """/inspect/state answers with one replica's snapshot (dp_rank, default 0), each its own tree."""
    text = PROMPTS[0] + " which the inspector should find in exactly one replica's tree"
    for _ in range(2):  # one on each replica: the round-robin turn stays where later tests expect it
        _greedy(dp_server.url, text)
    snaps = [requests.get(dp_server.url + f"/inspect/state?dp_rank={r}", timeout=30).json() for r in (0, 1)]
    assert [(s["dp_rank"], s["dp_size"]) for s in snaps] == [(0, 2), (1, 2)]
    assert "dp_states" not in snaps[0] and all("tree" in s and "pool" in s for s in snaps)
    bad = requests.get(dp_server.url + "/inspect/state?dp_rank=2", timeout=30)
    assert bad.status_code == 400 and "dp_rank" in bad.text


def test_flush_fans_out_to_every_replica(dp_server):
    for text in PROMPTS[:2]:  # one prompt cached on each replica
        _greedy(dp_server.url, text + " and a little more text to cache")
    states = _wait_idle_all(dp_server.url)
    assert all(s["cached_tokens"] > 0 for s in states), states
    r = requests.post(dp_server.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert [s["cached_tokens"] for s in _states(dp_server.url)] == [0, 0]


def test_weight_update_fans_out_and_merges(dp_server, tiny_model_path):
    _wait_idle_all(dp_server.url)
    r = requests.post(dp_server.url + "/update_weights_from_disk", timeout=300,
                      json={"model_path": tiny_model_path, "weight_version": "dp-v2"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert [s["weight_version"] for s in _states(dp_server.url)] == ["dp-v2", "dp-v2"]
    assert requests.get(dp_server.url + "/get_weight_version", timeout=30).json()["weight_version"] == "dp-v2"
    for text in PROMPTS[:2]:  # the same weights: the same greedy outputs on both replicas
        assert _greedy(dp_server.url, text)["meta_info"]["weight_version"] == "dp-v2"


def _stream(url, rid, out, max_new=600):
    """Collect the data lines of one long streamed request into `out`."""
    resp = requests.post(url + "/generate", stream=True, timeout=120, json={
        "text": "long", "rid": rid, "stream": True,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}})
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            out.append(line[len(b"data: "):])


def test_abort_reaches_its_replica(dp_server):
    lines = []
    t = threading.Thread(target=_stream, args=(dp_server.url, "dp-abort-me", lines))
    t.start()
    while len(lines) < 2:
        time.sleep(0.05)
    requests.post(dp_server.url + "/abort_request", json={"rid": "dp-abort-me"}, timeout=30)
    t.join(60)
    assert not t.is_alive() and lines[-1] == b"[DONE]"
    last = json.loads(lines[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 600


def test_killed_replica_fails_only_its_requests_then_restarts(dp_server):
    info = requests.get(dp_server.url + "/get_server_info", timeout=30).json()
    pids = info["scheduler_pids"]
    streams = {rid: [] for rid in ("dp-kill-a", "dp-kill-b")}
    # 900 tokens: on a quiet machine the tiny model decodes 300 before the second stream starts
    threads = [threading.Thread(target=_stream, args=(dp_server.url, rid, out, 900))
               for rid, out in streams.items()]
    for t in threads:  # round_robin: one stream on each replica
        t.start()
        time.sleep(0.05)
    while not all(len(out) >= 2 for out in streams.values()):
        time.sleep(0.05)
    load = requests.get(dp_server.url + "/get_load", timeout=30).json()
    assert [x["num_inflight_reqs"] for x in load] == [1, 1], load
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(120)
    finals = {rid: json.loads(out[-2]) for rid, out in streams.items()}
    failed = [rid for rid, f in finals.items() if "error" in f]
    assert len(failed) == 1 and finals[failed[0]]["error"]["code"] == 503, finals
    ok = [f for f in finals.values() if "error" not in f][0]
    assert ok["meta_info"]["completion_tokens"] == 900  # the other replica's request finished
    deadline = time.monotonic() + 240  # replica 0 comes back (--scheduler-restart 1)
    while time.monotonic() < deadline:
        info = requests.get(dp_server.url + "/get_server_info", timeout=30).json()
        if info["dp_alive"] == [True, True]:
            break
        time.sleep(0.5)
    assert info["dp_alive"] == [True, True], dp_server.log_tail()
    assert info["scheduler_pids"][0] != pids[0] and info["scheduler_pids"][1] == pids[1]
    assert not pid_alive(pids[0])
    for text in PROMPTS[:2]:
        _greedy(dp_server.url, text, 3)


def test_kv_audit_exact_on_every_replica(dp_server):
    states = _wait_idle_all(dp_server.url)
    assert [(s["integrity"], s["num_used_tokens"]) for s in states] == [("ok", 0), ("ok", 0)], states
