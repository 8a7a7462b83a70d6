"""Sampler.plain_argmax, the greedy rows' shortcut: the token the full pipeline picks, or None
wherever the pipeline would change a row before its argmax."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmprog_runtime.model_executor.sampler import Sampler
from lmprog_runtime.sampling_params import SamplingParams

VOCAB, PADDED = 300, 320  # the logits carry padded vocab columns, as a model's head may


def req(output_ids=(), **params):
    return SimpleNamespace(sampling=SamplingParams(**params), output_ids=list(output_ids), generator=None)


def logits_with_ties(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (rows, PADDED), generator=g).float()  # many equal maxima per row
    x[:, VOCAB:] = 100.0  # padding beyond the vocab must never win
    return x


def test_plain_argmax_is_the_pipelines_greedy_token():
    sampler = Sampler(VOCAB, eos_token_ids=[2])
    x = logits_with_ties(6)
    rows = [5, 0, 3]
    reqs = [req(temperature=0), req([7, 7], temperature=0), req(temperature=0, ignore_eos=True)]
    fast = sampler.plain_argmax(x, rows, reqs)
    full = sampler(x[rows], reqs).token_ids
    assert fast == full
    assert all(t < VOCAB for t in fast)


@pytest.mark.parametrize("r", [
    req(temperature=0.7),                                   # sampled
    req(temperature=0, logit_bias={"4": 2.0}),              # biased
    req([1, 2], temperature=0, repetition_penalty=1.2),     # penalized
    req([1], temperature=0, frequency_penalty=0.5),
    req([1], temperature=0, presence_penalty=0.5),
    req([1], temperature=0, min_new_tokens=3),              # EOS still banned
    req([], temperature=0, min_new_tokens=1, ignore_eos=True, stop_token_ids=[9]),
])
def test_plain_argmax_declines_rows_the_pipeline_edits(r):
    sampler = Sampler(VOCAB, eos_token_ids=[2])
    assert sampler.plain_argmax(logits_with_ties(2), [0, 1], [req(temperature=0), r]) is None


def test_plain_argmax_keeps_rows_whose_edits_do_not_apply_yet_or_any_more():
    """A penalty with nothing generated yet, and a min_new_tokens ban already served, leave
    the row as it is: the shortcut applies and agrees."""
    sampler = Sampler(VOCAB, eos_token_ids=[2])
    x = logits_with_ties(2)
    reqs = [req([], temperature=0, repetition_penalty=1.3), req([1, 2, 3], temperature=0, min_new_tokens=2)]
    assert sampler.plain_argmax(x, [0, 1], reqs) == sampler(x.clone(), reqs).token_ids


def test_plain_argmax_only_for_float32_cpu_logits():
    sampler = Sampler(VOCAB, eos_token_ids=[2])
    assert sampler.plain_argmax(logits_with_ties(1).bfloat16(), [0], [req(temperature=0)]) is None


def test_plain_argmax_with_a_grammar_mask_is_the_pipelines_greedy_token():
    """A grammar mask (narrower than the vocabulary too: columns past it banned) is the only
    edit: the shortcut takes the maximum over the allowed columns, the same first index."""
    sampler = Sampler(VOCAB, eos_token_ids=[2])
    x = logits_with_ties(6)
    rows = [5, 0, 3, 1]
    reqs = [req(temperature=0), req([7, 7], temperature=0), req(temperature=0, ignore_eos=True), req(temperature=0)]
    g = torch.Generator().manual_seed(1)
    for width, density in ((VOCAB, 0.3), (VOCAB - 20, 0.3), (VOCAB, 0.97), (VOCAB - 20, 0.97)):
        # sparse masks ban most rows' first maximum; dense ones allow it (the in-place path)
        mask = torch.rand((len(rows), width), generator=g) < density
        mask[3] = False
        mask[3, [7, 11, 250]] = True  # a few allowed tokens, the rest of the row's maxima banned
        fast = sampler.plain_argmax(x, rows, reqs, mask)
        assert fast == sampler(x[rows], reqs, mask).token_ids
        assert all(mask[i, t] for i, t in enumerate(fast))
    bad = [mask.float(), mask[:2], torch.ones((len(rows), PADDED), dtype=torch.bool)]  # dtype, rows, width
    assert all(sampler.plain_argmax(x, rows, reqs, m) is None for m in bad)
    assert sampler.plain_argmax(x, rows, reqs[:3] + [req(temperature=0.5)], mask) is None


def pack(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, V'] -> MaskBuilder's int32 bitmask [B, ceil(V' / 32)] (bit j of word w = token 32w + j)."""
    bits = np.zeros((mask.shape[0], -(-mask.shape[1] // 32) * 32), dtype=np.bool_)
    bits[:, :mask.shape[1]] = mask.numpy()
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())


def test_a_bitmask_is_the_same_mask_as_its_bool_rows():
    """MaskBuilder's int32 bitmask gives the pipeline's and the shortcut's tokens the bool
    rows give (narrower than the vocabulary and padded past it: those columns banned), and
    logits equal to the last bit where the full pipeline applies it on the CPU."""
    sampler = Sampler(VOCAB, eos_token_ids=[2])
    x = logits_with_ties(6)
    rows = [5, 0, 3, 1]
    reqs = [req(temperature=0), req([7, 7], temperature=0), req(temperature=0, ignore_eos=True), req(temperature=0)]
    g = torch.Generator().manual_seed(2)
    for width, density in ((VOCAB, 0.3), (VOCAB - 20, 0.3), (VOCAB - 7, 0.97), (VOCAB, 0.97)):
        mask = torch.rand((len(rows), width), generator=g) < density
        mask[3] = False
        mask[3, [7, 11, 250]] = True
        words = pack(mask)
        assert words.shape[1] * 32 >= width
        fast = sampler.plain_argmax(x, rows, reqs, words)
        assert fast == sampler.plain_argmax(x, rows, reqs, mask) == sampler(x[rows], reqs, words).token_ids
        assert all(mask[i, t] for i, t in enumerate(fast))
        a, b = x[rows].clone(), x[rows].clone()
        Sampler._apply_grammar_mask(a, mask)
        Sampler._apply_grammar_mask(b, words)
        assert torch.equal(a, b)
    padded = torch.full((len(rows), -(-PADDED // 32)), -1, dtype=torch.int32)  # all set, past the vocab too
    assert sampler.plain_argmax(x, rows, reqs, padded) == sampler(x[rows].clone(), reqs).token_ids
    sampled = [req(temperature=0.8) for _ in rows]
    assert all(mask[i, t] for i, t in enumerate(sampler(x[rows].clone(), sampled, words).token_ids))
