"""The step's mask as SGLang's int32 bitmask: every backend's `write_bitmask` is its bool mask
packed (bit j of word w = token 32w + j), with the vocabulary padded past the tokenizer's
too, and MaskBuilder's rows (unconstrained, dead end, failed grammar) read as the bool ones
did."""
import importlib.util
import json
from types import SimpleNamespace

import numpy as np
import pytest

from lmprog_runtime.constrained import create_grammar_backend
from lmprog_runtime.scheduler.grammar_mask import DEAD_END, MaskBuilder

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": -3, "maximum": 300},
    "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3}},
    "required": ["name"], "additionalProperties": False}
UNIQUE = dict(SCHEMA, properties=dict(SCHEMA["properties"], tags={"type": "array", "uniqueItems": True}))
DOCS = ['{"name":"Ann","n":-2,"tags":["a","bc"]}', '{"name":"x y","n":300,"tags":[]}']
BACKENDS = ["cfg", "outlines"] + [n for n in ("xgrammar", "llguidance") if importlib.util.find_spec(n)]


def packed(row: np.ndarray, words: int) -> np.ndarray:
    bits = np.zeros(words * 32, dtype=np.bool_)
    bits[:row.shape[0]] = row
    return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("pad", [0, 40])
def test_write_bitmask_is_the_bool_mask_packed(tokenizer, name, pad):
    vocab = len(tokenizer) + pad
    be = create_grammar_backend(name, tokenizer, vocab, [tokenizer.eos_token_id])
    words = -(-vocab // 32)
    try:
        g0 = be.get_future("json", json.dumps(UNIQUE if name == "cfg" else SCHEMA)).result(timeout=120)
        for doc in DOCS:
            g = g0.copy()
            row = np.zeros(vocab, dtype=np.bool_)
            out = np.full(words, 0x5A5A5A5A, dtype=np.int32)  # (overwritten, whatever it held)
            steps = 0
            for t in tokenizer.encode(doc, add_special_tokens=False) + [tokenizer.eos_token_id]:
                g.write_mask(row)
                g.write_bitmask(out)
                got = np.unpackbits(out.view(np.uint8), bitorder="little")[:vocab].view(np.bool_)
                assert np.array_equal(got, row), (name, doc, steps)
                if not pad:
                    assert np.array_equal(out, packed(row, words))
                assert row[t]
                g.accept_token(t)
                steps += 1
            assert steps > 10
    finally:
        be.shutdown()


def reqs_of(*grammars):
    out = []
    for i, g in enumerate(grammars):
        r = SimpleNamespace(rid=f"r{i}", grammar=g, finished=False, output_ids=[1, 2], kv_suspect=False,
                            reason=None)

        def finish(reason, r=r):
            r.finished, r.reason = True, reason
        r.finish = finish
        out.append(r)
    return out


class Fixed:
    """A grammar whose mask is the given bool row (or raises)."""

    def __init__(self, row=None, error=None):
        self.row, self.error = row, error

    def is_terminated(self):
        return False

    def write_bitmask(self, words):
        if self.error:
            raise self.error
        words.view(np.uint8)[:] = np.packbits(np.resize(self.row, words.shape[0] * 32), bitorder="little")


@pytest.mark.parametrize("vocab", [320, 300])
def test_mask_builder_rows(vocab):
    """Bits past the vocabulary are cleared (a row of only those is a dead end: its request
    fails with a 400 and the row allows everything, as a failed grammar's does); rows
    without a grammar allow everything."""
    stats = {"mask_s": 0.0, "mask_rows": 0}
    mb = MaskBuilder(vocab, stats)
    some = np.zeros(vocab, dtype=np.bool_)
    some[[3, vocab - 1]] = True
    past = np.zeros(-(-vocab // 32) * 32, dtype=np.bool_)
    past[vocab:] = True  # (only tokens past the vocabulary)
    reqs = reqs_of(Fixed(some), None, Fixed(past), Fixed(error=RuntimeError("boom")))
    mask = mb.build(reqs)
    assert mask.shape == (4, -(-vocab // 32)) and str(mask.dtype) == "torch.int32"
    bits = np.unpackbits(mask.numpy().view(np.uint8).reshape(4, -1), axis=1, bitorder="little").view(np.bool_)
    assert np.flatnonzero(bits[0]).tolist() == [3, vocab - 1]
    assert bits[1].all() and bits[2].all() and bits[3].all()
    assert not reqs[0].finished and not reqs[1].finished
    assert reqs[2].finished and reqs[2].reason.status_code == 400 and DEAD_END in reqs[2].reason.message
    assert reqs[3].finished and reqs[3].reason.status_code == 500
    assert stats["mask_rows"] == 3
    assert mb.build(reqs_of(None, None)) is None


VALUES = {"type": "object", "properties": {
    "long": {"type": "string", "maxLength": 300},          # counters clamped far from the bound: one mask
    "short": {"type": "string", "maxLength": 5, "minLength": 2},
    "least": {"type": "string", "minLength": 30},
    "free": {"type": "string"},
    "items": {"type": "array", "items": {"type": "string", "maxLength": 12}},
    "checked": {"not": {"type": "string", "maxLength": 3}}}}  # (a pending check below: the generic path)
# keys of an open object (no enum: any text), bounded by propertyNames, with a pattern property
KEYS = dict(VALUES, propertyNames={"maxLength": 9}, patternProperties={"^x-": {"type": "integer"}})
VALUE_DOCS = ['{"long":"%s","short":"abcd","least":"%s","free":"a b c","items":["x","hello world!"],'
              '"checked":"abcdef"}' % ("word " * 40, "ab" * 20),
              '{"items":["","a"],"free":"","short":"ab","long":"","x-tag":3,"other":"y","shortest":1}']


# numbers: free, bounded (texts by class), past a minimum, under a check, in a uniqueItems array, exponents
NUMBERS = {"type": "object", "properties": {
    "free": {"type": "number"}, "int": {"type": "integer"}, "pct": {"type": "number", "minimum": 0, "maximum": 100},
    "least": {"type": "integer", "minimum": 10}, "odd": {"not": {"type": "number", "multipleOf": 2}},
    "set": {"type": "array", "uniqueItems": True, "items": {"type": "number"}}, "any": {}}}
NUMBER_DOCS = ['{"free":-12.5e3,"int":123456,"pct":99.25,"least":1234,"odd":12345,"set":[1,2.5,31],"any":[7,8e-2]}',
               '{"pct":100,"free":0.001,"int":-7,"least":10,"set":[],"any":5}']


@pytest.mark.parametrize("schema,docs", [(VALUES, VALUE_DOCS), (KEYS, VALUE_DOCS), (NUMBERS, NUMBER_DOCS)])
@pytest.mark.parametrize("pad", [0, 40])
def test_masks_written_from_their_parts(tokenizer, pad, schema, docs):
    """cfg writes a value string's body mask from its parts (MaskEngine._value_mask: the walked
    part by rule and stack below, the counters' tokens, the plain tokens), a key's from its
    fast key made in place (`_key_mask`) and a number's from its canonical state's memo entry
    (`_number_memo`); each is the mask `mask_packed` makes, at every count or text, bounded or
    not, twice over (memoized) and under a check."""
    vocab = len(tokenizer) + pad
    be = create_grammar_backend("cfg", tokenizer, vocab, [tokenizer.eos_token_id])
    words = -(-vocab // 32)
    try:
        g0 = be.get_future("json", json.dumps(schema)).result(timeout=120)
        for doc in docs * 2:
            g = g0.copy()
            row = np.zeros(vocab, dtype=np.bool_)
            out = np.full(words, 0x5A5A5A5A, dtype=np.int32)
            for t in tokenizer.encode(doc, add_special_tokens=False) + [tokenizer.eos_token_id]:
                g.write_bitmask(out)
                g.write_mask(row)
                got = np.unpackbits(out.view(np.uint8), bitorder="little")[:vocab].view(np.bool_)
                assert np.array_equal(got, row), (doc, g._hist)
                assert not np.unpackbits(out.view(np.uint8), bitorder="little")[vocab:].any()
                assert row[t]
                g.accept_token(t)
        engine = g0._shared.engine
        assert engine._values or engine._plain_stacks  # (the path was taken)
    finally:
        be.shutdown()


def test_a_numbers_memo_key_is_its_canonical_state(tokenizer):
    """_number_memo looks a number's mask up under (its canonical frame, the stack below as it
    is) where that stack holds no check or uniqueItems items seen: there that is the whole
    state's canonical form, the key `_masked` stores under (elsewhere it declines)."""
    from lmprog_runtime.constrained.cfg.canonical import canonical, number_top
    be = create_grammar_backend("cfg", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        g0 = be.get_future("json", json.dumps(NUMBERS)).result(timeout=120)
        engine = g0._shared.engine
        free = engine.vocab.exponent_free
        seen = {True: 0, False: 0}
        for doc in NUMBER_DOCS:
            g = g0.copy()
            for t in tokenizer.encode(doc, add_special_tokens=False):
                state = g.state
                if len(state) == 1 and state[0][0][0] == "N":
                    top, rest = state[0]
                    engine._number_memo(top, rest)
                    plain = engine._plain_stacks[id(rest)][1]
                    seen[plain] += 1
                    if plain:
                        assert canonical(state, exponent_free=free) == ((number_top(top, free), rest),)
                g.accept_token(t)
        assert seen[True] > 10 and seen[False] > 3  # (both kinds of stack met)
    finally:
        be.shutdown()
