"""The measurements behind `lmprog-runtime plan-kv` (docs/plan-kv.md).

`calibrate`: the model's real runner (an in-process Engine, radix cache off) streams one
request of the planned prompt length: its time to the first token is the prefill time Tp,
the median gap between later tokens one decode step Td. With two threads or more it runs
again on half of them for the slowdowns s_p and s_d of a half-machine side.

`measure_mooncake_tcp`: two processes on this machine, each with a Mooncake TransferEngine
(`initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")`) and a registered buffer; the parent
writes into the child's buffer with `transfer_sync_write` (small writes for the latency,
the request's KV size for the bandwidth) and checks that the bytes arrived.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import statistics
import time
from dataclasses import replace
from typing import Tuple

from lmprog_runtime.plan_kv import DTYPE_BYTES, KVShape, Rates

DECODE_STEPS = 16  # decode gaps measured per calibration run
SMALL_WRITE = 4096  # bytes: a write this small is all latency
MAX_MEASURE_BYTES = 512 << 20


def _run_once(args, threads: int, decode_steps: int) -> Tuple[float, float, str]:
    """(prefill s, decode step s, KV dtype name) of one streamed request on `threads` threads."""
    from lmprog_runtime import Engine

    prompt, out = min(args.prompt_tokens, args.calibrate_tokens), decode_steps + 1
    with Engine(model_path=args.model_path, dtype="auto" if args.dtype not in DTYPE_BYTES else args.dtype,
                num_threads=threads, disable_radix_cache=True, max_total_tokens=prompt + out + 64,
                page_size=args.page_size, random_seed=0) as engine:
        vocab = engine.scheduler.runner.model_config.vocab_size
        if prompt + out >= engine.scheduler.context_len:
            raise ValueError(f"--prompt-tokens {prompt}: longer than the model's context "
                             f"({engine.scheduler.context_len} tokens) allows for calibrating")
        engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 2})  # warm the kernels
        ids = [(i * 7919) % (vocab - 16) + 8 for i in range(prompt)]
        params = {"max_new_tokens": out, "ignore_eos": True, "temperature": 0}
        t0, stamps = time.perf_counter(), []
        for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
            if chunk["output_ids"]:
                stamps.append((time.perf_counter(), len(chunk["output_ids"])))
        dtype = str(engine.scheduler.runner.dtype).removeprefix("torch.")
    gaps = [(b - a) / (nb - na) for (a, na), (b, nb) in zip(stamps, stamps[1:]) if nb > na]
    return stamps[0][0] - t0, statistics.median(gaps), dtype


def calibrate(args, shape: KVShape) -> Tuple[Rates, KVShape]:
    from lmprog_runtime.model_executor.runner import default_num_threads

    threads = args.num_threads or default_num_threads()
    measured = min(args.prompt_tokens, args.calibrate_tokens)
    scale = args.prompt_tokens / measured  # prefill time taken as linear in the prompt length
    tp, td, dtype = _run_once(args, threads, DECODE_STEPS)
    if args.dtype == "auto":
        shape = replace(shape, dtype=dtype)
    sp, sd = args.prefill_slowdown, args.decode_slowdown
    source = f"measured on {measured} tokens{' x ' + format(scale, '.3g') if scale != 1 else ''}, {threads} threads"
    if (sp is None or sd is None) and threads >= 2:
        tp2, td2, _ = _run_once(args, threads // 2, DECODE_STEPS)
        # half the machine is never faster: a ratio under 1 is noise (other load), read as 1
        sp, sd = sp or max(1.0, tp2 / tp), sd or max(1.0, td2 / td)
        source += f"; half: {threads // 2}"
    return Rates(tp * scale, td, sp or 2.0, sd or 2.0, source), shape


# -- Mooncake TCP, two processes -----------------------------------------------------------------
def _engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize failed (tcp, P2PHANDSHAKE)")
    return engine


def _peer(conn, nbytes: int) -> None:
    """The receiving process: a registered buffer; reports (rpc port, address), then the
    bytes that arrived at both ends once told the writes are done."""
    engine = _engine()
    buf = ctypes.create_string_buffer(nbytes)
    addr = ctypes.addressof(buf)
    if engine.register_memory(addr, nbytes) != 0:
        raise RuntimeError("register_memory failed in the peer")
    conn.send((engine.get_rpc_port(), addr))
    conn.recv()
    conn.send((buf.raw[:64], buf.raw[-64:]))
    conn.recv()


def measure_mooncake_tcp(nbytes: int) -> dict:
    """Time `transfer_sync_write` of `nbytes` (capped at 512 MiB) into another process."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"--measure-link needs mooncake-transfer-engine-non-cuda ({e})") from None
    nbytes = max(SMALL_WRITE, min(nbytes, MAX_MEASURE_BYTES))
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, nbytes), daemon=True)
    proc.start()
    try:
        return _measure(parent, proc, nbytes)
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


def _measure(conn, proc, nbytes: int) -> dict:
    if not conn.poll(60):
        raise RuntimeError(f"the Mooncake peer did not start (exit code {proc.exitcode})")
    port, remote = conn.recv()
    engine = _engine()
    src = ctypes.create_string_buffer(bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256), nbytes)
    local = ctypes.addressof(src)
    if engine.register_memory(local, nbytes) != 0:
        raise RuntimeError("register_memory failed")
    target = f"127.0.0.1:{port}"

    def write(n: int) -> float:
        t0 = time.perf_counter()
        if engine.transfer_sync_write(target, local, remote, n) != 0:
            raise RuntimeError(f"transfer_sync_write of {n} bytes failed")
        return time.perf_counter() - t0

    write(SMALL_WRITE)  # the handshake
    small = min(write(SMALL_WRITE) for _ in range(5))
    big = min(write(nbytes) for _ in range(3))
    conn.send("done")
    head, tail = conn.recv()
    conn.send("bye")
    if head != src.raw[:64] or tail != src.raw[-64:]:
        raise RuntimeError("the bytes that arrived differ from the bytes sent")
    return {"bytes": nbytes, "transfer_s": big, "latency_us": small * 1e6,
            "bandwidth_GBps": nbytes / max(big - small, 1e-9) / 1e9, "verified": True}
