"""Jump-forward: forced strings from the byte DFA and canonical re-tokenization."""
import json

import pytest

from lmprog_runtime.constrained import create_grammar_backend, jump_forward_retokenize
from lmprog_runtime.constrained.index import ByteDFA

SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string"}, "kind": {"enum": ["alpha", "beta"]}, "ok": {"type": "boolean"}},
    "required": ["name", "kind", "ok"], "additionalProperties": False})


@pytest.fixture(scope="module")
def compact_backend(tokenizer):
    be = create_grammar_backend("outlines", tokenizer, 49152, [tokenizer.eos_token_id], whitespace_pattern="")
    yield be
    be.shutdown()


def test_byte_dfa_forced_strings():
    a = ByteDFA(r'\{"name":"[a-z]+","kind":(?:"alpha"|"beta"|"\u00e9t\u00e9")\}')
    assert a.forced_bytes(a.initial) == b'{"name":"'
    s = a.walk(a.initial, b'{"name":"x')
    assert a.forced_bytes(s) == b""
    s = a.walk(a.initial, b'{"name":"x"')
    assert a.forced_bytes(s) == b',"kind":"'
    s = a.walk(a.initial, b'{"name":"x","kind":"b')
    assert a.forced_bytes(s) == b'eta"}'
    s = a.walk(a.initial, b'{"name":"x","kind":"\xc3')  # inside "é": the rest is forced bytes
    assert a.forced_bytes(s) == "\u00e9t\u00e9\"}".encode()[1:]
    assert a.walk(a.initial, b"nope") == a.dead
    s = a.walk(a.initial, b'{"name":"x","kind":"alpha"}')
    assert s in a.finals and a.forced_bytes(s) == b""


def run_jumps(backend, tokenizer, g, steps):
    """Alternate: generate `text` token by token, then jump forward + retokenize."""
    out: list[int] = []
    for text in steps:
        for t in tokenizer.encode(text, add_special_tokens=False):
            g.accept_token(t)
            out.append(t)
        jump = g.jump_forward_str()
        if jump:
            keep, new = jump_forward_retokenize(tokenizer, out, jump)
            assert tokenizer.decode(out[:keep] + new) == tokenizer.decode(out) + jump
            g.jump_and_retokenize(out, new, keep)  # raises if the token path were illegal
            out = out[:keep] + new
    return out


def test_jump_and_retokenize_is_legal_and_canonical(compact_backend, tokenizer):
    g = compact_backend.get_future("json", SCHEMA).result(timeout=120)
    assert g.jump_forward_str() == '{"name":"'
    out = run_jumps(compact_backend, tokenizer, g, ["", 'Bob"', "a", "true"])
    text = tokenizer.decode(out)
    assert text == '{"name":"Bob","kind":"alpha","ok":true}'
    assert g.is_terminated()
    assert out == tokenizer.encode(text, add_special_tokens=False)


def test_jump_forward_with_flexible_whitespace(backend, tokenizer):
    g = backend.get_future("json", SCHEMA).result(timeout=120)
    assert g.jump_forward_str() == "{"  # whitespace may follow: the jump stops there
    out = run_jumps(backend, tokenizer, g, ["", ' "', ': "x"', ', "kind": "b'])
    assert tokenizer.decode(out) == '{ "name": "x", "kind": "beta"'
    assert tokenizer.decode(out) == tokenizer.decode(tokenizer.encode(tokenizer.decode(out)))


def test_retokenize_keeps_common_prefix(tokenizer):
    ids = tokenizer.encode('{"name": "Al', add_special_tokens=False)
    keep, new = jump_forward_retokenize(tokenizer, ids, 'ice"', prompt_tail_ids=tokenizer.encode("Answer: "))
    assert tokenizer.decode(ids[:keep] + new) == '{"name": "Alice"'
    assert keep < len(ids) or new


def test_no_jump_inside_multibyte_character(compact_backend, tokenizer):
    g = compact_backend.get_future("regex", "\u00e9abc").result(timeout=120)
    first = compact_backend.table.index("\u00e9".encode()[:1]) if "\u00e9".encode()[:1] in compact_backend.table else None
    if first is None:
        pytest.skip("no single-byte token for the lead byte")
    g.accept_token(first)
    assert g.jump_forward_str() is None


class _CountingTokenizer:
    """Counts the token ids and characters a retokenization touches."""

    def __init__(self, tok):
        self.tok, self.decoded, self.encoded = tok, 0, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)

    def encode(self, text, **kw):
        self.encoded += len(text)
        return self.tok.encode(text, **kw)


@pytest.mark.parametrize("jump", ['", "kind": "', '"}', "lice", ' 1234', "\u00e9t\u00e9\"", "\n  "])
def test_windowed_retokenize_matches_whole_output(tokenizer, jump):
    """The window changes nothing: same result as re-tokenizing the whole output, at a
    cost that does not grow with the output."""
    body = '{"notes": "' + " ".join(f"item{i} = {i * 7}, ok;" for i in range(300)) + ' and A'
    ids = tokenizer.encode(body, add_special_tokens=False)
    whole = jump_forward_retokenize(tokenizer, ids, jump, window=len(ids))
    counting = _CountingTokenizer(tokenizer)
    windowed = jump_forward_retokenize(counting, ids, jump)
    assert windowed == whole
    keep, new = windowed
    assert tokenizer.decode(ids[:keep] + new) == body + jump
    assert len(ids) > 1000 and counting.decoded <= 32 and counting.encoded <= 200
