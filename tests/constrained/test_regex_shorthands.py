"""`\\d`, `\\w`, `\\s` mean ASCII classes in constraints (the index's engine reads them as Unicode)."""

import re

import pytest

from lmprog_runtime.constrained.regex_fragments import ascii_shorthands


@pytest.mark.parametrize("regex, expected", [
    (r"\d+", r"[0-9]+"),
    (r"[\d.]+", r"[0-9.]+"),
    (r"[^\d]", r"[^0-9]"),
    (r"\D", r"[^0-9]"),
    (r"\w\s", r"[0-9A-Za-z_][ \t\n\r\f\v]"),
    (r"\\d", r"\\d"),  # an escaped backslash followed by d is left alone
    (r"[]\d]", r"[]0-9]"),
    (r"a\.b\d", r"a\.b[0-9]"),
])
def test_rewrite(regex, expected):
    assert ascii_shorthands(regex) == expected
    re.compile(ascii_shorthands(regex))


def test_unicode_digits_are_not_allowed(tokenizer):
    from lmprog_runtime.constrained import create_grammar_backend

    backend = create_grammar_backend("outlines", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = backend.get_future("regex", r"\d{3}").result(timeout=120)
    import torch
    mask = torch.zeros(len(tokenizer), dtype=torch.bool)
    grammar.fill_mask(mask)
    allowed = [tokenizer.decode([t]) for t in mask.nonzero().view(-1).tolist()]
    assert allowed and all(re.fullmatch(r"[0-9]{1,3}", text) for text in allowed), allowed[:20]
