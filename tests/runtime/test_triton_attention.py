"""The Triton kernels in Triton's CPU interpreter (triton_interpreter_cases.py), run in a
pytest process of their own: TRITON_INTERPRET=1 must be set before triton is imported,
and only there, so the rest of the suite (and the GPU tests) see compiled kernels."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_triton_kernels_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (pip install 'triton>=3.0')")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           os.path.join(HERE, "triton_interpreter_cases.py")]
    proc = subprocess.run(cmd, env=env, cwd=os.path.dirname(os.path.dirname(HERE)),
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
