"""The scheduler's control messages: flush, internal state, inspection, weights, HiCache
storage. Each takes the Scheduler `s` and answers a ControlReply. The overlap loop may
handle them while its worker computes a forward; whatever changes state (flush, weights,
storage) first checks that the scheduler is idle, and there is no forward then.
"""

from __future__ import annotations

from lmprog_runtime import gc_tuning
from lmprog_runtime.messages import (ControlReply, FlushCacheReq, FreezeGcReq, GetInternalStateReq, HiCacheStorageReq,
                                     InspectReq, MemoryOccupationReq, UpdateWeightsReq)
from lmprog_runtime.scheduler.inspect import inspect_reply


def control_reply(s, msg) -> ControlReply:
    if isinstance(msg, FlushCacheReq):
        return flush_cache(s)
    if isinstance(msg, GetInternalStateReq):
        return ControlReply("internal_state", data=internal_state(s))
    if isinstance(msg, FreezeGcReq):
        frozen = gc_tuning.freeze()
        return ControlReply("freeze_gc", message=f"Froze {frozen} objects.", data={"gc_frozen_objects": frozen})
    if isinstance(msg, InspectReq):
        return inspect_reply(s, msg)
    if isinstance(msg, (UpdateWeightsReq, MemoryOccupationReq)):
        return s.weights.handle(msg, s.is_idle())
    if isinstance(msg, HiCacheStorageReq):
        busy = None if s.is_idle() else (f"#queue-req={len(s.waiting) + len(s.grammars)} "
                                         f"#running-req={len(s.running)}")
        return s.storage_control.handle(msg, busy)
    raise TypeError(f"unknown message {type(msg).__name__}")


def flush_cache(s) -> ControlReply:
    """Empty the radix cache (and the n-gram store); refused while any request is pending."""
    if not s.is_idle():
        return ControlReply("flush_cache", success=False,
                            message="Cache not flushed because there are pending requests.")
    s.kv.flush()
    if s.speculator is not None:
        s.speculator.source.flush()
    return ControlReply("flush_cache", message="Cache flushed.")


def check_integrity(s) -> None:
    """Every KV slot accounted for (raises KVIntegrityError / AssertionError otherwise)."""
    s.kv.check_integrity(s.running + (s.disagg.live() if s.disagg is not None else []))
    if s.speculator is not None:
        s.speculator.source.check_integrity()


def internal_state(s) -> dict:
    """SGLang's `internal_states[0]` fields, then ours (stats, speculation, HiCache, disagg)."""
    st, kv, lim = s.stats, s.kv, s.limits
    hit = st["num_cached_tokens"] / st["num_prompt_tokens"] if st["num_prompt_tokens"] else 0.0
    return {
        "max_total_num_tokens": lim.pool_tokens,
        "max_req_input_len": lim.max_req_input_len,
        "max_running_requests": lim.max_running,
        "num_running_reqs": len(s.running),
        "num_queue_reqs": len(s.waiting) + len(s.grammars) + (len(s.disagg) if s.disagg else 0),
        "num_grammar_queue_reqs": len(s.grammars),
        "num_used_tokens": lim.pool_tokens - kv.available(),
        "token_usage": 1 - kv.available() / lim.pool_tokens,
        "cache_hit_rate": hit,
        "cached_tokens": kv.tree.total_size() if kv.cache_enabled else 0,
        "evictable_tokens": kv.tree.evictable_size() if kv.cache_enabled else 0,
        "new_token_ratio": s.admission.new_token_ratio,
        "last_gen_throughput": s.last_gen_throughput,
        "integrity": _audit(s) if s.is_idle() else "busy",
        "watchdog_trips": s.watchdog.trips,
        "weight_version": s.weights.version,
        "memory_released": list(s.weights.released),
        **(s.speculator.internal_state() if s.speculator is not None else {}),
        **st,
        **(kv.hicache.state() if kv.hicache is not None else {}),
        **(s.disagg.state() if s.disagg is not None else {}),
        **gc_tuning.monitor(s.args.gc_warning_threshold_secs).stats(),
    }


def _audit(s) -> str:
    try:
        check_integrity(s)
    except AssertionError as e:  # KVIntegrityError, or an assert of a part
        return f"broken: {e}"
    return "ok"
