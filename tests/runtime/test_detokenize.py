"""IncrementalDetokenizer gives the text of a full decode (minus an incomplete trailing
character), token by token, on SmolLM2's tokenizer: multi-byte characters split across
tokens, special tokens, rewrites of the tail."""

import random

import pytest

from lmprog_runtime.detokenize import IncrementalDetokenizer
from tiny_model import smollm2_tokenizer

TEXTS = ["Hello, world! Ünïcödé — 日本語のテキスト 🎉🎉 and emoji 👩‍👩‍👧 done.",
         "def f(x):\n    return x ** 2  # ∑ √ ∞\n\n\tend",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nПривет, мир!"]


def full(tok, ids, **kw):
    return tok.decode(ids, **kw).rstrip("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_matches_full_decode_token_by_token(skip):
    tok = smollm2_tokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        for n in range(1, len(ids) + 1):
            assert d.update(ids[:n]) == full(tok, ids[:n], skip_special_tokens=skip), (text, n)
        assert d.text == tok.decode(ids, skip_special_tokens=skip)


def test_random_tokens_and_rewrites():
    tok = smollm2_tokenizer()
    rng = random.Random(0)
    ids = []
    d = IncrementalDetokenizer(tok)
    for step in range(600):
        if step % 97 == 96:  # a jump-forward rewrites the tail
            keep = max(0, len(ids) - rng.randint(1, 5))
            d.rewind(keep)
            ids = ids[:keep]
        ids.append(rng.randrange(len(tok)))
        assert d.update(ids) == full(tok, ids), step


def test_decodes_only_a_window_per_update():
    tok = smollm2_tokenizer()
    seen = []

    class Counting:
        def decode(self, ids, **kw):
            seen.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode("word " * 400)
    d = IncrementalDetokenizer(Counting())
    for n in range(1, len(ids) + 1):
        d.update(ids[:n])
    assert max(seen) <= 8  # never the whole output
