"""Prefill/decode disaggregation (SGLang's protocol; docs/disaggregation.md).

A prefill server (`--disaggregation-mode prefill`) computes prompts and writes their KV pages
into a decode server's pool (`--disaggregation-mode decode`), which decodes from the first
token the prefill side sampled. The router sends the same request, with `bootstrap_host`,
`bootstrap_port` and `bootstrap_room`, to both.

    base.py       KVPoll, the wire messages, the contracts of manager / sender / receiver
    bootstrap.py  the prefill server's bootstrap server (PUT/GET /route, /health)
    conn.py       KVManager (control endpoint, listener, heartbeat), KVSender, KVReceiver
    transfer.py   the byte movers: mooncake (TransferEngine) and fake (nothing moves)
    prefill.py    PrefillStages: bootstrapping → waiting ... → ship pages → finish
    decode.py     DecodeStages: prealloc → transfer → running

The scheduler calls one stage object through five hooks (`takes`/`add` where a request would
join the waiting queue, `poll` before admission, `after_step`, `abort`, `live` for the
integrity audit); `build_stages` returns None for a normal server.
"""

from __future__ import annotations


def refusal(req, stages):
    """A 400 for a request with bootstrap fields on a server of neither role, else None."""
    if req.bootstrap is None or stages is not None:
        return None
    from lmprog_runtime.messages import FinishReason
    return FinishReason.error(400, "bootstrap_host/bootstrap_port/bootstrap_room: this server is not part of "
                                   "a prefill/decode pair (start it with --disaggregation-mode prefill or "
                                   "decode).", "BadRequest")


def build_stages(args, runner, kv, admission, post, fail, stats: dict, faults=None):
    """The queue stages of this server's role, or None (`disaggregation_mode` null).
    `faults`: the scheduler's FaultInjector (tests only), checked at Stage.KV_TRANSFER."""
    if args.disaggregation_mode == "null":
        return None
    from lmprog_runtime.disaggregation.conn import KVManager
    from lmprog_runtime.disaggregation.transfer import build_transfer

    stats.update(num_disagg_transfers=0, num_disagg_failures=0, num_disagg_chunks_sent=0, disagg_bytes_sent=0,
                 disagg_bytes_received=0, disagg_transfer_s=0.0)
    pool = runner.token_to_kv_pool
    if args.disaggregation_transfer_backend == "mooncake" and pool.k.device.type != "cpu":
        raise ValueError("disaggregation_transfer_backend 'mooncake' writes host memory here (the non-CUDA "
                         f"Mooncake build); the KV pool is on {pool.k.device}.")
    transfer = build_transfer(args.disaggregation_transfer_backend, args.host, args.disaggregation_ib_device)
    manager = KVManager(args, pool, kv.page_size, transfer)
    if args.disaggregation_mode == "prefill":
        from lmprog_runtime.disaggregation.prefill import PrefillStages
        return PrefillStages(manager, kv, fail, stats, faults)
    from lmprog_runtime.disaggregation.decode import DecodeStages
    return DecodeStages(manager, kv, admission, post, fail, stats, faults)
