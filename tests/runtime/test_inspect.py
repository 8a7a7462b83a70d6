"""The Inspector's snapshot through the Engine (scheduler/inspect.py): live requests show
up in the batch and the pool, the tree and the step ring fill, grammar compiles are
timed, and the snapshot is bounded and validated."""

import threading
import time

import pytest

from lmprog_runtime.messages import INSPECT_MAX_NODES_CAP
from lmprog_runtime.scheduler.inspect import STEP_FIELDS, StepRing, policy_order

POOL_OWNERS = ("free", "tree_evictable", "tree_locked", "request_held", "step_allocated")


def _owners_sum(pool):
    return sum(pool[k] for k in POOL_OWNERS)


def test_snapshot_while_requests_run(tiny_engine):
    prompts = [f"The inspector watches request number {i} decode" for i in range(4)]
    params = {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}
    worker = threading.Thread(target=tiny_engine.generate, args=(prompts, params))
    worker.start()
    seen = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and worker.is_alive():
        snap = tiny_engine.inspect_state()
        if len(snap["running"]) >= 2 and snap["pool"]["request_held"] > 0:
            seen = snap
            break
        time.sleep(0.02)
    worker.join()
    assert seen is not None, "never saw the batch running"
    row = seen["running"][0]
    assert row["prompt_tokens"] > 0 and row["max_new_tokens"] == 160 and row["grammar"] is None
    assert 0 <= row["generated_tokens"] <= 160 and row["kv_len"] > 0
    pool = seen["pool"]
    assert _owners_sum(pool) == pool["total"]
    if not seen["overlap"]:  # the plain loop answers between steps, never during a forward
        assert pool["step_allocated"] == 0
    assert pool["tree_locked"] > 0  # running requests lock their cached prefixes
    after = tiny_engine.inspect_state()
    assert not after["running"] and after["pool"]["request_held"] == 0
    assert _owners_sum(after["pool"]) == after["pool"]["total"]
    texts = " ".join(n["text"] for n in after["tree"]["nodes"])
    assert "inspector" in texts
    steps = after["steps"]
    assert steps and set(steps[-1]) == set(STEP_FIELDS)
    assert any(s["batch"] >= 2 for s in steps)
    assert all(s["forward_s"] > 0 and s["step_s"] >= s["forward_s"] for s in steps)


def test_overlap_loop_steps_and_pool(tiny_model_path):
    """The overlap loop answers while a forward runs: the CPU work it overlapped is timed,
    and the slots given to that step show as step_allocated (never lost)."""
    from lmprog_runtime import Engine

    engine = Engine(model_path=tiny_model_path, dtype="float32", max_total_tokens=2048,
                    force_overlap_schedule=True)
    try:
        params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
        worker = threading.Thread(target=engine.generate, args=(["overlap one", "overlap two"], params))
        worker.start()
        snaps = []
        while worker.is_alive():
            snaps.append(engine.inspect_state(include_tree=False))
        worker.join()
        snaps.append(engine.inspect_state())
        assert all(s["overlap"] and s["tree"] is None for s in snaps[:-1]) and snaps[-1]["tree"] is not None
        assert all(_owners_sum(s["pool"]) == s["pool"]["total"] and s["pool"]["step_allocated"] >= 0
                   for s in snaps)
        steps = snaps[-1]["steps"]
        assert any(s["overlapped_s"] > 0 for s in steps)
        assert all(s["overlapped_s"] <= s["forward_s"] for s in steps)
    finally:
        engine.shutdown()


def test_hits_counted_on_reuse(tiny_engine):
    """The second request reuses the first one's prefix node: its hit count goes up. A namespace
    of its own keeps the shared session engine's other prompts from splitting the prefix."""
    prompt = "A prefix the cache keeps for the hit counter test, " * 3
    for tail in ("first", "second"):
        tiny_engine.generate(prompt + tail, {"max_new_tokens": 1, "temperature": 0}, cache_salt="hits-test")
    tree = tiny_engine.inspect_state(max_nodes=INSPECT_MAX_NODES_CAP)["tree"]
    mine = [n for n in tree["nodes"] if (n["namespace"] or {}).get("cache_salt") == "hits-test"]
    shared = [n for n in mine if n["children"] >= 2]  # where "first" and "second" part
    assert len(shared) == 1 and shared[0]["text"].startswith("A prefix the cache"), mine
    assert shared[0]["hits"] >= 1, shared


def test_grammar_entries_are_timed(tiny_engine):
    regex = "(yes|no)-inspector-[0-9]{2}"
    for _ in range(2):
        tiny_engine.generate("Answer:", {"max_new_tokens": 12, "temperature": 0, "regex": regex})
    g = tiny_engine.inspect_state()["grammars"]
    entry = [e for e in g["entries"] if e["spec"] == regex]
    assert len(entry) == 1 and entry[0]["kind"] == "regex"
    assert entry[0]["compile_s"] > 0 and entry[0]["hits"] >= 1  # the second request hit the cache
    assert g["mask_rows_total"] > 0 and g["mask_s_per_row"] > 0


def test_max_nodes_bounds_and_validation(tiny_engine):
    for i in range(3):
        tiny_engine.generate(f"Distinct branch {i} for the bound test", {"max_new_tokens": 2, "temperature": 0})
    snap = tiny_engine.inspect_state(max_nodes=1)
    tree = snap["tree"]
    assert tree["shown"] == 1 and tree["truncated"] == tree["num_nodes"] - 1
    assert snap["handoffs"] == {"fields": list(snap["handoffs"]["fields"]), "items": [], "enabled": False}
    for bad in (0, INSPECT_MAX_NODES_CAP + 1, "10", True):
        with pytest.raises(ValueError, match="max_nodes"):
            tiny_engine.inspect_state(max_nodes=bad)


def test_step_ring_rows():
    ring = StepRing(size=3)
    for i in range(5):  # cumulative mask seconds 0.1, 0.3, 0.6, 1.0, 1.5
        ring.record(step_s=1.0 + i, forward_s=0.5, overlapped_s=0.1 * i, mask_total_s=0.1 * (i + 1) * (i + 2) / 2,
                    batch=i, tokens=2 * i)
    rows = ring.rows()
    assert [r["batch"] for r in rows] == [2, 3, 4]  # the last three
    assert [round(r["cpu_s"], 6) for r in rows] == [2.5, 3.5, 4.5]
    assert rows[0]["mask_s"] == 0.0  # no earlier row in the ring to difference against
    assert [round(r["mask_s"], 6) for r in rows[1:]] == [0.4, 0.5]


def test_policy_order_follows_the_last_ranking():
    a, b, c, d = (object() for _ in range(4))
    waiting = [a, b, c, d]
    assert policy_order(waiting, None) == waiting
    assert policy_order(waiting, [c, a, b]) == [c, a, b, d]  # d arrived after the ranking
    assert policy_order([a, d], [c, a, b]) == [a, d]  # c and b were admitted since


def test_a_failing_snapshot_fails_alone():
    from lmprog_runtime.messages import InspectReq
    from lmprog_runtime.scheduler.inspect import inspect_reply

    reply = inspect_reply(object(), InspectReq())  # no scheduler parts at all
    assert reply.kind == "inspect" and not reply.success and "snapshot failed" in reply.message


def test_disabled_engine_refuses(tiny_model_path):
    from lmprog_runtime import Engine

    engine = Engine(model_path=tiny_model_path, dtype="float32", max_total_tokens=1024, disable_inspector=True)
    try:
        with pytest.raises(RuntimeError, match="Inspector is off"):
            engine.inspect_state()
    finally:
        engine.shutdown()


def _snapshots_while(engine, prompts, params, **kw) -> list:
    """Snapshots taken while `engine` generates `prompts` on a worker thread, then one after."""
    worker = threading.Thread(target=engine.generate, args=(prompts, params))
    worker.start()
    snaps = []
    while worker.is_alive():
        snaps.append(engine.inspect_state(**kw))
        time.sleep(0.01)
    worker.join()
    return snaps + [engine.inspect_state(**kw)]


def test_hicache_tiers_in_the_snapshot(tiny_model_path):
    from engine_helpers import make_engine

    docs = [f"Document {d}. " + " ".join(f"entry{d}x{i} holds value {i * 7 + d}." for i in range(28))
            for d in range(4)]
    with make_engine(tiny_model_path, enable_hierarchical_cache=True, max_total_tokens=512,
                     hicache_ratio=4.0) as eng:
        for doc in docs:  # ~300 tokens each: the device pool holds fewer than two
            eng.generate(doc, {"max_new_tokens": 2, "temperature": 0})
        snap = eng.inspect_state()
    host, tree = snap["host_pool"], snap["tree"]
    assert host is not None and host["tree"] == tree["host_tokens"] > 0
    assert host["free"] + host["tree"] + host["prefetch_held"] == host["total"]
    tiers = {n["tier"] for n in tree["nodes"]}
    assert tiers == {"device", "host"}
    assert _owners_sum(snap["pool"]) == snap["pool"]["total"]


def test_speculative_accept_length_per_request(tiny_model_path):
    from engine_helpers import make_engine

    prompt = "one two three four five six seven eight " * 6  # n-grams the drafts can follow
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    with make_engine(tiny_model_path, speculative_algorithm="NGRAM", speculative_disable_cost_rule=True, max_total_tokens=4096) as eng:
        snaps = _snapshots_while(eng, [prompt, prompt + "nine"], params, include_tree=False)
    assert all(s["speculative"] for s in snaps)
    rows = [r for s in snaps for r in s["running"]]
    assert rows and all("spec_accept_length" in r for r in rows)
    lengths = [r["spec_accept_length"] for r in rows if r["spec_accept_length"] is not None]
    assert lengths and all(v >= 1.0 for v in lengths)  # accepted drafts + the bonus token, per verify


def test_cache_off_has_no_tree(tiny_model_path):
    from engine_helpers import make_engine

    with make_engine(tiny_model_path, disable_radix_cache=True, max_total_tokens=1024) as eng:
        eng.generate("No cache here", {"max_new_tokens": 3, "temperature": 0})
        snap = eng.inspect_state()
    assert snap["tree"] is None and snap["tree_s"] is None and not snap["cache_enabled"]
    pool = snap["pool"]
    assert pool["tree_evictable"] == pool["tree_locked"] == 0 and pool["free"] == pool["total"]
