import os

import pytest


@pytest.fixture(autouse=True)
def _real_kernels_only():
    """GPU tests must run compiled kernels: skip them where TRITON_INTERPRET=1 is set
    (the interpreter tests set it only in their own subprocess)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: run `pytest tests/gpu` on its own")
