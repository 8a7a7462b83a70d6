"""Choose the CPU weight format by measuring this model's decode-step matmuls on this machine.

A format is (weights, kernel dtype): ("none", float32 | bfloat16) for dense weights, or
("int8" | "int4", float32 | bfloat16 | int8) for `QuantLinear` (int8: the integer-dot kernels,
qdot.c, offered where they are built; never chosen by ISA, only when they time fastest, by
QUANT_MARGIN over float32 activations). Which is fastest depends on the CPU
(AVX2 vs AVX-512 vs AMX) and on the batch: torch's quantized CPU kernels win when a step is
bound by reading weights (small batches) and can lose to the dense GEMM at large ones. So the
probe times every allowed format at several batch sizes and returns
- the dense dtype with the smallest summed time (the model's activation dtype, except beside
  quantized kernels that take float32, where it is only the kept dense copies' dtype),
- the format with the fastest batch-1 step (a quantized one only when it beats the dense
  weights by QUANT_MARGIN; one on torch's kernels only when it beats lmprog's C kernels,
  whose layers run fused, by FUSED_MARGIN), and, when it is quantized, the first batch size
  at which the dense weights are faster (`dense_rows`, None if never).
Results are cached as JSON under CACHE_DIR keyed by CPU, torch, threads, shapes and candidates,
so a warm start skips the ~1-3 s of timing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from lmprog_runtime.model_executor import qgemm
from lmprog_runtime.model_executor.quant import QUANT_FORMATS, QuantLinear, on_c_kernels

logger = logging.getLogger(__name__)

PROBE_BATCHES = (1, 4, 16, 32, 64)
PROBE_VERSION = 6  # bump when a format's kernel or the choice rule changes (cached timings then no longer hold;
# 6: FUSED_MARGIN, which changes the formats timed past batch 1)
PROBE_RETRIES = 2  # re-measurements when the machine was visibly busy during the probe
PROBE_LAYERS = 4  # distinct weights per format: enough to overflow caches like the real model
# A quantized format replaces the dense float32 weights only when its batch-1 step is at least
# this much faster: near-ties flip with timing noise from one start to the next, and dense
# float32 is the exact path. Likewise int8 activations replace float32 ones only by this margin
# (they agree less with float32 greedy: bench/greedy_agreement.py; bfloat16 ones round too).
QUANT_MARGIN = 0.10
# The matmuls are not the whole step: on lmprog's C kernels (float32 or int8 activations) a
# decode step's layers run as fused C calls (llama_layer.py), on torch's (bfloat16
# activations) op by op, ~140 torch calls a layer that the matmul timings leave out. So a
# torch-kernel format is chosen over a C-kernel one only when its matmuls are this much faster
# (measured: SmolLM2 int4 on a 2-core AMX Xeon, matmuls 8.8 ms bfloat16 vs 8.6 ms int8
# activations, whole steps 13.9 ms vs 8.3 ms).
FUSED_MARGIN = 0.5
DENSE_DROP = 2.0  # a dense format this many times slower than the best dense one is timed no further,
DENSE_DROP_FROM = 16  # from this batch on (below it a step reads weights: bfloat16 halves them)
Format = Tuple[str, str]  # (weights "none" | "int8" | "int4", kernel dtype name)


@dataclass(frozen=True)
class FormatChoice:
    dense_dtype: torch.dtype  # activations, KV, and dense weights
    quant: Optional[str]  # None | "int8" | "int4"
    act_dtype: torch.dtype  # the quantized kernels' input dtype (int8: quantized per call, qdot.c)
    dense_rows: Optional[int]  # batches of at least this many rows use kept dense weights
    dense_weight_dtype: Optional[torch.dtype] = None  # those kept weights' dtype; None: dense_dtype


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _shapes(config) -> List[Tuple[int, int]]:
    """(out, in) of one layer's projections, fused as the model fuses them."""
    c = config
    return [((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
            (c.hidden_size, c.num_heads * c.head_dim),
            (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]


class _Dense:
    """A dense projection with QuantLinear's call shape: x [T, in] -> [T, out]."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype):
        self.weight, self.dtype, self.in_features = w.to(dtype), dtype, w.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.dtype), self.weight)


def _random_weights(config, layers: int) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Random weights of the model's shapes: `layers` layers' projections and the head. Every
    format is built from the same ones (a head alone is ~28M draws)."""
    return ([torch.randn(n, k) * 0.02 for _ in range(layers) for n, k in _shapes(config)],
            torch.randn(config.vocab_size, config.hidden_size) * 0.02)


def _build(fmt: Format, weights_: Tuple[List[torch.Tensor], torch.Tensor]) -> Tuple[List[Callable], Callable]:
    """Per-layer projections and the head for `fmt` from `_random_weights`' tensors."""
    weights, kdtype = fmt[0], _dtype(fmt[1])

    def make(w, head=False):
        if weights == "none":
            return _Dense(w, kdtype)
        n, k = w.shape
        lin = QuantLinear("int8" if head else weights, n, k, kdtype)
        lin.set_weight(w)
        return lin

    layer_ws, head_w = weights_
    return [make(w) for w in layer_ws], make(head_w, head=True)


def _step_time(layer_ops, head, config, x_by_k, layers: int) -> float:
    """Seconds of one decode step's matmuls, scaled from `layers` to the model's layer count."""
    t0 = time.perf_counter()
    for op in layer_ops:
        op(x_by_k[op.in_features])
    t_layers = time.perf_counter() - t0
    t0 = time.perf_counter()
    head(x_by_k[config.hidden_size])
    return t_layers * config.num_layers / layers + time.perf_counter() - t0


def measure(config, formats: List[Format], batches=PROBE_BATCHES, reps: int = 3) -> Dict[Format, Dict[int, float]]:
    """Best-of-`reps` step seconds per format and batch size, formats timed interleaved.

    A quantized format stops being timed at the first batch where it loses to every dense one
    (its larger batches would use the dense weights anyway), a dense one where it takes over
    DENSE_DROP times the best dense step from batch DENSE_DROP_FROM on (bfloat16 without
    bfloat16 arithmetic: ~1 s a step at batch 64), and after the first batch only `finalists` are timed.
    """
    layers = min(config.num_layers, PROBE_LAYERS)
    ws = _random_weights(config, layers)
    built = {f: _build(f, ws) for f in formats}
    del ws
    timings: Dict[Format, Dict[int, float]] = {f: {} for f in formats}
    live = list(formats)
    for b in batches:
        xs = {k: torch.randn(b, k) for k in {k for _, k in _shapes(config)} | {config.hidden_size}}
        for f in live:
            _step_time(*built[f], config, xs, layers)  # warm-up: oneDNN JITs on first use
        for _ in range(reps):
            for f in live:
                t = _step_time(*built[f], config, xs, layers)
                timings[f][b] = min(timings[f].get(b, float("inf")), t)
        best_dense = min((timings[f][b] for f in live if f[0] == "none"), default=float("inf"))
        drop = DENSE_DROP if b >= DENSE_DROP_FROM else float("inf")
        live = [f for f in live if (f[0] == "none" and timings[f][b] <= drop * best_dense)
                or (f[0] != "none" and timings[f][b] < best_dense)]
        if b == batches[0]:
            kept = finalists(timings)
            live = [f for f in live if f in kept]
    return timings


def _on_c_kernels(f: Format) -> bool:
    """A quantized format on lmprog's C kernels (quant.on_c_kernels): its decode step is the
    fused C layer, not torch ops one by one."""
    return f[0] != "none" and on_c_kernels(_dtype(f[1]))


def _best(timings: Dict[Format, Dict[int, float]], require_quant: bool) -> Format:
    """The format `choose` picks: by batch-1 times alone, a torch-kernel format (bfloat16
    activations) only when it beats the C-kernel ones by FUSED_MARGIN."""
    dense = {f: t for f, t in timings.items() if f[0] == "none"}
    pool = [f for f in timings if f[0] != "none"] if require_quant else list(timings)
    best = min(pool, key=lambda f: timings[f][1])
    if best[0] != "none" and not _on_c_kernels(best):
        fused = [f for f in pool if _on_c_kernels(f) and timings[f][1] <= (1 + FUSED_MARGIN) * timings[best][1]]
        if fused:
            best = min(fused, key=lambda f: timings[f][1])
    float_act = [f for f in pool if f[0] != "none" and f[1] == "float32"]
    if best[1] == "int8" and float_act:  # int8 activations cost greedy agreement: only when clearly faster
        best_float = min(float_act, key=lambda f: timings[f][1])
        if timings[best][1] > (1 - QUANT_MARGIN) * timings[best_float][1]:
            best = best_float
    best_dense = min(dense, key=lambda f: dense[f][1])
    if not require_quant and best[0] != "none" and timings[best][1] > (1 - QUANT_MARGIN) * dense[best_dense][1]:
        best = best_dense  # not clearly faster than dense weights
    return best


def finalists(timings: Dict[Format, Dict[int, float]]) -> List[Format]:
    """After batch 1, the formats whose larger batches `choose` can read: the dense ones (the
    dense dtype, the crossover) and the quantized one it picks, with or without
    `require_quant`. Timing the others further (bfloat16 kernels on a CPU without bfloat16
    arithmetic: a second at batch 64) only lengthens a first start."""
    keep = [f for f in timings if f[0] == "none"]
    for require_quant in (False, True):
        if require_quant and not any(f[0] != "none" for f in timings):
            continue
        best = _best(timings, require_quant)
        if best not in keep:
            keep.append(best)
    return keep


def choose(timings: Dict[Format, Dict[int, float]], require_quant: bool = False) -> FormatChoice:
    """The format with the fastest batch-1 step (a quantized one if `require_quant`); see the
    module docstring. `timings` holds at least one dense format, timed at every batch."""
    dense = {f: t for f, t in timings.items() if f[0] == "none"}
    batches = sorted({b for t in dense.values() for b in t})  # a dense format dropped early: inf after
    dense_dtype = _dtype(min(dense, key=lambda f: sum(dense[f].get(b, float("inf")) for b in batches))[1])
    best = _best(timings, require_quant)
    if best[0] == "none":
        return FormatChoice(dense_dtype, None, torch.float32, None)
    crossover = [b for b in batches
                 if b not in timings[best] or min(d[b] for d in dense.values() if b in d) < timings[best][b]]
    if best[1] == "bfloat16":
        return FormatChoice(dense_dtype, best[0], _dtype(best[1]), crossover[0] if crossover else None)
    # float32 or int8 kernels take float32 activations: the model runs in float32 around them
    # (the fused decode layer needs it, and converting every op's input costs more than it saves),
    # while the kept dense copies stay in the faster dense dtype (bfloat16 GEMMs for prefill)
    return FormatChoice(torch.float32, best[0], _dtype(best[1]), crossover[0] if crossover else None,
                        dense_weight_dtype=dense_dtype if crossover else None)


def select_formats(dtype: str, quantization: str, device: torch.device, config,
                   source_quantized: bool, deterministic: bool = False) -> FormatChoice:
    """The weight format for `--dtype` / `--quantization` (see config.py for the flags' rules).

    `auto` quantizes only on a CPU, with `--dtype auto`, for weights that arrive quantized
    (GGUF), and only when the probe measures a faster batch-1 step.
    `deterministic` (--enable-deterministic-inference): float32 for `auto`, and quantized kernels
    only with float32 activations and at every batch size (no dense crossover). Those kernels give a row the same
    result whatever the other rows; bfloat16 activations would not break that themselves, but
    rounding them turns the attention kernels' 1e-7 batch-dependent differences into bf16-ulp
    ones, which flip greedy tokens (measured: 4 of 8 chat answers).
    """
    explicit_quant = quantization in QUANT_FORMATS
    if device.type != "cpu":
        if explicit_quant:
            raise ValueError(f"quantization {quantization!r} runs on the CPU only (got device {device.type!r})")
        return FormatChoice(_dtype(dtype), None, torch.float32, None)
    dense = [("none", "float32"), ("none", "bfloat16")] if dtype == "auto" else [("none", dtype)]
    if deterministic and dtype == "auto":
        dense = [("none", "float32")]  # activations and KV in float32 too, for the same reason
    quants = []
    if explicit_quant or (quantization == "auto" and dtype == "auto" and source_quantized):
        quants = [(q, d) for q in ([quantization] if explicit_quant else list(QUANT_FORMATS))
                  for d in _kernel_dtypes(deterministic)]
    if len(dense) == 1 and not quants:
        return FormatChoice(_dtype(dense[0][1]), None, torch.float32, None)
    timings = measure_cached(config, dense + quants)
    choice = choose(timings, require_quant=explicit_quant)
    if deterministic:
        choice = dataclasses.replace(choice, dense_rows=None, dense_weight_dtype=None)
    logger.info("weight formats (decode-step matmuls): %s -> %s", describe(timings), choice)
    return choice


def _kernel_dtypes(deterministic: bool) -> Tuple[str, ...]:
    """Quantized kernels' activation dtypes to time. Deterministic mode keeps float32 only: int8
    activations are quantized per row (batch-invariant themselves) but, like bfloat16, would
    turn attention's 1e-7 batch-dependent differences into whole rounding steps."""
    if deterministic:
        return ("float32",)
    return ("float32", "bfloat16") + (("int8",) if qgemm.dot_available() else ())


def probe_key(config, formats: List[Format]) -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = "".join(line for line in info.splitlines() if line.startswith(("model name", "flags")))[:4000]
    except OSError:
        pass
    parts = [str(PROBE_VERSION), cpu, torch.__version__, str(torch.get_num_threads()), repr(_shapes(config)),
             str((config.vocab_size, config.num_layers)), repr(sorted(formats)), repr(PROBE_BATCHES)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def measure_cached(config, formats: List[Format]) -> Dict[Format, Dict[int, float]]:
    """`measure`, or its result from an earlier start on the same machine and settings."""
    from lmprog_runtime.config import CACHE_DIR

    path = os.path.join(CACHE_DIR, "probe", f"formats-{probe_key(config, formats)}.json")
    try:
        with open(path) as f:
            rows = json.load(f)
        return {(r["weights"], r["dtype"]): {int(b): t for b, t in r["seconds"].items()} for r in rows}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    timings = measure(config, formats)
    for _ in range(PROBE_RETRIES):
        if consistent(timings):
            break
        logger.info("format probe disturbed (a dense step got faster with a larger batch); timing again")
        timings = measure(config, formats)
    if not consistent(timings):  # a busy machine: use the result, but measure again next start
        return timings
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump([{"weights": w, "dtype": d, "seconds": s} for (w, d), s in timings.items()], f)
        os.replace(tmp, path)
    except OSError:  # a read-only cache only costs the probe next time
        pass
    return timings


def consistent(timings: Dict[Format, Dict[int, float]], slack: float = 1.25) -> bool:
    """Dense steps take no less time at a larger batch (within `slack`): the test that the
    machine was quiet enough for the timings to mean something."""
    for (weights, _), by_batch in timings.items():
        times = [by_batch[b] for b in sorted(by_batch)]
        if weights == "none" and any(a > slack * b for a, b in zip(times, times[1:])):
            return False
    return True


def describe(timings: Dict[Format, Dict[int, float]]) -> str:
    return "; ".join(f"{w}/{d}: " + " ".join(f"b{b}={t * 1e3:.1f}ms" for b, t in s.items())
                     for (w, d), s in timings.items())
