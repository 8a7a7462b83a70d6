"""Prometheus metrics for `/metrics`, with SGLang's series names (`sglang:*`).

Counters and histograms are fed from finished requests (`TokenizerManager.on_finish`);
gauges are read from the scheduler's latest internal state at scrape time. Each server
has its own registry, so several servers (or tests) in one process never collide.
"""

from __future__ import annotations

from typing import Any, Dict, List, Union

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"

# seconds
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 15.0, 20.0, 30.0, 60.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

# gauge name -> (key in the scheduler's internal state, help)
_GAUGES = {
    "num_running_reqs": ("num_running_reqs", "Requests in the running batch."),
    "num_queue_reqs": ("num_queue_reqs", "Requests waiting to be scheduled."),
    "num_grammar_queue_reqs": ("num_grammar_queue_reqs", "Requests waiting for a grammar to compile."),
    "num_used_tokens": ("num_used_tokens", "KV slots held by requests (cached prefixes excluded)."),
    "max_total_num_tokens": ("max_total_num_tokens", "KV slots in the pool."),
    "token_usage": ("token_usage", "Fraction of the KV pool in use."),
    "cache_hit_rate": ("cache_hit_rate", "Prefix-cache hit rate over all prompt tokens so far."),
    "gen_throughput": ("last_gen_throughput", "Recent generation throughput (tokens/s)."),
    "spec_accept_length": ("avg_spec_accept_length",
                           "Speculative decoding: mean tokens per verify step (accepted drafts + 1)."),
    "spec_accept_rate": ("spec_accept_rate", "Speculative decoding: accepted / proposed draft tokens."),
}
# counter name -> (key in the scheduler's internal state, help); cumulative since start
_COUNTERS = {
    "spec_verify": ("spec_num_verify", "Speculative decoding: verify steps (one per request and step)."),
    "spec_draft_tokens": ("spec_num_draft_tokens", "Speculative decoding: draft tokens proposed."),
    "spec_accepted_tokens": ("spec_num_accepted_tokens", "Speculative decoding: draft tokens accepted."),
}


# HiCache series (docs/hicache.md), present when the scheduler runs it:
# name -> (help, label name, {label value: key in the internal state})
_HICACHE = {
    "lmprog:hicache_hit_tokens": ("Prompt tokens served from each KV tier (first admissions).", "tier",
                                  {"L1": "hicache_hit_tokens_l1", "L2": "hicache_hit_tokens_l2",
                                   "L3": "hicache_hit_tokens_l3"}),
    "lmprog:hicache_bytes_loaded": ("KV bytes read from a tier (L2: host to device; L3: storage to host).",
                                    "tier", {"L2": "l2_load_bytes", "L3": "l3_read_bytes"}),
    "lmprog:hicache_bytes_written": ("KV bytes written to a tier (L2: device to host; L3: host to storage).",
                                     "tier", {"L2": "l2_write_bytes", "L3": "l3_write_bytes"}),
    "lmprog:hicache_load_back_decisions": ("Host-resident prefixes loaded back vs recomputed.", "decision",
                                           {"load": "hicache_decisions_load",
                                            "recompute": "hicache_decisions_recompute"}),
    "lmprog:hicache_copy_bytes_per_second": ("Measured tier bandwidth (cost-model input).", "tier",
                                             {"L2": "hicache_l2_load_bytes_per_s",
                                              "L3": "hicache_l3_read_bytes_per_s"}),
    "lmprog:hicache_seconds_sum": ("Total seconds of load-backs (L2 to L1) and prefetches (L3 to L2).", "op",
                                   {"load_back": "hicache_load_back_seconds_sum",
                                    "prefetch": "hicache_prefetch_seconds_sum"}),
    "lmprog:hicache_seconds_count": ("Number of load-backs and prefetches.", "op",
                                     {"load_back": "hicache_load_back_count", "prefetch": "hicache_prefetch_count"}),
    "lmprog:hicache_prefill_tokens_per_second": ("Measured prefill rate (cost-model input).", None,
                                                 {"": "hicache_prefill_tokens_per_s"}),
    "lmprog:hicache_host_tokens": ("Tokens with a copy in the host pool (L2).", None, {"": "hicache_host_tokens"}),
    "lmprog:hicache_storage_tree_tokens": ("Tokens of radix-tree nodes whose KV is only in storage (L3).", None,
                                           {"": "hicache_storage_tree_tokens"}),
    "lmprog:hicache_layerwise_copy_seconds": ("Seconds the layer-wise load-back thread spent copying (L2 to L1, "
                                              "overlapping forwards).", None,
                                              {"": "hicache_layerwise_copy_seconds_sum"}),
}


class _SchedulerGauges:
    """A collector that reports the gauges of the last scheduler state(s) it was given: one
    dict (one scheduler), or one per data-parallel replica, then labelled `dp_rank`."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.state: Union[Dict[str, Any], List[Dict[str, Any]]] = {}

    def _rows(self):
        """(label names, [(label values, state)]) of the states to report."""
        if isinstance(self.state, dict):
            return ["model_name"], [([self.model_name], self.state)]
        return ["model_name", "dp_rank"], [([self.model_name, str(s.get("dp_rank", r))], s)
                                           for r, s in enumerate(self.state)]

    def collect(self):
        labels, rows = self._rows()
        for name, (key, doc) in _GAUGES.items():
            family = GaugeMetricFamily(f"sglang:{name}", doc, labels=labels)
            for values, state in rows:
                value = state.get(key)
                if isinstance(value, (int, float)):
                    family.add_metric(values, float(value))
            yield family
        for name, (key, doc) in _COUNTERS.items():
            present = [(v, s[key]) for v, s in rows if isinstance(s.get(key), (int, float))]
            if present:  # only where speculation is on
                family = CounterMetricFamily(f"sglang:{name}", doc, labels=labels)
                for values, value in present:
                    family.add_metric(values, float(value))
                yield family
        if any("hicache_host_pool_tokens" in s for _, s in rows):
            yield from self._hicache(labels, rows)

    def _hicache(self, labels, rows):
        for name, (doc, label, keys) in _HICACHE.items():
            family = GaugeMetricFamily(name, doc, labels=labels + ([label] if label else []))
            for values, state in rows:
                for value, key in keys.items():
                    v = state.get(key)
                    if isinstance(v, (int, float)):
                        family.add_metric(values + ([value] if label else []), float(v))
            yield family


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens processed.", labels, registry=reg)
        self.generation_tokens = Counter("sglang:generation_tokens", "Tokens generated.", labels, registry=reg)
        self.cached_tokens = Counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache.",
                                     labels, registry=reg)
        self.num_requests = Counter("sglang:num_requests", "Finished requests.", labels, registry=reg)
        self.num_aborted = Counter("sglang:num_aborted_requests", "Requests that ended in an abort.", labels,
                                   registry=reg)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("sglang:inter_token_latency_seconds",
                             "Mean time between output tokens, one sample per request.", labels,
                             buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             labels, buckets=_E2E_BUCKETS, registry=reg)
        self.scheduler_restarts = Counter("lmprog:scheduler_restarts", "Scheduler processes restarted after "
                                          "dying (--scheduler-restart).", labels, registry=reg)
        self.scheduler_restarts.labels(model_name)  # exported as 0 from the start
        self.gauges = _SchedulerGauges(model_name)
        reg.register(self.gauges)

    def on_finish(self, state) -> None:
        """TokenizerManager's `on_finish` hook: one finished request (health probes excluded)."""
        if state.msg.rid.startswith(HEALTH_CHECK_PREFIX):
            return
        m, name = state.meta, self.model_name
        completion = int(m.get("completion_tokens", len(state.output_ids)))
        self.prompt_tokens.labels(name).inc(int(m.get("prompt_tokens", len(state.msg.input_ids))))
        self.cached_tokens.labels(name).inc(int(m.get("cached_tokens", 0)))
        self.generation_tokens.labels(name).inc(completion)
        self.num_requests.labels(name).inc()
        if state.finished_reason is not None and state.finished_reason.is_abort:
            self.num_aborted.labels(name).inc()
        if "e2e_latency" in m:
            self.e2e.labels(name).observe(m["e2e_latency"])
        if state.first_token_time is not None:
            self.ttft.labels(name).observe(state.first_token_time - state.created)
            if completion > 1 and state.last_token_time is not None:
                self.itl.labels(name).observe((state.last_token_time - state.first_token_time) / (completion - 1))

    def render(self, scheduler_state: Union[Dict[str, Any], List[Dict[str, Any]]]) -> bytes:
        """`scheduler_state`: the scheduler's internal state, or one per DP replica."""
        self.gauges.state = scheduler_state
        return generate_latest(self.registry)
