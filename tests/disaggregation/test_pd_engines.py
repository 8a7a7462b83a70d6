"""Prefill/decode disaggregation with in-process Engines on the tiny model: a prefill and a
decode Engine (mooncake: the KV really moves; fake: only the handshake and the metadata)
against one colocated Engine. Greedy outputs and logprobs must be identical, prefixes must
be reused on both sides, and every failure must end with a 5xx finish and a clean audit."""

import time

import pytest
import torch

from pd_helpers import audit, boot_fields, in_thread, make_pair, merge, run_pair

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 6,
           "In 1905 a patent clerk wrote four papers; the second one",
           "def fib(n):\n    return n if n < 2 else"]


@pytest.fixture(scope="module")
def colocated(tiny_model_path):
    from engine_helpers import make_engine
    e = make_engine(tiny_model_path, max_total_tokens=4096, random_seed=0, num_threads=1)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def mooncake_pair(tiny_model_path):
    prefill, decode, port = make_pair(tiny_model_path, "mooncake")
    yield prefill, decode, port
    prefill.shutdown()
    decode.shutdown()


@pytest.fixture(scope="module")
def fake_pair(tiny_model_path):
    prefill, decode, port = make_pair(tiny_model_path, "fake")
    yield prefill, decode, port
    prefill.shutdown()
    decode.shutdown()


def _stats(engine) -> dict:
    return engine.get_internal_state()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_logprobs_match_colocated(colocated, mooncake_pair, prompt):
    prefill, decode, port = mooncake_pair
    kw = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    want = colocated.generate(prompt, GREEDY, **kw)
    p, d = run_pair(prefill, decode, port, prompt, GREEDY, **kw)
    assert p["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    got = merge(p, d)
    assert got["output_ids"] == want["output_ids"]
    assert got["text"] == want["text"]
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
        assert got["meta_info"][key] == want["meta_info"][key], key
    audit(prefill, decode)


def test_streaming_matches_colocated(colocated, mooncake_pair):
    prefill, decode, port = mooncake_pair
    prompt = PROMPTS[1] + " streamed"
    want = list(colocated.generate(prompt, GREEDY, stream=True, return_logprob=True))
    p, chunks = run_pair(prefill, decode, port, prompt, GREEDY, stream=True, return_logprob=True)
    final = want[-1]["output_ids"]
    assert chunks[-1]["output_ids"] == final and chunks[-1]["text"] == want[-1]["text"]
    # chunks are cumulative; how many tokens one carries depends on timing (as colocated)
    assert all(final[:len(c["output_ids"])] == c["output_ids"] for c in chunks) and len(chunks) > 2
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == want[-1]["meta_info"]["output_token_logprobs"]
    audit(prefill, decode)


def test_prefix_reuse_on_both_sides(colocated, mooncake_pair, tiny_model_path):
    """The second request shares a 300-token prefix: the prefill server serves it from its
    radix cache (cached_tokens) and the decode server already holds it, so only the pages
    after it cross (bytes received = new tokens x bytes per token)."""
    from transformers import AutoConfig
    prefill, decode, port = mooncake_pair
    shared = [(7 * i) % 500 + 3 for i in range(300)]
    a, b = shared + [11, 12, 13, 14], shared + [21, 22, 23, 24, 25]
    run_pair(prefill, decode, port, a, GREEDY)
    before = _stats(decode)["disagg_bytes_received"]
    p, d = run_pair(prefill, decode, port, b, GREEDY)
    moved = _stats(decode)["disagg_bytes_received"] - before
    cfg = AutoConfig.from_pretrained(tiny_model_path)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # float32 K and V
    assert p["meta_info"]["cached_tokens"] == len(shared)
    assert d["meta_info"]["cached_tokens"] == len(shared)
    assert moved == (len(b) - len(shared)) * per_token
    assert d["output_ids"] == colocated.generate(input_ids=b, sampling_params=GREEDY)["output_ids"]
    audit(prefill, decode)


def test_chunked_prefill_ships_every_chunk(tiny_model_path):
    """The reference prefills in the same 64-token chunks: a chunked prefill's attention rounds
    differently from one 301-token prefill (layer 1's K/V already differ in the last bits), so
    only the same chunking makes the logprobs comparable bit for bit."""
    from engine_helpers import make_engine

    prefill, decode, port = make_pair(tiny_model_path, "mooncake", chunked_prefill_size=64, page_size=4)
    colocated = make_engine(tiny_model_path, max_total_tokens=4096, random_seed=0, num_threads=1,
                            chunked_prefill_size=64, page_size=4)
    try:
        prompt = [(5 * i) % 700 + 2 for i in range(301)]
        want = colocated.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True)
        p, d = run_pair(prefill, decode, port, prompt, GREEDY, return_logprob=True)
        assert _stats(prefill)["num_disagg_chunks_sent"] == 5  # 64 x 4 + 45: each chunk as it is done
        assert d["output_ids"] == want["output_ids"]
        assert d["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
        assert _stats(decode)["disagg_bytes_received"] > 0
        audit(prefill, decode)
    finally:
        colocated.shutdown()
        prefill.shutdown()
        decode.shutdown()


def test_fake_backend_runs_the_protocol_without_moving_bytes(fake_pair):
    prefill, decode, port = fake_pair
    p, d = run_pair(prefill, decode, port, PROMPTS[0], GREEDY)
    assert p["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert d["output_ids"][0] == p["output_ids"][0]  # the decode side starts from the prefill's token
    assert len(d["output_ids"]) == GREEDY["max_new_tokens"]
    assert _stats(decode)["disagg_bytes_received"] == 0 and _stats(prefill)["num_disagg_transfers"] >= 1
    audit(prefill, decode)


def test_max_new_tokens_one_finishes_on_the_first_token(colocated, mooncake_pair):
    prefill, decode, port = mooncake_pair
    one = {**GREEDY, "max_new_tokens": 1}
    p, d = run_pair(prefill, decode, port, PROMPTS[2], one)
    want = colocated.generate(PROMPTS[2], one)
    assert d["output_ids"] == want["output_ids"]
    assert d["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    audit(prefill, decode)


# -- failures ----------------------------------------------------------------------------------
def _error_of(box) -> str:
    err = box.get("error")
    assert err is not None, f"expected a failure, got {box.get('value')}"
    assert getattr(err, "status", 500) >= 500, err
    return str(err)


def test_transfer_timeout_fails_the_decode_half(fake_pair, monkeypatch):
    """Only the decode half arrives: its KV never comes, it fails with a 500 after the
    waiting timeout and frees its slots; the prefill side, told by the abort, fails the
    late prefill half at once."""
    from lmprog_runtime import config
    prefill, decode, port = fake_pair
    monkeypatch.setattr(config, "DISAGGREGATION_WAITING_TIMEOUT_S", 3.0)
    boot = boot_fields(port)
    t, box = in_thread(lambda: decode.generate(PROMPTS[0], GREEDY, **boot))
    deadline = time.monotonic() + 2.5
    while _stats(decode)["num_decode_transfer_queue_reqs"] != 1:  # its slots are out, it waits
        assert time.monotonic() < deadline, _stats(decode)
        time.sleep(0.05)
    t.join(30)
    assert "did not arrive" in _error_of(box)
    audit(decode)
    t, box = in_thread(lambda: prefill.generate(PROMPTS[0], GREEDY, **boot))
    t.join(30)
    assert "decode server ended" in _error_of(box)
    audit(prefill, decode)


def test_prefill_bootstrap_timeout(fake_pair, monkeypatch):
    from lmprog_runtime import config
    prefill, decode, port = fake_pair
    monkeypatch.setattr(config, "DISAGGREGATION_BOOTSTRAP_TIMEOUT_S", 1.0)
    t, box = in_thread(lambda: prefill.generate(PROMPTS[1], GREEDY, **boot_fields(port)))
    t.join(30)
    assert "no decode server bootstrapped" in _error_of(box)
    audit(prefill)


def test_client_abort_while_prefill_waits_for_its_decode_half(fake_pair):
    prefill, decode, port = fake_pair
    boot = boot_fields(port)
    t, box = in_thread(lambda: prefill.generate(PROMPTS[1], GREEDY, rid="pd-abort-boot", **boot))
    time.sleep(0.5)
    prefill.abort("pd-abort-boot")
    t.join(30)
    assert box["value"]["meta_info"]["finish_reason"]["type"] == "abort"
    # the decode half then learns it from the prefill side and fails with a 500
    t, box = in_thread(lambda: decode.generate(PROMPTS[1], GREEDY, **boot))
    t.join(30)
    assert "prefill server failed" in _error_of(box)
    audit(prefill, decode)


def test_client_abort_while_decode_waits_for_its_kv(fake_pair):
    prefill, decode, port = fake_pair
    boot = boot_fields(port)
    t, box = in_thread(lambda: decode.generate(PROMPTS[2], GREEDY, rid="pd-abort-xfer", **boot))
    time.sleep(0.5)
    decode.abort("pd-abort-xfer")
    t.join(30)
    assert box["value"]["meta_info"]["finish_reason"]["type"] == "abort"
    t, box = in_thread(lambda: prefill.generate(PROMPTS[2], GREEDY, **boot))
    t.join(30)
    assert "decode server ended" in _error_of(box)
    audit(prefill, decode)


def test_client_abort_during_decode(mooncake_pair):
    prefill, decode, port = mooncake_pair
    long = {**GREEDY, "max_new_tokens": 400}
    boot = boot_fields(port)
    t, box = in_thread(lambda: decode.generate(PROMPTS[0], long, rid="pd-abort-dec", **boot))
    prefill.generate(PROMPTS[0], long, **boot)
    time.sleep(0.3)
    decode.abort("pd-abort-dec")
    t.join(30)
    out = box["value"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 400
    audit(prefill, decode)


def test_prefill_server_gone_fails_waiting_decode_requests(tiny_model_path, monkeypatch):
    """The prefill server stops (its bootstrap server with it): the decode side's heartbeat
    misses it and fails the rooms waiting on it with a 500, slots freed."""
    from lmprog_runtime import config
    monkeypatch.setattr(config, "DISAGGREGATION_HEARTBEAT_INTERVAL_S", 0.2)
    prefill, decode, port = make_pair(tiny_model_path, "fake")
    try:
        boot = boot_fields(port)
        t, box = in_thread(lambda: decode.generate(PROMPTS[1], GREEDY, **boot))
        time.sleep(0.5)
        prefill.shutdown()
        t.join(30)
        assert "stopped answering" in _error_of(box) or "not reachable" in _error_of(box)
        audit(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_failure_while_shipping_fails_both_halves_alone(tiny_model_path, colocated):
    """A fault (Stage.KV_TRANSFER) while the prefill side ships one request's pages, while the
    decode side preallocates its slots, or installs its KV: that request fails with a 500
    (on both sides where the prefill half is still running); the next one goes through."""
    from lmprog_runtime.scheduler.faults import FaultInjector, Stage
    pf, df = FaultInjector(), FaultInjector()
    prefill, decode, port = make_pair(tiny_model_path, "mooncake", prefill_faults=pf, decode_faults=df)
    try:
        pf.arm(Stage.KV_TRANSFER, "pd-ship-fail")
        df.arm(Stage.KV_TRANSFER, "pd-install-fail", after=1)  # the preallocation's check passes
        df.arm(Stage.KV_TRANSFER, "pd-prealloc-fail")
        for rid, failing in (("pd-ship-fail", "prefill"), ("pd-install-fail", "decode"),
                             ("pd-prealloc-fail", "decode")):
            boot = boot_fields(port)
            tp, bp = in_thread(lambda: prefill.generate(PROMPTS[0], GREEDY, rid=rid, **boot))
            td, bd = in_thread(lambda: decode.generate(PROMPTS[0], GREEDY, rid=rid, **boot))
            tp.join(60), td.join(60)
            assert "kv transfer" in _error_of(bd) or "prefill server failed" in _error_of(bd)
            if failing == "prefill":
                assert "kv transfer" in _error_of(bp)
        assert sorted(r for _, r in df.fired) == ["pd-install-fail", "pd-prealloc-fail"]
        assert [r for _, r in pf.fired] == ["pd-ship-fail"]
        p, d = run_pair(prefill, decode, port, PROMPTS[1], GREEDY)
        assert d["output_ids"] == colocated.generate(PROMPTS[1], GREEDY)["output_ids"]
        audit(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_concurrent_requests_join_one_decode_batch(colocated, mooncake_pair):
    """Eight pairs at once: the decode server preallocates and installs them as their KV
    arrives and decodes them together; each output's tokens equal its colocated one's."""
    from concurrent.futures import ThreadPoolExecutor
    prefill, decode, port = mooncake_pair
    prompts = [f"Request {i}: " + PROMPTS[i % 3] * (1 + i % 2) for i in range(8)]
    sp = {**GREEDY, "max_new_tokens": 16}
    want = [colocated.generate(p, sp, return_logprob=True) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: run_pair(prefill, decode, port, p, sp, return_logprob=True)[1], prompts))
    for g, w in zip(got, want):  # batches of 8 vs alone: float sums in another order (1e-7)
        assert g["output_ids"] == w["output_ids"]
        lp = lambda r: [e[0] for e in r["meta_info"]["output_token_logprobs"]]  # noqa: E731
        assert lp(g) == pytest.approx(lp(w), abs=1e-4)
    audit(prefill, decode)



def test_inspector_shows_rooms_in_flight_on_both_halves(fake_pair):
    """Each half's /inspect/state lists its rooms: the prefill side's waiting for a handshake,
    the decode side's waiting for its KV, with the room, rid, direction and size."""
    prefill, decode, port = fake_pair
    boot = boot_fields(port)
    t1, box1 = in_thread(lambda: prefill.generate(PROMPTS[1], GREEDY, rid="pd-inspect-p", **boot))
    time.sleep(0.5)
    sent = prefill.inspect_state(include_tree=False)["handoffs"]
    assert sent["enabled"] and [(h["id"], h["rid"], h["direction"], h["state"]) for h in sent["items"]] == \
        [(boot["bootstrap_room"], "pd-inspect-p", "send", "Bootstrapping")]
    prefill.abort("pd-inspect-p")
    t1.join(30)
    boot = boot_fields(port)
    t2, box2 = in_thread(lambda: decode.generate(PROMPTS[2], GREEDY, rid="pd-inspect-d", **boot))
    deadline = time.monotonic() + 30
    while True:  # prealloc, then (slots sent) Transferring with its size known
        items = decode.inspect_state(include_tree=False)["handoffs"]["items"]
        if items and items[0]["state"] == "Transferring" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [(h["id"], h["rid"], h["direction"], h["state"]) for h in items] == \
        [(boot["bootstrap_room"], "pd-inspect-d", "receive", "Transferring")]
    assert items[0]["bytes"] > 0 and items[0]["elapsed_s"] >= 0
    decode.abort("pd-inspect-d")
    t2.join(30)
    assert not decode.inspect_state(include_tree=False)["handoffs"]["items"]
    audit(prefill, decode)


def test_bfloat16_kv_pools_hand_off_exactly(tiny_model_path):
    """--kv-cache-dtype bf16 on both halves: the bf16 pages move as they are, so the decode
    half continues exactly as a colocated bf16 engine does."""
    from engine_helpers import make_engine
    prefill, decode, port = make_pair(tiny_model_path, "mooncake", kv_cache_dtype="bf16")
    colocated = make_engine(tiny_model_path, max_total_tokens=4096, random_seed=0, num_threads=1,
                            kv_cache_dtype="bf16")
    try:
        kw = dict(return_logprob=True, logprob_start_len=0)
        for prompt in PROMPTS[:2]:
            want = colocated.generate(prompt, GREEDY, **kw)
            got = merge(*run_pair(prefill, decode, port, prompt, GREEDY, **kw))
            assert got["output_ids"] == want["output_ids"]
            assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
        assert decode.scheduler.runner.token_to_kv_pool.k.dtype == torch.bfloat16
        audit(prefill, decode)
    finally:
        for e in (prefill, decode, colocated):
            e.shutdown()
