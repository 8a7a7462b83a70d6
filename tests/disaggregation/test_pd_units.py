"""Disaggregation parts without a model: flags, the bootstrap server's routes, the request
fields as the tokenizer manager reads them, page runs and pool layouts."""

import argparse

import pytest
import requests

from lmprog_runtime.config import ServerArgs, add_cli_args, from_cli_namespace
from lmprog_runtime.disaggregation.base import PoolLayout
from lmprog_runtime.disaggregation.bootstrap import KVBootstrapServer, lookup_rank
from lmprog_runtime.disaggregation.conn import slot_runs
from server_harness import free_port


def test_flags_have_sglang_names_defaults_and_help():
    args = ServerArgs()
    assert (args.disaggregation_mode, args.disaggregation_bootstrap_port,
            args.disaggregation_transfer_backend, args.disaggregation_ib_device) == ("null", 8998, "mooncake", None)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9100",
                            "--disaggregation-transfer-backend", "fake", "--disaggregation-ib-device", "mlx5_0"])
    got = from_cli_namespace(ns)
    assert (got.disaggregation_mode, got.disaggregation_bootstrap_port, got.disaggregation_transfer_backend,
            got.disaggregation_ib_device) == ("prefill", 9100, "fake", "mlx5_0")
    help_text = parser.format_help()
    for flag in ("--disaggregation-mode", "--disaggregation-bootstrap-port", "--disaggregation-transfer-backend",
                 "--disaggregation-ib-device"):
        assert flag in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["--disaggregation-mode", "both"])


@pytest.mark.parametrize("kwargs, message", [
    ({"disaggregation_mode": "both"}, "disaggregation_mode must be one of"),
    ({"disaggregation_transfer_backend": "nixl"}, "disaggregation_transfer_backend must be one of"),
    ({"disaggregation_bootstrap_port": 0}, "disaggregation_bootstrap_port must be in"),
    ({"disaggregation_mode": "prefill", "port": 8998}, "must differ from port"),
    ({"disaggregation_mode": "decode", "enable_hierarchical_cache": True}, "plain radix cache"),
    ({"disaggregation_mode": "decode", "speculative_algorithm": "NGRAM"}, "speculative decoding"),
])
def test_startup_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_bootstrap_server_routes_and_registration():
    port = free_port()
    server = KVBootstrapServer("127.0.0.1", port)
    server.start()
    base = f"http://127.0.0.1:{port}"
    try:
        assert requests.get(base + "/health", timeout=5).text == "OK"
        query = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}
        assert requests.get(base + "/route", params=query, timeout=5).status_code == 503  # nobody registered
        assert requests.put(base + "/route", json={"rank_ip": "127.0.0.1"}, timeout=5).status_code == 400
        reg = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1,
               "pp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 5555, "page_size": 4, "kv_cache_dtype": "float32",
               "prefill_http_port": 30001}
        assert requests.put(base + "/route", json=reg, timeout=5).status_code == 200
        layout = requests.get(base + "/route", params=query, timeout=5).json()
        assert layout["page_size"] == 4 and layout["follow_bootstrap_room"] is True
        assert lookup_rank(f"127.0.0.1:{port}") == ("127.0.0.1", 5555)
        assert requests.post(base + "/register_dp_rank", json={"bootstrap_room": 9, "dp_rank": 0},
                             timeout=5).status_code == 200
        assert requests.post(base + "/query_dp_ranks", json={"bootstrap_rooms": [9]}, timeout=5).json() == {"9": 0}
    finally:
        server.close()
    with pytest.raises(OSError):
        lookup_rank(f"127.0.0.1:{port}", timeout=1)


def test_a_taken_bootstrap_port_is_a_startup_error():
    port = free_port()
    first = KVBootstrapServer("127.0.0.1", port)
    first.start()
    try:
        with pytest.raises(OSError, match="cannot listen"):
            KVBootstrapServer("127.0.0.1", port).start()
    finally:
        first.close()


def test_slot_runs_coalesce_where_both_sides_count_up():
    assert slot_runs([4, 5, 6, 9, 10], [20, 21, 22, 23, 40]) == [(4, 20, 3), (9, 23, 1), (10, 40, 1)]
    assert slot_runs([], []) == []


def test_pool_layouts_must_match():
    a = PoolLayout(1, 2, 100, 30, 768, 1, "float32")
    assert a.compatible(PoolLayout(5, 6, 400, 30, 768, 1, "float32")) is None
    assert "layouts differ" in a.compatible(PoolLayout(5, 6, 400, 30, 384, 1, "bfloat16"))


class _Tok:
    bos_token_id = None

    def encode(self, text):
        return [ord(c) % 50 + 1 for c in text]


def _tm():
    from lmprog_runtime.tokenizer_manager import TokenizerManager
    return TokenizerManager(_Tok(), vocab_size=100, context_len=512, send=lambda m: None)


def test_request_fields_reach_the_message():
    from lmprog_runtime.generate_request import RequestError
    tm = _tm()
    job = tm.parse({"text": ["a", "b"], "bootstrap_host": "10.0.0.2", "bootstrap_port": 9000, "bootstrap_room": 7})
    assert [(m.bootstrap.host, m.bootstrap.port, m.bootstrap.room) for m in job.reqs] == \
        [("10.0.0.2", 9000, 7), ("10.0.0.2", 9000, 8)]  # a batch's scalar room is room + i
    job = tm.parse({"text": "a", "bootstrap_host": "h", "bootstrap_room": 3})
    assert job.reqs[0].bootstrap.port == 8998 and job.reqs[0].bootstrap.addr == "h:8998"
    assert tm.parse({"text": "a"}).reqs[0].bootstrap is None
    with pytest.raises(RequestError, match="bootstrap_host and bootstrap_room"):
        tm.parse({"text": "a", "bootstrap_room": 3})
    with pytest.raises(RequestError, match="n = 1"):
        tm.parse({"text": "a", "bootstrap_host": "h", "bootstrap_room": 3, "sampling_params": {"n": 2}})


def _manager():
    from types import SimpleNamespace

    import torch

    from lmprog_runtime.disaggregation.conn import KVManager
    from lmprog_runtime.disaggregation.transfer import FakeTransfer
    pool = SimpleNamespace(k=torch.zeros(2, 9, 1, 4), v=torch.zeros(2, 9, 1, 4))
    args = SimpleNamespace(disaggregation_mode="decode", host="127.0.0.1")
    return KVManager(args, pool, 1, FakeTransfer())


def _wait_mail(manager, room, kind):
    import time
    deadline = time.monotonic() + 10
    while not isinstance(manager.peek(room), kind):
        assert time.monotonic() < deadline, manager.peek(room)
        time.sleep(0.01)
    return manager.peek(room)


def test_an_abort_from_the_decode_side_is_answered_even_before_any_handshake():
    """The decode half sent its handshake and then its abort, and the prefill side saw only
    the abort (it replaced the handshake in the room's mailbox): the prefill half fails and
    answers the abort's endpoint, so the decode server frees its slots at once."""
    from lmprog_runtime.disaggregation.base import KVPoll, TransferAbort, TransferDone
    from lmprog_runtime.disaggregation.conn import KVSender
    prefill_m, decode_m = _manager(), _manager()
    try:
        sender = KVSender(prefill_m, room=42, prompt_len=8)
        assert sender.poll() is KVPoll.Bootstrapping
        decode_m.push(prefill_m.endpoint, TransferAbort(42, "client went away", decode_m.endpoint))
        _wait_mail(prefill_m, 42, TransferAbort)
        assert sender.poll() is KVPoll.Failed and "client went away" in sender.failure
        sender.abort(sender.failure)
        done = _wait_mail(decode_m, 42, TransferDone)
        assert not done.ok and prefill_m.peek(42) is None
    finally:
        prefill_m.close()
        decode_m.close()


def test_a_handshake_after_the_prefill_half_ended_is_answered_with_its_failure():
    from lmprog_runtime.disaggregation.base import KVPoll, TransferDone, TransferInfo
    from lmprog_runtime.disaggregation.conn import KVSender
    prefill_m, decode_m = _manager(), _manager()
    try:
        sender = KVSender(prefill_m, room=7, prompt_len=8)
        sender.abort("Aborted by client")  # before any handshake
        assert sender.poll() is KVPoll.Failed
        info = TransferInfo(7, decode_m.endpoint, "fake", decode_m.layout, list(range(1, 9)), 0)
        decode_m.push(prefill_m.endpoint, info)
        _wait_mail(prefill_m, 7, TransferInfo)
        prefill_m.answer_aborts()
        done = _wait_mail(decode_m, 7, TransferDone)
        assert not done.ok and "Aborted by client" in done.message
    finally:
        prefill_m.close()
        decode_m.close()


def test_mooncake_writes_go_in_bounded_batches_and_split_a_refused_one():
    """A prompt's KV is thousands of blocks; Mooncake's TCP lanes refuse a batch that overflows
    their queue (-1). Batches stay within MAX_BATCH_BLOCKS, and a refused one is split."""
    from lmprog_runtime.disaggregation import transfer

    class Lanes:  # refuses batches above `room` blocks, as a full lane queue does
        def __init__(self, room):
            self.room, self.calls, self.moved = room, [], []

        def batch_transfer_sync_write(self, peer, src, dst, lengths):
            self.calls.append(len(src))
            if len(src) > self.room:
                return -1
            self.moved += list(zip(src, dst, lengths))
            return 0

    mover = transfer.MooncakeTransfer.__new__(transfer.MooncakeTransfer)
    mover._batched = True
    blocks = list(range(2000))
    for room in (10_000, 100):
        mover.engine = Lanes(room)
        assert mover.write("peer", blocks, [b + 1 for b in blocks], [8] * 2000) == 16_000
        assert sorted(mover.engine.moved) == [(b, b + 1, 8) for b in blocks]  # every block once
        assert max(mover.engine.calls) <= transfer.MAX_BATCH_BLOCKS
    mover.engine = Lanes(0)
    with pytest.raises(RuntimeError, match="returned -1"):
        mover.write("peer", [1, 2], [3, 4], [8, 8])
