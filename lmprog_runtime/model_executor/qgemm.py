"""lmprog's own weight-only int8 and int4 matmuls for the CPU, used by `QuantLinear`:
`q8_matmul(x, q, scale)` = x @ (q * scale[:, None]).T, and
`q4_matmul(x, *pack_q4(q, scale, zero))` = x @ dequantize_int4((q, scale, zero)).T.
Two kernels per format:
- qgemm.c, float32 activations: widens each weight to float and multiplies in float;
- qdot.c, int8 activations (`dot_matmul`): quantizes each activation row in blocks of 32
  (scale max|x| / 127) and multiplies bytes with integer SIMD (AVX-512 VNNI, AVX2, or portable
  C, chosen when compiled). Same int8 buffers; int4 keeps the nibbles and stores the scales as
  float16 (s, m) pairs (`pack_q4_f16`: GGUF Q4_1's own 20 bytes a block, not 24). Adds the
  activation rounding (error <= max|x_block| / 254 per input). The probe picks by measurement.

torch's `_weight_int8pack_mm` is fast only with bfloat16 activations on some CPUs (measured
5x slower than the dense float32 GEMM with float32 ones on an AVX-512 Xeon); this kernel
streams each int8 weight once per call and widens it in registers, so a decode step reads a
quarter of the dense float32 bytes. Compiled by `native.build` at first use (-march=native);
`available()` is False where that is impossible and QuantLinear keeps torch's kernel.
"""

from __future__ import annotations

import ctypes
import pathlib

import torch

from lmprog_runtime import native


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.lm_q8_gemm.argtypes = [p, i32, i32, p, p, i64, p, i32]
    lib.lm_q8_gemm.restype = None
    lib.lm_q4_gemm.argtypes = [p, i32, i32, p, p, i64, p, i32]
    lib.lm_q4_gemm.restype = None


def _declare_dot(lib: ctypes.CDLL) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for name in ("lm_q8x8_gemm", "lm_q4x8_gemm"):
        getattr(lib, name).argtypes = [p, i32, i32, p, p, i64, p, i32]
        getattr(lib, name).restype = ctypes.c_int
    lib.lm_qdot_isa.argtypes, lib.lm_qdot_isa.restype = [], ctypes.c_int
    lib.lm_qdot_set_prefetch.argtypes, lib.lm_qdot_set_prefetch.restype = [i32], ctypes.c_int


_HERE = pathlib.Path(__file__).parent
_KERNEL = native.Kernel(_HERE / "qgemm.c", native.NATIVE_FLAGS, True, _declare)
# qdot.c builds: "native" as -march=native selects; the others force a slower inner loop (tests)
DOT_VARIANTS = {"native": (), "avx2": ("-DLM_QDOT_NO_AVX512",), "portable": ("-DLM_QDOT_PORTABLE",),
                # the vpdpbusd loops (AVX-512 VNNI / AVX-VNNI CPUs) with the instruction's maths in AVX2
                "vnni_emu": ("-DLM_QDOT_NO_AVX512", "-DLM_QDOT_VNNI_EMU")}
# each of those with one activation row per pass over the weights (no T-blocking): the
# bitwise reference of the blocked loops (tests) and bench/ab_qdot.py's baseline
DOT_VARIANTS.update({v + "_one_row": d + ("-DLM_QDOT_ONE_ROW",) for v, d in list(DOT_VARIANTS.items())})
# qdot.c's batch invariance is bitwise: a row's float sums keep their written order and
# roundings (no reassociation, no fused multiply-adds) in every inlined copy of its row-blocked
# loops, however the compiler schedules the other rows; its integer loops need no licence
_DOT_EXACT = ("-fno-associative-math", "-ffp-contract=off")
_DOT = {v: native.Kernel(_HERE / "qdot.c", native.NATIVE_FLAGS + _DOT_EXACT + d, True, _declare_dot)
        for v, d in DOT_VARIANTS.items()}
enabled = True  # tests switch the kernels off to compare against torch's


def available() -> bool:
    return enabled and _KERNEL.lib() is not None


def dot_available() -> bool:
    """The int8-activation kernels (qdot.c) are built; they need the float ones too (same layouts)."""
    return available() and dot_library() is not None


def dot_library():
    """qdot.c's native build (its `lm_pool_run` is the worker pool paged_decode.c shares), or None."""
    return _DOT["native"].lib()


def dot_isa(variant: str = "native") -> int:
    """512 (AVX-512 VNNI), 256 (AVX2 / AVX-VNNI) or 0 (portable C): the inner loop `variant` got."""
    return _DOT[variant].lib().lm_qdot_isa()


def set_prefetch(nbytes: int, variant: str = "native") -> int:
    """How far ahead (bytes) qdot.c's calls of one or two rows prefetch their weights (0: off);
    returns the previous setting. For benchmarks: the default is the measured one."""
    return _DOT[variant].lib().lm_qdot_set_prefetch(nbytes)


def q8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x float32 [T, K], q int8 [N, K] contiguous, scale float32 [N] -> y float32 [T, N]."""
    assert available() and x.dtype == scale.dtype == torch.float32 and q.dtype == torch.int8
    assert q.is_contiguous() and scale.is_contiguous() and x.shape[1] == q.shape[1]
    x = x.contiguous()
    T, K = x.shape
    y = torch.empty(T, q.shape[0], dtype=torch.float32)
    _KERNEL.lib().lm_q8_gemm(x.data_ptr(), T, K, q.data_ptr(), scale.data_ptr(), q.shape[0], y.data_ptr(),
                    torch.get_num_threads())
    return y


def pack_q4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """int4 blocks (q int32 [N, K] in 0..15, scale, zero [N, K/32]; w = (q - 8) * scale + zero)
    -> (packed uint8 [N, K/2], sz float32 [N, K/32, 2]) in qgemm.c's layout."""
    n, k = q.shape
    qg = q.reshape(n, k // 32, 32).to(torch.uint8)
    packed = (qg[..., :16] | (qg[..., 16:] << 4)).reshape(n, k // 2)
    scale = scale.float()
    sz = torch.stack([scale, zero.float() - 8 * scale], dim=-1)
    return packed.contiguous(), sz.contiguous()


def pack_q4_f16(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """int4 blocks -> (packed uint8 [N, K/2], sm float16 [N, K/32, 2]): qdot.c's int4 layout,
    with w = q * s + m. The bytes of pack_q4's nibbles and (s, m) pairs, rearranged (qdot.c's
    "int4 layout"): rows in groups of 8, each block's 8 rows interleaved 4 inputs at a time
    (low nibbles inputs 4k..4k+3, high nibbles 16 later) and its 8 s then 8 m; the N % 8 last
    rows after them as pack_q4 has them. The buffers keep pack_q4's shapes but not its row
    order: read them with `unpack_q4_f16`. GGUF Q4_1 blocks (d, m float16; zero = m + 8 d) get
    their own d and m back (exact whenever |m| >= 2^-13 |8 d|, as for any block whose minimum
    is its m); other weights round s and m to float16 (relative 2^-11)."""
    packed, sz = pack_q4(q, scale, zero)
    sm = sz.to(torch.float16)
    if not torch.isfinite(sm).all():
        raise ValueError("int4 scales or minimums beyond float16's range (|x| > 65504)")
    n, half = packed.shape
    g, n8 = half // 16, n - n % 8
    # [J, 8 rows, G, 4 k, 4 b] -> [J, G, 4 k, 8 rows, 4 b]
    head = packed[:n8].reshape(n8 // 8, 8, g, 4, 4).permute(0, 2, 3, 1, 4).reshape(-1)
    # [J, 8 rows, G, (s, m)] -> [J, G, (s, m), 8 rows]
    sm_head = sm[:n8].reshape(n8 // 8, 8, g, 2).permute(0, 2, 3, 1).reshape(-1)
    packed = torch.cat([head, packed[n8:].reshape(-1)]).reshape(n, half)
    sm = torch.cat([sm_head, sm[n8:].reshape(-1)]).reshape(n, g, 2)
    return packed.contiguous(), sm.contiguous()


def pack_q8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights q [N, K] (quantize_int8's) -> qdot.c's int8 layout, same shape: rows in
    groups of 8, each block of 32 inputs with its 8 rows interleaved 4 inputs at a time; the
    N % 8 last rows as they were. Read back with `unpack_q8`. The scales keep row order."""
    n, k = q.shape
    n8 = n - n % 8
    head = q[:n8].reshape(n8 // 8, 8, k // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1)  # [J, G, k, rows, b]
    return torch.cat([head, q[n8:].reshape(-1)]).reshape(n, k).contiguous()


def unpack_q8(packed: torch.Tensor) -> torch.Tensor:
    """`pack_q8`'s layout -> q [N, K] row by row."""
    n, k = packed.shape
    n8 = n - n % 8
    flat = packed.reshape(-1)
    head = flat[:n8 * k].reshape(n8 // 8, k // 32, 8, 8, 4).permute(0, 3, 1, 2, 4).reshape(n8, k)
    return torch.cat([head, flat[n8 * k:].reshape(n - n8, k)])


def unpack_q4_f16(packed: torch.Tensor, sm: torch.Tensor):
    """`pack_q4_f16`'s buffers -> (q int32 [N, K] in 0..15, sm float16 [N, K/32, 2] row by row)."""
    n, half = packed.shape
    g, n8 = half // 16, n - n % 8
    flat, sflat = packed.reshape(-1), sm.reshape(-1)
    rows = torch.cat([flat[:n8 * half].reshape(n8 // 8, g, 4, 8, 4).permute(0, 3, 1, 2, 4).reshape(n8, half),
                      flat[n8 * half:].reshape(n - n8, half)])
    sm_rows = torch.cat([sflat[:n8 * g * 2].reshape(n8 // 8, g, 2, 8).permute(0, 3, 1, 2).reshape(n8, g, 2),
                         sflat[n8 * g * 2:].reshape(n - n8, g, 2)])
    b = rows.reshape(n, g, 16).to(torch.int32)
    return torch.cat([b & 15, b >> 4], dim=-1).reshape(n, -1), sm_rows


def q4_matmul(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x float32 [T, K], packed uint8 [N, K/2], sz float32 [N, K/32, 2] -> y float32 [T, N]."""
    assert available() and x.dtype == sz.dtype == torch.float32 and packed.dtype == torch.uint8
    assert packed.is_contiguous() and sz.is_contiguous() and x.shape[1] == 2 * packed.shape[1]
    x = x.contiguous()
    T, K = x.shape
    y = torch.empty(T, packed.shape[0], dtype=torch.float32)
    _KERNEL.lib().lm_q4_gemm(x.data_ptr(), T, K, packed.data_ptr(), sz.data_ptr(), packed.shape[0], y.data_ptr(),
                             torch.get_num_threads())
    return y


_C_FNS = {}


def c_fn(name: str):
    """The C entry point for "int8" | "int4" (qgemm.c, float32 activations) or "int8x8" |
    "int4x8" (qdot.c, int8 ones): f(x, T, K, q, scales, N, y, threads), pointers to float32
    x [T, K], the weight buffers q8_matmul / q4_matmul take and float32 y [T, N]; returns
    nonzero when out of memory. Unchecked: callers fix the shapes once (QuantLinear)."""
    fn = _C_FNS.get(name)
    if fn is None:
        lib = _KERNEL.lib() if name in ("int8", "int4") else _DOT["native"].lib()
        fn = _C_FNS[name] = getattr(lib, {"int8": "lm_q8_gemm", "int4": "lm_q4_gemm", "int8x8": "lm_q8x8_gemm",
                                          "int4x8": "lm_q4x8_gemm"}[name])
    return fn


def dot_fn(fmt: str, variant: str = "native"):
    """The C entry point of qdot.c for `fmt` ("int8" | "int4"): f(x, T, K, q, scales, N, y,
    threads) -> 0 (or -1: out of memory), pointers to float32 x [T, K] and y [T, N] and to the
    weight buffers `q8_matmul` / `q4_matmul` take. QuantLinear calls it directly (no checks
    per call: it checked the shapes once)."""
    return getattr(_DOT[variant].lib(), "lm_q8x8_gemm" if fmt == "int8" else "lm_q4x8_gemm")


def dot_matmul(fmt: str, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, variant: str = "native"):
    """`q8_matmul` on `pack_q8`'s weights (scales float32 [N]) / `q4_matmul` on `pack_q4_f16`'s
    buffers (scales float16 [N, K/32, 2]) with int8 activations; x float32 [T, K], K % 32 == 0."""
    want = torch.float32 if fmt == "int8" else torch.float16
    assert dot_available() and x.dtype == torch.float32 and scales.dtype == want and x.shape[1] % 32 == 0
    assert q.is_contiguous() and scales.is_contiguous() and x.shape[1] == q.shape[1] * (1 if fmt == "int8" else 2)
    x = x.contiguous()
    T, K = x.shape
    y = torch.empty(T, q.shape[0], dtype=torch.float32)
    if dot_fn(fmt, variant)(x.data_ptr(), T, K, q.data_ptr(), scales.data_ptr(), q.shape[0], y.data_ptr(),
                            torch.get_num_threads()) != 0:
        raise MemoryError("qdot.c: no memory for the activation scratch")
    return y
