"""`python -m llama_cpp.server`, optionally without llama.cpp's extra weight buffer types.

    python bench/baselines/llama_cpp_server.py [--no-extra-bufts] --model <gguf> --port 8001 ...

Every other flag goes to `llama_cpp.server` unchanged. `--no-extra-bufts` sets the
model parameter `use_extra_bufts = False`, which llama-cpp-python does not expose: on
CPUs with AMX, llama.cpp repacks Q4_1 weights into its AMX buffer type and then crashes
in `ggml_backend_amx_mul_mat` (segfault on the first decode; llama.cpp issue #20824).
Without extra buffer types it runs its ordinary AVX-512 CPU kernels (and no CPU repack
either). A build without AMX (`CMAKE_ARGS="-DGGML_AMX_INT8=OFF" pip install
--force-reinstall --no-deps 'llama-cpp-python[server]'`) avoids the crash and keeps repacking.
"""

from __future__ import annotations

import runpy
import sys


def disable_extra_buffer_types() -> None:
    import llama_cpp.llama_cpp as native  # `Llama` reads the defaults through this module

    default_params = native.llama_model_default_params

    def params():
        p = default_params()
        p.use_extra_bufts = False
        return p

    native.llama_model_default_params = params


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--no-extra-bufts" in argv:
        argv.remove("--no-extra-bufts")
        disable_extra_buffer_types()
    sys.argv = ["llama_cpp.server"] + argv
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
