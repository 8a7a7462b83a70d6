"""Shipped named grammars compile and accept their examples."""
import json
import re

import pytest

import grammars
from lmprog_runtime.constrained.json_schema import build_regex_from_schema

EXAMPLES = {
    "json": ['{"a":[1,{"b":null}]}', "3", '"s"'],
    "integer": ["-12", "0"], "number": ["1.5e3", "-0.25"], "boolean": ["true"],
    "email": ["jo.doe@example.com"], "iso_date": ["2024-02-29"],
    "iso_datetime": ["2024-02-29T12:30:00Z", "2024-02-29T12:30:00.5+02:00"],
    "uuid": ["123e4567-e89b-12d3-a456-426614174000"], "phone_us": ["(415) 555-0132", "+1 415-555-0132"],
    "tool_call": ['{"name":"get_weather","arguments":{"city":"Paris","days":3}}'],
}


def test_names_cover_required_set():
    assert set(EXAMPLES) <= set(grammars.names())
    with pytest.raises(KeyError, match="unknown grammar"):
        grammars.get("nope")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_grammar_accepts_examples(name):
    kind, spec = grammars.get(name)
    rx = build_regex_from_schema(json.loads(spec)) if kind == "json" else spec
    for text in EXAMPLES[name]:
        assert re.fullmatch(rx, text), (name, text)
