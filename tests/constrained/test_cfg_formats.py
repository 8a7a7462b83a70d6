"""The asserted `format`s against JSON-Schema-Test-Suite's optional format tests (draft 7,
where `format` asserts; tests/data/json-schema-test-suite/draft7-optional-format): at token
level no invalid string is accepted, and a valid one is refused only in the documented
narrowings (docs/constrained.md, "Liveness"): an IDNA A-label (`xn--`) in a hostname, a leap
second written with a non-zero offset."""
import json
import pathlib

import pytest

from lmprog_runtime.constrained import create_grammar_backend

from test_cfg_engine import accepts

FOLDER = pathlib.Path(__file__).resolve().parents[1] / "data" / "json-schema-test-suite" / "draft7-optional-format"


def _narrowed(fmt: str, data: str) -> bool:
    if fmt == "hostname":
        return any(label[:4].lower() == "xn--" for label in data.split("."))
    if fmt in ("time", "date-time"):
        return ":60" in data and not data.endswith(("Z", "z", "+00:00", "-00:00"))
    return False


@pytest.fixture(scope="module")
def cfg(tokenizer):
    be = create_grammar_backend("cfg", tokenizer, vocab_size=49152 + 64, eos_token_ids=[tokenizer.eos_token_id])
    yield be
    be.shutdown()


@pytest.mark.parametrize("path", sorted(FOLDER.glob("*.json")), ids=lambda p: p.stem)
def test_formats_accept_no_invalid_string(cfg, tokenizer, path):
    accepted_invalid, refused_valid, n = [], [], 0
    for group in json.loads(path.read_text()):
        schema = {k: v for k, v in group["schema"].items() if k != "$schema"}  # (no `$schema`: formats assert)
        for t in group["tests"]:
            if not isinstance(t["data"], str):
                continue
            n += 1
            got = accepts(cfg, tokenizer, schema, json.dumps(t["data"], ensure_ascii=False))
            if got and not t["valid"]:
                accepted_invalid.append(t["data"])
            elif t["valid"] and not got and not _narrowed(path.stem, t["data"]):
                refused_valid.append(t["data"])
    assert n >= 10
    assert not accepted_invalid, f"{path.stem}: invalid strings accepted: {accepted_invalid}"
    assert not refused_valid, f"{path.stem}: valid strings refused: {refused_valid}"
