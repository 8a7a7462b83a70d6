"""Differential fuzzing against jsonschema (bench/fuzz_grammar.py) at a fixed seed: mutated
schemas and instances of the first 100 schemas of both corpora, and a decode per schema
sampling each token from the mask; no invalid instance accepted or sampled, no mask offering
a token the matcher refuses, nothing raised (~7-10 s each; the whole corpora: `bench/fuzz_grammar.py`)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("corpus", ["suite", "dev"])
def test_fuzzed_schemas_and_instances_agree_with_jsonschema(tmp_path, corpus):
    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fuzz_grammar.py"), "--corpus", corpus, "--seed", "7",
                           "--schema-mutations", "1", "--instance-mutations", "2", "--limit", "100", "--sampled", "1",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.exists(), proc.stderr[-2000:]
    report = json.loads(out.read_text())
    serious = [f for f in report["findings"] if f["class"] in ("accepts_invalid", "mask_not_matcher", "crash")]
    assert report["counts"].get("instances", 0) > 1000 and report["counts"].get("sampled", 0) > 60
    assert not serious, json.dumps(serious[:5], ensure_ascii=False)[:3000]
    assert proc.returncode == 0
