"""The cfg engine's per-token modules as C extensions built by Cython from their own .py
files (nothing in them is Cython-specific: the Python source is the one source), used where
built, the .py files elsewhere.

A mask that is not a memo hit runs a few hundred small Python calls (derivations, replays,
checks at the walk's stops: docs/constrained.md, "Where the suite's time is"); compiled, the
interpreter's dispatch and frames around them are gone: masks 10-17% faster on both corpora
of bench_grammar.py (docs/benchmarks.md).

`build()` cythonizes MODULES into CACHE_DIR/cfg-compiled, one extension per module named by
the module and a hash of its source, the directives and Cython's version (and the Python ABI:
the extension suffix). `install()` (the package's __init__) puts a finder first on
sys.meta_path that loads a module from its extension only when one was built from the
module's current source: an edited module is imported from its .py until it is built again,
never stale. `make` builds what is missing (`main()`);
without Cython or a C compiler nothing is built and every module stays Python.
LMPROG_CFG_PURE=1 imports them all from their .py (A/B, debugging).
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import pathlib
import shutil
import sys
import tempfile
from typing import List, Optional

PACKAGE = "lmprog_runtime.constrained.cfg"
SOURCE_DIR = pathlib.Path(__file__).parent
# the modules a mask runs through (the compile's schema.py / warmup.py / refs.py stay Python)
MODULES = ("backend", "canonical", "classtable", "keycloses", "lexrows", "machine", "mask", "nodes", "predicates",
           "regex", "residual", "strings", "table", "unique", "untrack")
# Python semantics kept: annotations are not C types, no type inference (Cython would type
# a loop over a bytes literal as C chars), functions bound like Python's (monkeypatching,
# introspection)
DIRECTIVES = {"language_level": 3, "binding": True, "infer_types": False, "annotation_typing": False}
KEEP_OTHER = 3  # builds of a module's other sources kept in the cache (the most recently used: `prune`)
CFLAGS = ("-O2", "-g0")  # (after the interpreter's own -O3 -g: a build of all of them ~2x faster)


def cache_dir() -> pathlib.Path:
    from lmprog_runtime.config import CACHE_DIR
    return pathlib.Path(CACHE_DIR) / "cfg-compiled"


def built_path(module: str, cython_version: str, source: Optional[bytes] = None) -> pathlib.Path:
    """Where the extension built from `source` (default: `module`'s current source) is (or
    would be)."""
    if source is None:
        source = (SOURCE_DIR / f"{module}.py").read_bytes()
    key = source + repr((sorted(DIRECTIVES.items()), CFLAGS, cython_version)).encode()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / f"{module}-{hashlib.sha256(key).hexdigest()[:16]}{suffix}"


def _built(module: str) -> Optional[pathlib.Path]:
    """The extension of `module`'s current source, None where none was built. The Cython
    version it was built with is recorded beside the extensions (`_version_file`), so that a
    server without Cython installed still finds them."""
    version = _recorded_version()
    if version is None:
        return None
    path = built_path(module, version)
    return path if path.is_file() else None


def _version_file() -> pathlib.Path:
    """Where the Cython version of this Python's builds is recorded (one per ABI: venvs of
    other Pythons, with other Cythons, share the cache)."""
    abi = importlib.machinery.EXTENSION_SUFFIXES[0].rsplit(".", 1)[0]  # (".cpython-311-x86_64-linux-gnu")
    return cache_dir() / f"cython-version{abi}"


def _recorded_version() -> Optional[str]:
    try:
        return _version_file().read_text().strip() or None
    except OSError:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    """Finds MODULES' up-to-date extensions (the .py files' own finder handles the rest)."""

    def find_spec(self, name, path, target=None):
        head, _, module = name.rpartition(".")
        if head != PACKAGE or module not in MODULES:
            return None
        try:
            so = _built(module)
        except OSError:
            return None
        if so is None:
            return None
        return importlib.util.spec_from_file_location(
            name, so, loader=importlib.machinery.ExtensionFileLoader(name, str(so)))


_FINDER = _Finder()


def install() -> None:
    """Import MODULES from their extensions where built (idempotent; LMPROG_CFG_PURE: never)."""
    from lmprog_runtime.config import CFG_PURE
    if CFG_PURE or _FINDER in sys.meta_path:
        return
    sys.meta_path.insert(0, _FINDER)


def compiled_modules() -> List[str]:
    """The MODULES imported from an extension in this process (bench reports, tests)."""
    out = []
    for m in MODULES:
        mod = sys.modules.get(f"{PACKAGE}.{m}")
        if mod is not None and not str(getattr(mod, "__file__", "")).endswith(".py"):
            out.append(m)
    return out


def build(jobs: int = 0, modules=MODULES) -> List[str]:
    """Builds the extensions of `modules` not built from their current source yet; returns
    those built. Raises RuntimeError where Cython or the C compiler fails (ImportError where
    Cython is not installed). A set-up step (`main`), not for a serving process: it changes
    the working directory while Cython runs."""
    import Cython
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    version = Cython.__version__
    sources = {m: (SOURCE_DIR / f"{m}.py").read_bytes() for m in modules}  # (read once: the file built is the one named)
    final = {m: built_path(m, version, sources[m]) for m in modules}
    todo = [m for m in modules if not final[m].is_file()]
    for m in modules:
        if m not in todo:
            prune(m, final[m])
    if not todo:
        _record_version(version)
        return []
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cfg-compiled-") as tmp:
        src = pathlib.Path(tmp, *PACKAGE.split("."))
        src.mkdir(parents=True)
        for m in todo:  # (a copy: the generated C and objects stay out of the source tree)
            (src / f"{m}.py").write_bytes(sources[m])
        exts = [Extension(f"{PACKAGE}.{m}", [str(src / f"{m}.py")], extra_compile_args=list(CFLAGS)) for m in todo]
        cwd = os.getcwd()
        os.chdir(tmp)  # (Cython names the module by its path below the working directory)
        try:
            exts = cythonize(exts, compiler_directives=DIRECTIVES, quiet=True)
            cmd = build_ext(Distribution({"ext_modules": exts}))
            cmd.build_lib, cmd.build_temp = str(pathlib.Path(tmp, "lib")), str(pathlib.Path(tmp, "obj"))
            cmd.parallel = jobs or os.cpu_count() or 1
            cmd.ensure_finalized()
            cmd.run()
        except (SystemExit, Exception) as exc:  # (Cython's and the compiler's failures, whatever their kind)
            raise RuntimeError(f"building the cfg extensions failed: {type(exc).__name__}: {exc}") from None
        finally:
            os.chdir(cwd)
        for m in todo:
            made = pathlib.Path(cmd.get_ext_fullpath(f"{PACKAGE}.{m}"))
            tmp_final = final[m].with_name(final[m].name + ".tmp")
            shutil.copyfile(made, tmp_final)
            os.replace(tmp_final, final[m])  # (atomic: a concurrent import sees a whole file or none)
            prune(m, final[m])
    _record_version(version)
    return todo


def prune(module: str, current: pathlib.Path) -> List[pathlib.Path]:
    """Marks `module`'s extension `current` as just used (its modification time: each `make`
    of a checkout touches its own builds) and deletes its builds of other sources past the
    KEEP_OTHER most recently used (other checkouts sharing the cache rebuild theirs, at
    worst); returns those deleted. Without it every edit of a module left its ~0.3 MB build
    behind for good."""
    try:
        os.utime(current)
    except OSError:
        return []
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    others = []
    for path in current.parent.glob(f"{module}-*{suffix}"):
        if path != current:  # (`regex-*` is not regex_parse's: no module name holds a hyphen)
            try:
                others.append((path.stat().st_mtime, path))
            except OSError:
                continue
    others.sort(reverse=True)
    gone = []
    for _, path in others[KEEP_OTHER:]:
        try:
            path.unlink()
            gone.append(path)
        except OSError:  # (another process pruned it first)
            continue
    return gone


def _record_version(version: str) -> None:
    path = _version_file()
    if _recorded_version() != version:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(version)
        os.replace(tmp, path)


def main() -> int:
    """Builds what is missing (`make`), best effort: without Cython or a compiler the engine
    stays Python, and this says so."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # (not the compiler command lines)
    try:
        made = build()
    except ImportError:
        print("cfg-compiled: Cython is not installed: the grammar engine runs as Python")
        return 0
    except (RuntimeError, OSError) as exc:
        print(f"cfg-compiled: not built ({exc}): the grammar engine runs as Python")
        return 0
    print(f"cfg-compiled: built {', '.join(made)}" if made else "cfg-compiled: up to date")
    return 0
