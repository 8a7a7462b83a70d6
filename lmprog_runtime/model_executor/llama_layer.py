"""The quantized Llama decode step with two C calls per layer (llama_layer.c), not ~45 ctypes and
torch calls: per layer `lm_layer_tail(i - 1) + lm_layer_head(i)` (o, norm, gate_up, silu * up,
down, then the next layer's norm, qkv, rope + K/V write) and one attention-backend call; when
that call is the paged decode kernel (`decode_attend`) and no HiCache load-back gates the layers,
the whole step is one C call (`lm_layers_run`: no Python between layers).

Used by `LlamaForCausalLM.run_layers` when `plan(model, T)` gives a `FusedLayers`: every
projection of every layer is a `QuantLinear` on one of lmprog's C kernels (qdot.c's int8
activations or qgemm.c's float32 ones), T is below every layer's `dense_rows` and at most
`MAX_ROWS`, the fused rope/KV
conditions hold (`llama.fused_decode_ok`: the caller passes the rope table only then), the C ops
are built and switched on, and `config.FUSED_LAYER` (LMPROG_NO_FUSED_LAYER unset) or this
module's `enabled` allow it. The C code calls the very functions the layer-by-layer path calls
(pointers to qdot.c's, qgemm.c's, fused_ops.c's and decode_ops.c's exports, compiled as their
own builds compile them), so both paths give the same logits bit for bit
(tests/runtime/test_llama_layer.py).

Buffers: one set per model, sized for the largest T seen so far (rows [:T] are used); the weight
structs are bound once and rebound when a buffer or module object changes (`plan` checks).
"""

from __future__ import annotations

import ctypes
import operator
import pathlib
import threading
from typing import List, Optional

import torch

from lmprog_runtime import config, native
from lmprog_runtime.model_executor import decode_ops, fused_ops, qgemm
from lmprog_runtime.model_executor.quant import QuantLinear, choice_rows

_p, _i64 = ctypes.c_void_p, ctypes.c_int64

# Registrations of modules, parameters and buffers anywhere in the process (torch's global
# registration hooks: every `module.name = ...` of a module, parameter or buffer, add_module,
# register_buffer / register_parameter). A FusedLayers whose last check saw the current count
# knows nothing it points into was replaced since, without re-reading ~630 dict entries a step
# (which, on caches the step's weights have just streamed through, cost ~4% of a batch-1 step).
_registrations = [0]


def _count_registration(module, name, value) -> None:
    _registrations[0] += 1  # returns None: the value is registered unchanged


_watching: list = []


def _watch_registrations() -> None:
    if not _watching:
        mm = torch.nn.modules.module
        _watching.extend(hook(_count_registration) for hook in (
            mm.register_module_module_registration_hook, mm.register_module_parameter_registration_hook,
            mm.register_module_buffer_registration_hook))


class _Gemm(ctypes.Structure):
    _fields_ = [("fn", _p), ("status", _i64), ("K", _i64), ("N", _i64), ("q", _p), ("s", _p), ("bias", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Gemm), ("o", _Gemm), ("gate_up", _Gemm), ("down", _Gemm), ("in_norm", _p),
                ("post_norm", _p), ("k_cache", _p), ("v_cache", _p)]


class _Ctx(ctypes.Structure):
    _fields_ = [("norm", _p), ("rope_kv", _p), ("silu_mul", _p), ("T", _i64), ("hidden", _i64), ("H", _i64),
                ("KV", _i64), ("D", _i64), ("I", _i64), ("nthreads", _i64), ("eps", ctypes.c_double),
                ("kv_bf16", _i64),
                *((name, _p) for name in ("res", "x", "h", "qkv", "q", "o", "gu", "act")),
                ("table", _p), ("pos", _p), ("slots", _p), ("P", _i64), ("num_slots", _i64)]


class _Attn(ctypes.Structure):
    """lm_paged_decode's arguments but K and V (PagedDecodePlan.c_args' order), for lm_layers_run"""
    _fields_ = [("fn", _p), ("q", _p), ("kv_bf16", _i64), ("prefix", _p), ("P", _i64), ("table", _p),
                ("ld", _i64), ("rows", _p), ("seq_lens", _p), ("B", _i64), ("H", _i64), ("KV", _i64),
                ("D", _i64), ("scale", ctypes.c_double), ("chunk", _i64), ("nthreads", _i64), ("scratch", _p),
                ("out", _p)]


class _Final(ctypes.Structure):
    """The model's last norm and logits head (lm_final), for steps wanting every row's logits"""
    _fields_ = [("head", _Gemm), ("norm", _p), ("eps", ctypes.c_double), ("logits", _p)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.lm_layer_head.argtypes = [_p, _p, ctypes.c_int]
    lib.lm_layer_tail.argtypes = [_p, _p, _p, _p]
    lib.lm_layers_run.argtypes = [_p, _p, _i64, _p, _p]
    lib.lm_layer_head.restype = lib.lm_layer_tail.restype = lib.lm_layers_run.restype = ctypes.c_int


# no -march=native: this file only sequences calls (the maths is in the pointed-to builds)
_KERNEL = native.Kernel(pathlib.Path(__file__).with_name("llama_layer.c"), ("-O2",), False, _declare)
enabled = True  # tests and bench/one_batch.py's A/B switch the fused path off
WHOLE_STEP = True  # lm_layers_run where it applies (tests compare it with the per-layer calls)
# Steps of more rows run layer by layer even without a dense crossover: what the fused path saves
# is per-call overhead, which long prefills do not notice, and its buffers are kept (<= 64 rows:
# ~2 MB for SmolLM2-135M)
MAX_ROWS = 64


def available() -> bool:
    return (enabled and config.FUSED_LAYER and fused_ops.available() and decode_ops.available()
            and qgemm.available() and _KERNEL.lib() is not None)


def _addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _projections(layer) -> tuple:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _head_fusable(norm, head) -> bool:
    """Whether a whole step may end with the model's norm and logits head in C (lm_final): a
    QuantLinear on a C kernel, float32 norm weight and bias (its dense crossover is per step)."""
    if not (isinstance(head, QuantLinear) and head._c_kernel is not None):
        return False
    bias, w = head._buffers["bias"], norm.weight
    return ((bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and w.dtype == torch.float32 and w.is_contiguous() and w.device.type == "cpu")


def _fusable(model) -> bool:
    """Every projection a QuantLinear on a C kernel, every norm weight float32 (checked once)."""
    for layer in model.layers:
        if not all(isinstance(m, QuantLinear) and m._c_kernel is not None for m in _projections(layer)):
            return False
        biases = [m.bias for m in _projections(layer) if m.bias is not None]
        if not all(b.dtype == torch.float32 and b.is_contiguous() for b in biases):
            return False
        if not layer.input_layernorm.eps == layer.post_attention_layernorm.eps == model.layers[0].input_layernorm.eps:
            return False  # the C context holds one eps
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if not all(w.dtype == torch.float32 and w.is_contiguous() and w.device.type == "cpu" for w in norms):
            return False
    return len(model.layers) > 0


class FusedLayers:
    """One model's bound C layer structs and activation buffers."""

    def __init__(self, model):
        c = model.config
        self.layer_list, self.layers = model.layers, list(model.layers)
        self.H, self.KV, self.D = c.num_heads, c.num_kv_heads, c.head_dim
        self.hidden, self.I = c.hidden_size, c.intermediate_size
        # steps of at most MAX_ROWS rows run fused, when their kernel choice is under this (_bind:
        # the least dense_rows of the projections; plan)
        self.dense_rows = MAX_ROWS + 1
        lib = _KERNEL.lib()
        self.head, self.tail, self.run_all = lib.lm_layer_head, lib.lm_layer_tail, lib.lm_layers_run
        self.attn = _Attn()  # the step's attention arguments when lm_layers_run makes the calls
        self.attn_ptr = ctypes.addressof(self.attn)
        self.ctx = _Ctx(norm=fused_ops.c_function_address("lm_add_rms_norm"),
                        rope_kv=_addr(decode_ops._KERNEL.lib().lm_rope_kv),
                        silu_mul=fused_ops.c_function_address("lm_silu_mul"),
                        hidden=self.hidden, H=self.H, KV=self.KV, D=self.D, I=self.I,
                        eps=self.layers[0].input_layernorm.eps)
        self.ctx_ptr = ctypes.addressof(self.ctx)
        self.capacity, self.bufs = 0, {}
        self.lock = threading.Lock()  # one step at a time uses the buffers (forwards do not overlap today)
        self.structs: List[_Layer] = []
        self.pool, self.dicts, self.keys = None, [], []
        self.held: list = []  # the objects whose pointers the structs hold (identity-checked per forward)
        self.checked = -1  # _registrations[0] when `held` last matched the model (bound's fast path)
        # the bound lm_final and (norm, head, _registrations[0], whether they fuse) it was bound for
        self.final, self.final_of = _Final(), None
        self.final_ptr = ctypes.addressof(self.final)
        _watch_registrations()

    # -- binding --
    def _slots_of(self, pool) -> tuple:
        """(dicts, keys): where each object the structs point into lives (a module's _buffers or
        _parameters, the pool's __dict__); `_bound` compares those entries by identity."""
        dicts, keys = [pool.__dict__, pool.__dict__], ["k", "v"]
        for i, layer in enumerate(self.layers):
            # the modules themselves too: a replaced layer, projection or norm rebinds
            for mod, names in ((self.layer_list, (str(i),)), (layer, ("input_layernorm", "post_attention_layernorm")),
                               (layer.self_attn, ("qkv_proj", "o_proj")), (layer.mlp, ("gate_up_proj", "down_proj"))):
                dicts += [mod._modules] * len(names)
                keys += names
            for m in _projections(layer):
                scales = "scales" if m.fmt == "int8" else ("scale_mins" if m._c_kernel == "int4x8" else "scale_zeros")
                for key in ("qweight", scales, "bias"):
                    dicts.append(m._buffers)
                    keys.append(key)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                dicts.append(norm._parameters)
                keys.append("weight")
        return dicts, keys

    def _bind(self, pool) -> None:
        self.layers = list(self.layer_list)
        self.dense_rows = min([MAX_ROWS + 1] + [m.dense_rows for layer in self.layers for m in _projections(layer)
                                                if m.dense_rows is not None])
        self.structs = []
        for i, layer in enumerate(self.layers):
            s = _Layer(in_norm=layer.input_layernorm.weight.data_ptr(),
                       post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                       k_cache=pool.k[i].data_ptr(), v_cache=pool.v[i].data_ptr())
            for name, m in zip(("qkv", "o", "gate_up", "down"), _projections(layer)):
                _, _, _, fn, K, N, q_ptr, s_ptr = m._bind_c()
                bias = m._buffers["bias"]  # float32 contiguous or None (_fusable)
                setattr(s, name, _Gemm(fn=_addr(fn), status=int(m._c_kernel.endswith("x8")), K=K, N=N,
                                       q=q_ptr, s=s_ptr, bias=0 if bias is None else bias.data_ptr()))
            self.structs.append(s)
        self.ptrs = [ctypes.addressof(s) for s in self.structs]
        self.ptr_array = (ctypes.c_void_p * len(self.ptrs))(*self.ptrs)
        self.ctx.kv_bf16 = int(pool.k.dtype == torch.bfloat16)
        self.pool, (self.dicts, self.keys) = pool, self._slots_of(pool)
        self.held = list(map(operator.getitem, self.dicts, self.keys))
        self.checked = _registrations[0]

    def bound(self, pool) -> bool:
        """Whether every module and tensor the structs point into is still the object bound (the
        check QuantLinear makes per call): with no registration since the last check, only the
        pool's K / V (replaced by release / allocate, which registers nothing); else ~630
        identity tests, run in C by map."""
        if pool is not self.pool or len(self.layer_list) != len(self.layers):
            return False
        held = self.held
        if pool.k is not held[0] or pool.v is not held[1]:
            return False
        seen = _registrations[0]
        if seen == self.checked:
            return True
        if not all(map(operator.is_, map(operator.getitem, self.dicts, self.keys), held)):
            return False
        self.checked = seen
        return True

    def rebind(self, model, pool) -> bool:
        """Bind the model's current layers and pool; False (nothing bound) when they no longer fuse."""
        if not _fusable(model):
            return False
        self._bind(pool)
        return True

    def _final_ptr(self, norm, head, T: int) -> Optional[int]:
        """lm_final's address for the model's norm and logits head at T rows, or None where they
        do not run in C; bound (and their fusability decided) again only after a registration."""
        fo = self.final_of
        if fo is None or fo[0] is not norm or fo[1] is not head or fo[2] != _registrations[0]:
            fo = self.final_of = (norm, head, _registrations[0], _head_fusable(norm, head))
            if fo[3]:
                _, _, _, fn, K, N, q_ptr, s_ptr = head._bind_c()
                bias = head._buffers["bias"]
                self.final.head = _Gemm(fn=_addr(fn), status=int(head._c_kernel.endswith("x8")), K=K, N=N,
                                        q=q_ptr, s=s_ptr, bias=0 if bias is None else bias.data_ptr())
                self.final.norm, self.final.eps = norm.weight.data_ptr(), norm.eps
        if not fo[3] or (head.dense_rows is not None and choice_rows(T) >= head.dense_rows):
            return None
        return self.final_ptr

    def _reserve(self, T: int) -> None:
        """Activation buffers for T rows (grown to the largest T seen; rows [:T] used)."""
        if T <= self.capacity:
            return
        cap = max(T, 2 * self.capacity)
        qkv = (self.H + 2 * self.KV) * self.D
        widths = dict(res=self.hidden, x=self.hidden, h=self.hidden, o=self.hidden, qkv=qkv,
                      q=self.H * self.D, gu=2 * self.I, act=self.I)
        self.bufs = {k: torch.empty(cap, w, dtype=torch.float32) for k, w in widths.items()}
        for k, t in self.bufs.items():
            setattr(self.ctx, k, t.data_ptr())
        self.bufs["attn"] = torch.empty(cap, self.H * self.D, dtype=torch.float32)  # decode_attend's output
        self.capacity = cap

    # -- the step --
    def run(self, x: torch.Tensor, fb, backend, rope_table: torch.Tensor, final=None):
        """x [T, hidden] float32 (the embeddings) -> (last layer's mlp out, residual, None)
        [T, hidden] each, views of this object's buffers, valid until the next call. `final`:
        (the model's norm, its logits head) where every row wants logits: when the step runs in
        one C call and they run in C (`_final_ptr`), that call makes them too -> (None, None,
        logits [T, vocab] float32), the bits the model's norm and head give."""
        with self.lock:
            return self._run(x, fb, backend, rope_table, final)

    def _run(self, x: torch.Tensor, fb, backend, rope_table: torch.Tensor, final=None):
        T, pool = x.shape[0], backend.kv_pool
        assert pool is self.pool, "plan() binds the pool the step uses"
        self._reserve(T)
        pos, slots = fb.positions.contiguous(), fb.out_cache_loc.contiguous()  # int64 [T]; kept alive here
        ctx = self.ctx
        ctx.T, ctx.nthreads, ctx.table, ctx.P = T, torch.get_num_threads(), rope_table.data_ptr(), rope_table.shape[0]
        ctx.pos, ctx.slots, ctx.num_slots = pos.data_ptr(), slots.data_ptr(), pool.k.shape[1]
        b = self.bufs
        # the embeddings become layer 0's residual: a plain memory copy, so no in-place torch op
        # touches the buffers (made under inference mode or not, they work in and out of it)
        x = x.contiguous()
        ctypes.memmove(ctx.res, x.data_ptr(), 4 * x.numel())
        q = b["q"][:T].view(T, self.H, self.D)
        gate, ptrs, n = pool.load_gate, self.ptrs, len(self.ptrs)
        attend = backend.decode_attend(q, b["attn"][:T].view(T, self.H, self.D))  # one C call a layer, or None
        if attend is not None and gate is None and WHOLE_STEP:  # the whole step in one C call
            a, args = self.attn, attend.c_args
            a.fn = _addr(attend.c_fn)
            (a.q, _, _, a.kv_bf16, a.prefix, a.P, a.table, a.ld, a.rows, a.seq_lens, a.B, a.H, a.KV, a.D, a.scale,
             a.chunk, a.nthreads, a.scratch, a.out) = args
            logits = None
            f_ptr = None if final is None else self._final_ptr(*final, T)
            if f_ptr is not None:
                logits = torch.empty(T, self.final.head.N, dtype=torch.float32)
                self.final.logits = logits.data_ptr()
            _check(self.run_all(self.ctx_ptr, self.ptr_array, n, self.attn_ptr, f_ptr))
            return (None, None, logits) if logits is not None else (b["x"][:T], b["res"][:T], None)
        if gate is not None:  # HiCache's layer-wise load-backs: layer i copied before its KV is written
            gate.wait(0)
        _check(self.head(self.ctx_ptr, ptrs[0], 1))
        for i in range(n):
            if attend is not None:
                attend(i)
                out = b["attn"][:T]
            else:
                out = backend.forward(q, None, None, i, fb, save_kv_cache=False)  # [T, H * D]
                if out.dtype != torch.float32 or not out.is_contiguous():
                    out = out.float().contiguous()
            nxt = ptrs[i + 1] if i + 1 < n else None
            if nxt is not None and gate is not None:
                gate.wait(i + 1)
            _check(self.tail(self.ctx_ptr, ptrs[i], out.data_ptr(), nxt))
        return b["x"][:T], b["res"][:T], None


def _check(rc: int) -> None:
    """llama_layer.c's status: -1 no memory for a matmul's scratch, -2 an index out of range."""
    if rc == -2:
        raise IndexError("llama_layer.c: a position outside the rope table or a KV slot outside the pool")
    if rc:
        raise MemoryError("llama_layer.c: no memory for a matmul's activation scratch")


def plan(model, T: int) -> Optional[FusedLayers]:
    """The model's FusedLayers when a T-row step may run fused (see the module docstring), else None."""
    if not available():
        return None
    fused = getattr(model, "_fused_layers", None)  # False: the model's layers are not all fusable
    if fused is None:
        fused = model._fused_layers = FusedLayers(model) if _fusable(model) else False
    if fused is False:
        return None
    pool = model.attn_backend.kv_pool
    if not fused.bound(pool) and not fused.rebind(model, pool):
        model._fused_layers = False
        return None
    # (under quant.decode_rows the projections' choice follows the request count: a verify
    # step of up to MAX_ROWS rows runs fused where its requests' decode would)
    return fused if T <= MAX_ROWS and choice_rows(T) < fused.dense_rows else None
