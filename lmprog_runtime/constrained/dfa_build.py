"""Building a regex's byte DFA tables, in this process or in a compile worker process
whose memory is capped and which is killed past the time budget.

`build_tables(regex)` is the pure builder (numpy + outlines-core only, no torch, so this
file also runs as the worker script). `IsolatedBuilder.build(regex, timeout_s, memory_mb)`
runs it in a worker (`python dfa_build.py`, one per compile thread): the worker sets
RLIMIT_DATA to `memory_mb` before each build; a build that runs out of memory (MemoryError
or the allocator aborting the worker) or past `timeout_s` (the worker is killed) raises
`BudgetExceeded` naming the limit. Protocol: length-prefixed pickles over stdin/stdout.
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from functools import lru_cache
from typing import Optional

import numpy as np
import outlines_core

SENTINEL = 0x02
SENTINEL_RE = r"\x02"
_HEADER = struct.Struct("<Q")


class BudgetExceeded(RuntimeError):
    """A build over the memory or time budget; the message names the limit."""


@lru_cache(maxsize=1)
def _byte_vocabulary() -> "outlines_core.Vocabulary":
    """One token per byte value (ids 0..255, EOS 256): the index over it is the byte DFA."""
    return outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def build_tables(regex: str) -> dict:
    """The DFA of `regex` over bytes: states 0..n-1 (initial 0, dead n), byte classes, the
    class-compressed transition table [ (n + 1) * n_classes ] int32, the final states."""
    # The builder also determinizes an unanchored start (".*?R"), which can blow up
    # (an open JSON object: 27 s and GBs). A sentinel byte first keeps that copy
    # the size of the anchored one; matching starts after the sentinel.
    index = outlines_core.Index(SENTINEL_RE + "(?:" + regex + ")", _byte_vocabulary())
    edges = index.get_transitions()
    finals = set(index.get_final_states())
    start = edges.get(index.get_initial_state(), {}).get(SENTINEL)
    if start is None:
        raise ValueError("the regex matches no string")
    ids = {start: 0}
    for s in sorted(set(edges) | finals | {t for e in edges.values() for t in e.values()}):
        ids.setdefault(s, len(ids))
    n_states = len(ids)
    trans = np.full((n_states + 1, 256), n_states, dtype=np.int32)
    src, byte, dst = [], [], []
    for s, e in edges.items():
        for b, t in e.items():
            if b < 256:
                src.append(ids[s])
                byte.append(b)
                dst.append(ids[t])
    trans[src, byte] = dst
    # bytes no state tells apart share a column: the table shrinks ~256/n_classes times
    _, first, classes = np.unique(trans.T, axis=0, return_index=True, return_inverse=True)
    return {"n_states": n_states, "byte_class": classes.reshape(-1).astype(np.uint8),
            "trans": np.ascontiguousarray(trans[:, first]).reshape(-1), "n_classes": len(first),
            "finals": frozenset(ids[s] for s in finals)}


# -- the worker side ---------------------------------------------------------------------------
def _serve() -> None:
    import resource

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    while True:
        head = inp.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return  # the parent went away
        regex, memory_mb = pickle.loads(inp.read(_HEADER.unpack(head)[0]))
        limit = memory_mb * 1024 * 1024 if memory_mb > 0 else hard
        resource.setrlimit(resource.RLIMIT_DATA, (min(limit, hard) if hard != resource.RLIM_INFINITY else limit, hard))
        try:
            reply = ("ok", build_tables(regex))
        except MemoryError:
            reply = ("memory", "")
        except Exception as exc:  # noqa: BLE001 - reported to the parent as a compile error
            reply = ("error", f"{type(exc).__name__}: {exc}")
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()


# -- the parent side ---------------------------------------------------------------------------
class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def _read(self, n: int, deadline: float) -> Optional[bytes]:
        """n bytes from the worker, or None on EOF; TimeoutError past `deadline`."""
        fd, buf = self.proc.stdout.fileno(), bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def call(self, regex: str, timeout_s: float, memory_mb: int):
        data = pickle.dumps((regex, memory_mb))
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        head = self._read(_HEADER.size, deadline)
        body = None if head is None else self._read(_HEADER.unpack(head)[0], deadline)
        return None if body is None else pickle.loads(body)


class IsolatedBuilder:
    """One compile worker per calling thread, started on first use, replaced after a kill."""

    def __init__(self):
        self._local = threading.local()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()

    def _worker(self) -> _Worker:
        w = getattr(self._local, "worker", None)
        if w is None or not w.alive():
            w = self._local.worker = _Worker()
            with self._lock:
                self._all.append(w)
        return w

    def build(self, regex: str, timeout_s: float, memory_mb: int) -> dict:
        w = self._worker()
        try:
            reply = w.call(regex, timeout_s, memory_mb)
        except TimeoutError:
            w.kill()
            raise BudgetExceeded(f"compile timed out after {timeout_s:g} s (the compile budget, "
                                 "LMPROG_GRAMMAR_COMPILE_TIMEOUT); the compile was killed") from None
        except (BrokenPipeError, OSError):
            reply = None
        if reply is None or reply[0] == "memory":
            w.kill()
            raise BudgetExceeded(f"the compile needed more than {memory_mb} MiB (the compile budget, "
                                 "LMPROG_GRAMMAR_COMPILE_MEMORY_MB); the compile was stopped")
        if reply[0] == "error":
            raise ValueError(reply[1])
        return reply[1]

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, []
        for w in workers:
            w.kill()


if __name__ == "__main__":
    _serve()
