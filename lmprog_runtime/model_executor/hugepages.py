"""The quantized weights in 2 MB pages (transparent huge pages) on Linux CPUs.

A decode step streams every projection's weights from memory. In 4 KB pages a projection of
0.2-0.35 MB (SmolLM2's o and qkv) read at 13-17 GB/s where big ones read at 25-30 (likely:
each page is a new stream to the hardware prefetchers, which do not cross a page, and in a
virtual machine a two-level page walk on its TLB miss). `place_weights(model)` copies every
`QuantLinear`'s weight and scale buffers into one anonymous arena aligned to 2 MB and asks the
kernel for huge pages there (`madvise(MADV_HUGEPAGE)`, honoured when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`), then points the modules
at views of it. The bytes are the same, so outputs are too. Measured on the AVX2 EPYC (THP in
`madvise` mode): a batch-1 decode step 0.94x with steps alternating between the two placements
in one process; 0.957 / 0.933 at 512 / 140 cached tokens with old and new trees stepping
alternately (bench/ab_decode_step.py, bench/results/hugepages/).

The arena lives as long as the model (`model._weight_arena`); nothing happens off Linux, off
the CPU, where THP is `never`, or with LMPROG_NO_HUGEPAGES=1 (config.HUGEPAGE_WEIGHTS).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from typing import List, Tuple

import numpy as np
import torch

from lmprog_runtime import config

logger = logging.getLogger(__name__)

HUGE = 2 << 20           # bytes in a huge page (x86-64, arm64 with 4 KB base pages)
ALIGN = 4096             # each buffer's start in the arena: page-aligned (the kernels want 64)
MADV_HUGEPAGE = 14       # <sys/mman.h> on Linux
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
BUFFERS = ("qweight", "scales", "scale_mins", "scale_zeros")  # a QuantLinear's streamed buffers


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), or '' where unknown."""
    try:
        with open(THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def usable() -> bool:
    return config.HUGEPAGE_WEIGHTS and sys.platform.startswith("linux") and thp_mode() in ("always", "madvise")


def _streamed(model: torch.nn.Module) -> List[Tuple[dict, str, torch.Tensor]]:
    from lmprog_runtime.model_executor.quant import QuantLinear

    found, seen = [], set()
    for m in model.modules():
        if not isinstance(m, QuantLinear):
            continue
        for key in BUFFERS:
            t = m._buffers.get(key)
            if t is None or t.device.type != "cpu" or not t.is_contiguous() or id(t) in seen:
                continue
            seen.add(id(t))
            found.append((m._buffers, key, t))
    return found


def place_weights(model: torch.nn.Module) -> int:
    """Move the model's quantized weights into a huge-page arena (see the module docstring);
    the bytes moved (0 when nothing was done)."""
    if not usable():
        return 0
    bufs = _streamed(model)
    if not bufs:
        return 0
    sizes = [(t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN for _, _, t in bufs]
    total = sum(sizes)
    length = (total + HUGE - 1) // HUGE * HUGE + HUGE  # room to start on a 2 MB boundary
    try:
        arena = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError) as e:
        logger.debug("no huge-page arena: %s", e)
        return 0
    base = np.frombuffer(arena, dtype=np.uint8)
    addr = base.ctypes.data
    skip = (-addr) % HUGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(addr + skip, length - skip, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return 0
    off = skip
    with torch.no_grad():
        for (owner, key, t), size in zip(bufs, sizes):
            nbytes = t.numel() * t.element_size()
            view = torch.from_numpy(base[off:off + nbytes]).view(t.dtype).view(t.shape)
            view.copy_(t)
            owner[key] = view
            off += size
    model._weight_arena = arena  # the views' memory: freed with the model
    logger.info("weights: %.1f MB of quantized weights in huge pages (THP %s)", total / 2**20, thp_mode())
    return total
