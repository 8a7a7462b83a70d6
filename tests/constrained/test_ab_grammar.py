"""bench/ab_grammar.py runs both variants of each mechanism over the same instances: the
same masks are timed on either side (a variant changes speed, never a mask)."""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("variant", ["bind", "first-states"])
def test_ab_grammar_times_the_same_masks_under_both_variants(variant, tmp_path):
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "ab_grammar.py"), "--variant", variant, "--corpus", "suite",
                    "--limit", "12", "--out", str(out)], check=True, capture_output=True, timeout=300)
    got = json.loads(out.read_text())
    assert got["old"]["masks"] == got["new"]["masks"] > 50
    assert got["schemas"] >= 10 and got["mask_time_ratio"] > 0
