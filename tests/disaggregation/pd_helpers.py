"""Helpers of the disaggregation tests: a prefill + decode pair of in-process Engines, the
router's part (the same request with bootstrap fields to both halves, logprobs merged as
SGLang's router does), and the audit of both pools."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_harness import free_port


def mooncake_or_skip() -> None:
    try:
        import mooncake.engine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a missing shared library
        pytest.skip(f"mooncake not importable ({type(e).__name__}: {e})")


def make_pair(model_path, backend: str, prefill_faults=None, decode_faults=None, **kwargs):
    """(prefill Engine, decode Engine, bootstrap port) on the tiny model; `*_faults`: a
    FaultInjector of that half's scheduler."""
    from engine_helpers import make_engine

    mooncake_or_skip() if backend == "mooncake" else None
    common = dict(dtype="float32", max_total_tokens=4096, random_seed=0, num_threads=1,
                  disaggregation_transfer_backend=backend, **kwargs)
    port = free_port()
    prefill = make_engine(model_path, disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                          port=free_port(), faults=prefill_faults, **common)
    decode = make_engine(model_path, disaggregation_mode="decode", port=free_port(), faults=decode_faults,
                         **common)
    return prefill, decode, port


def boot_fields(port: int, room=None) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": random.randrange(1 << 63) if room is None else room}


def merge(prefill_out: dict, decode_out: dict) -> dict:
    """SGLang's router: the prefill response's input logprobs go before the decode one's."""
    out = dict(decode_out)
    meta = dict(decode_out["meta_info"])
    if "input_token_logprobs" in prefill_out["meta_info"]:
        meta["input_token_logprobs"] = (prefill_out["meta_info"]["input_token_logprobs"]
                                        + (meta.get("input_token_logprobs") or []))
    out["meta_info"] = meta
    return out


def run_pair(prefill, decode, port: int, prompt, sampling: dict, stream: bool = False, **kwargs):
    """Both halves at once, as the router sends them: (prefill result, decode result) where a
    streamed decode result is its list of chunks."""
    boot = boot_fields(port)
    key = "input_ids" if isinstance(prompt, list) else "prompt"
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill.generate, **{key: prompt}, sampling_params=sampling, **boot, **kwargs)
        if stream:
            d = pool.submit(lambda: list(decode.generate(**{key: prompt}, sampling_params=sampling,
                                                         stream=True, **boot, **kwargs)))
        else:
            d = pool.submit(decode.generate, **{key: prompt}, sampling_params=sampling, **boot, **kwargs)
        return p.result(120), d.result(120)


def audit(*engines) -> None:
    for e in engines:
        e.check_integrity()


def in_thread(fn):
    """Start `fn` on a thread; returns (thread, box) where box holds its result or exception."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box
