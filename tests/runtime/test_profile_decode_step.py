"""bench/profile_decode_step.py on the embedded model: its manual timers see the fused layer's C
calls and the attention kernel (it once crashed on the one-call fused step, whose attention
arguments it had wrapped in Python)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the real SmolLM2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_profile_decode_step_times_the_fused_step(tmp_path):
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_decode_step.py"), "--quick",
                    "--cached", "64", "--results-dir", str(tmp_path)], check=True, cwd=ROOT, timeout=600,
                   capture_output=True)
    (out,) = tmp_path.glob("profile_decode_step_*.json")
    result = json.loads(out.read_text())
    timed = result["timed_ms"]
    assert timed["step_ms"] > 0
    assert timed.get("attention kernel", 0) > 0
    if "quant='int" in result["formats"]:  # quantized layers run fused (llama_layer.py)
        assert timed.get("fused layer C calls (projections, norms, rope, K/V write)", 0) > 0
