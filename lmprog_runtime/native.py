"""Small C kernels compiled with the system C compiler at first use, like Triton's launcher.

`build(source, flags, cpu_specific)` compiles `source` into CACHE_DIR/kernels once per
(source and the headers it includes, flags[, CPU flags]) and loads it; it returns None where
that is impossible (no compiler, a failed build, or LMPROG_NO_C_KERNELS set), and callers keep
their pure-torch or numpy path. Concurrent builders all end with a whole file (atomic rename).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import threading
from typing import Callable, Optional, Sequence

logger = logging.getLogger(__name__)

# -march=native kernels: -ffast-math minus finite-math (kernels may use -inf), so reductions vectorize.
NATIVE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                "-fassociative-math", "-fno-signed-zeros")


def cpu_key() -> str:
    """This CPU's feature flags (kernels built with -march=native are valid only where built)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


INCLUDE_DIR = pathlib.Path(__file__).parent  # shared headers (native_pool.h): #include "name.h"
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def local_headers(source: pathlib.Path) -> bytes:
    """The bytes of the headers `source` includes with quotes (next to it or in INCLUDE_DIR),
    so that an edit to a shared header rebuilds every kernel including it."""
    out = b""
    for name in _INCLUDE.findall(source.read_bytes()):
        for d in (source.parent, INCLUDE_DIR):
            path = d / name.decode()
            if path.is_file():
                out += path.read_bytes()
                break
    return out


def build(source: pathlib.Path, flags: Sequence[str], cpu_specific: bool,
          loader: Callable[[str], ctypes.CDLL] = ctypes.CDLL) -> Optional[ctypes.CDLL]:
    """`loader`: how the library is opened (ctypes.PyDLL for one that calls the C API: its
    calls hold the GIL)."""
    from lmprog_runtime.config import C_COMPILER, CACHE_DIR, NO_C_KERNELS

    if NO_C_KERNELS:
        return None
    key = source.read_bytes() + local_headers(source) + repr(list(flags)).encode() + (
        cpu_key().encode() if cpu_specific else b"")
    out = pathlib.Path(CACHE_DIR) / "kernels" / f"{source.stem}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not out.exists():
        cc = C_COMPILER or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if cc is None:
            logger.warning("no C compiler: %s is not built, a slower path is used", source.name)
            return None
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            argv = [cc, *flags, f"-I{INCLUDE_DIR}", "-shared", "-fPIC", "-o", tmp, str(source), "-lm"]
            subprocess.run(argv, check=True, capture_output=True, timeout=120)
            os.replace(tmp, out)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")[:300]
            logger.warning("building %s failed (%s %s): a slower path is used", source.name, exc, detail)
            pathlib.Path(tmp).unlink(missing_ok=True)
            return None
    return loader(str(out))


class Kernel:
    """A C kernel built and loaded on first use: `lib()` is the loaded library, or None where
    it cannot be built. `declare(lib)` sets the functions' ctypes signatures once."""

    def __init__(self, source: pathlib.Path, flags: Sequence[str], cpu_specific: bool,
                 declare: Callable[[ctypes.CDLL], None], loader: Callable[[str], ctypes.CDLL] = ctypes.CDLL):
        self.source, self.flags, self.cpu_specific, self.declare = source, tuple(flags), cpu_specific, declare
        self.loader = loader
        self._lib: Optional[ctypes.CDLL] | bool = None
        self._lock = threading.Lock()

    def lib(self) -> Optional[ctypes.CDLL]:
        if self._lib is not None:  # loaded (or failed) once: no lock on the per-call path
            return self._lib or None
        with self._lock:
            if self._lib is None:
                lib = build(self.source, self.flags, self.cpu_specific, self.loader)
                if lib is not None:
                    self.declare(lib)
                self._lib = lib or False
        return self._lib or None
