"""The grammar tables' states kept out of the cyclic garbage collector's view.

A full (generation 2) collection visits every tracked object of the process, and the
engine's interned matcher states are most of them once grammars have been used: ~3,200
tracked tuples and frozensets per dev-corpus grammar, ~560k after its 252 (the process held
214k before: torch, the tokenizer), and one full collection took 0.36-0.42 s there, a pause
that lands wherever an allocation triggers it, a mask included (docs/constrained.md,
"Stop 54"). CPython untracks a tuple itself only when everything in it is untracked data;
a state's frames hold `Node`s and key-set frozensets, so its tuples stay tracked for good.

A state is immutable: its tuples and frozensets hold nodes, strings, numbers and one
another, never a container that could hold them back, so no reference cycle runs through
them and reference counting alone frees them (their nodes stay alive while they do: an
untracked object's references count as outside ones, never as garbage). `untrack` takes a
state's tuples and frozensets, the ones still tracked, off the collector's lists
(`PyObject_GC_UnTrack`, CPython's C API) where a table interns the state; elsewhere (no
CPython API) it does nothing, and only collections are slower.

The walk is untrack.c's, one call per state, where the C compiler and the interpreter's
headers are there (a kernel like table_walk.c, opened with ctypes.PyDLL: the GIL held); the
Python walk below, a ctypes call per tuple, stays the path without them. Per state untracked:
0.45 µs in C, 1.2 µs in Python (compiled by Cython; 7,917 dev-corpus states made anew),
with ~1.2 calls per suite mask, ~0.8 per dev mask and ~180k in the suite's compiles (stop 55).
"""
from __future__ import annotations

import ctypes
import gc
import sysconfig
import threading

from lmprog_runtime import native
from lmprog_runtime.constrained.cfg.compiled import SOURCE_DIR

try:
    _UNTRACK = ctypes.pythonapi.PyObject_GC_UnTrack
    _UNTRACK.argtypes = [ctypes.py_object]
    _UNTRACK.restype = None
except (AttributeError, OSError):  # (not CPython)
    _UNTRACK = None


def _declare(lib) -> None:
    lib.cfg_untrack.argtypes = [ctypes.py_object]
    lib.cfg_untrack.restype = None


_HEADERS = sysconfig.get_paths().get("include") or ""
# (not beside __file__: this module may be an extension elsewhere, compiled.py)
_KERNEL = native.Kernel(SOURCE_DIR / "untrack.c", ("-O2", f"-I{_HEADERS}"), False, _declare, ctypes.PyDLL)
_C: list = []  # [the C walk or None], once resolved
_RESOLVING = threading.Lock()


def _c_walk():
    """The C walk, built and loaded on the first call (None where it cannot be)."""
    with _RESOLVING:
        if not _C:
            lib = _KERNEL.lib() if _UNTRACK is not None and _HEADERS else None
            _C.append(lib.cfg_untrack if lib is not None else None)
    return _C[0]


def untrack(state) -> None:
    """Untrack the tuples and frozensets of `state` that are still tracked (stopping at those
    that are not: a shared stack below was untracked with the state that interned it)."""
    if _UNTRACK is None or not gc.is_tracked(state):
        return
    walk = _C[0] if _C else _c_walk()
    if walk is not None:
        walk(state)
        return
    stack = [state]
    tracked, off = gc.is_tracked, _UNTRACK
    while stack:
        x = stack.pop()
        if tracked(x):
            off(x)
            for y in x:
                t = type(y)
                if t is tuple or t is frozenset:
                    stack.append(y)
