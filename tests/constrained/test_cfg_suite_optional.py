"""JSON-Schema-Test-Suite's optional tests at token level (tests/data/json-schema-test-suite):
the asserted `format`s against draft 7's optional format tests (where `format` asserts), and
draft 2020-12's other optional tests (ECMA-262 regexes, big numbers, draft-07 `dependencies`,
`$id`s inside unknown keywords, ...). No invalid instance is accepted, and a valid one is
refused only in the documented narrowings (docs/constrained.md, "Liveness"): an IDNA
A-label (`xn--`) in a hostname, a leap second written with a non-zero offset, an integer
written with an exponent."""
import json
import pathlib

import pytest

from lmprog_runtime.constrained import create_grammar_backend
from lmprog_runtime.constrained.base import GrammarBackendConfig

from test_cfg_engine import accepts

SUITE = pathlib.Path(__file__).resolve().parents[1] / "data" / "json-schema-test-suite"
FOLDER = SUITE / "draft7-optional-format"
OPTIONAL = SUITE / "draft2020-12-optional"


def _narrowed(fmt: str, data: str) -> bool:
    if fmt == "hostname":
        return any(label[:4].lower() == "xn--" for label in data.split("."))
    if fmt in ("time", "date-time"):
        return ":60" in data and not data.endswith(("Z", "z", "+00:00", "-00:00"))
    return False


@pytest.fixture(scope="module")
def cfg(tokenizer):
    remotes = (("http://localhost:1234/", str(SUITE / "remotes")),)
    be = create_grammar_backend("cfg", tokenizer, vocab_size=49152 + 64, eos_token_ids=[tokenizer.eos_token_id],
                                config=GrammarBackendConfig(schema_remotes=remotes))
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


@pytest.mark.parametrize("path", sorted(OPTIONAL.glob("*.json")), ids=lambda p: p.stem)
def test_optional_cases_accept_no_invalid_instance(cfg, tokenizer, path):
    accepted_invalid, refused_valid, n = [], [], 0
    for group in json.loads(path.read_text()):
        for t in group["tests"]:
            n += 1
            got = accepts(cfg, tokenizer, group["schema"], json.dumps(t["data"], ensure_ascii=False))
            if got and not t["valid"]:
                accepted_invalid.append(t["data"])
            elif t["valid"] and not got and "e+" not in json.dumps(t["data"]):  # (integers: no exponent)
                refused_valid.append(t["data"])
    assert n >= 1
    assert not accepted_invalid, f"{path.stem}: invalid instances accepted: {accepted_invalid}"
    assert not refused_valid, f"{path.stem}: valid instances refused: {refused_valid}"
