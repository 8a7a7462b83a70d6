import os

import pytest


@pytest.fixture(autouse=True)
def _real_kernels_only():
    """tests/runtime/test_triton_attention.py turns on Triton's interpreter for its whole process;
    GPU tests must run compiled kernels, so run them in their own process (bench/gpu_check.sh does)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: run `pytest tests/gpu` on its own")
