"""Draft trees (--speculative-eagle-topk > 1) through the Engine on the tiny model.

- Planted trees: a draft source that knows the plain greedy outputs proposes trees whose
  every level has a wrong sibling beside the right token (wrong first at even depths), so
  accepted paths leave the tree's first nodes and their KV must be moved in order. Outputs
  must be token-identical to plain greedy decoding (page sizes 1 and 16, cache on / off),
  with logprobs, and the audit holds.
- NGRAM trees with sampling: 400 seeded requests sharing one trie (their sampled outputs
  give the trie several continuations, so the trees branch); per output position a
  two-sample chi-square against plain sampling at alpha = 1e-3 (as the chain test).
"""

import pytest

from engine_helpers import make_engine
from lmprog_runtime.speculative.base import Draft, DraftSource
from test_speculative_standalone import assert_same_token_distributions

PROMPTS = [
    "The cat sat on the mat. The cat sat on the",
    "1 2 3 4 5 6 7 8 1 2 3",
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "List three colors:",
]
GREEDY = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
BASE = dict(max_total_tokens=4096)
TREE = dict(speculative_algorithm="NGRAM", speculative_disable_cost_rule=True, speculative_eagle_topk=2, speculative_num_draft_tokens=9)


class PlantedTrees(DraftSource):
    """Trees of two children per level: the reference's next token and a wrong one."""

    def __init__(self, refs: dict, vocab: int):
        self.refs = refs  # prompt ids tuple -> plain greedy output ids
        self.vocab = vocab
        self.proposed = 0

    def propose(self, reqs, budgets, prefixes=None):
        out = []
        for r, k in zip(reqs, budgets):
            truth = self.refs[tuple(r.origin_input_ids)][len(r.output_ids):]
            tokens, parents, parent = [], [], -1
            for d, t in enumerate(truth):
                if len(tokens) + 2 > k:
                    break
                wrong = (t + 1 + d) % self.vocab
                pair = [(wrong, False), (t, True)] if d % 2 == 0 else [(t, True), (wrong, False)]
                right = -1
                for tok, ok in pair:
                    tokens.append(tok)
                    parents.append(parent)
                    if ok:
                        right = len(tokens) - 1
                parent = right
            self.proposed += bool(tokens)
            out.append(Draft(tokens, parents) if tokens else None)
        return out


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    eng = make_engine(tiny_model_path, **BASE)
    try:
        outs = eng.generate(PROMPTS, GREEDY, return_logprob=True, top_logprobs_num=2,
                            return_prompt_token_ids=True)
    finally:
        eng.shutdown()
    return outs


@pytest.mark.parametrize("extra", [dict(), dict(page_size=16), dict(disable_radix_cache=True)],
                         ids=["page1", "page16", "nocache"])
def test_planted_trees_are_token_identical(tiny_model_path, reference, extra):
    eng = make_engine(tiny_model_path, **BASE, **TREE, **extra)
    try:
        refs = {tuple(o["prompt_token_ids"]): o["output_ids"] for o in reference}
        source = PlantedTrees(refs, eng.scheduler.runner.model_config.vocab_size)
        eng.scheduler.speculator.source = source
        outs = eng.generate(PROMPTS, GREEDY, return_logprob=True, top_logprobs_num=2)
        for ref, out in zip(reference, outs):
            assert out["output_ids"] == ref["output_ids"]
            for a, b in zip(ref["meta_info"]["output_token_logprobs"], out["meta_info"]["output_token_logprobs"]):
                assert a[1] == b[1] and abs(a[0] - b[0]) < 1e-4, (a, b)
        eng.check_integrity()
        state = eng.get_internal_state()
        assert source.proposed > 0 and state["spec_num_tree_moves"] > 0, state
        assert state["avg_spec_accept_length"] > 2.0, state  # the right branch is always there
    finally:
        eng.shutdown()


def test_tree_sampling_matches_plain_distribution(tiny_model_path):
    n, positions = 400, 4
    prompt = ["1 2 3 1 2 3 1 2 3 1 2"] * n
    params = [{"temperature": 1.0, "top_k": 3, "max_new_tokens": positions, "ignore_eos": True,
               "sampling_seed": i} for i in range(n)]
    plain = make_engine(tiny_model_path, **BASE)
    try:
        ref = plain.generate(prompt, params)
    finally:
        plain.shutdown()
    eng = make_engine(tiny_model_path, **BASE, speculative_algorithm="NGRAM", speculative_disable_cost_rule=True, speculative_eagle_topk=3,
                      speculative_num_draft_tokens=8)
    try:
        outs = eng.generate(prompt, params)
        state = eng.get_internal_state()
        eng.check_integrity()
    finally:
        eng.shutdown()
    assert state["spec_num_accepted_tokens"] > 0 and state["spec_num_verify"] > 0, state
    assert_same_token_distributions(ref, outs, positions)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decodes_beside_verifies_use_the_kernel(page_size):
    """torch_native, a batch where two requests verify (a tree, a chain) and three decode:
    the decodes go through the paged-decode kernel apart (`_init_ones`), and every output
    matches the all-gathered path's."""
    import torch

    from lmprog_runtime.attention import create_attention_backend, paged_decode
    from lmprog_runtime.speculative.tree import extend_mask
    from paged_attention_cases import make_batch
    if not paged_decode.available():
        pytest.skip("no C compiler for the paged-decode kernel")
    extend = [5, 1, 3, 1, 1]
    pool_a, pool_b, fb, g = make_batch([9, 30, 17, 40, 3], extend, 2, 16, torch.float32, page_size, seed=5)
    fb.tree_masks = [extend_mask([-1, -1, 0, 1], lead=1), None, None, None, None]
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=16)
    split = create_attention_backend("torch_native", token_to_kv_pool=pool_a, **kw)
    gathered = create_attention_backend("torch_native", token_to_kv_pool=pool_b, **kw)
    split.init_forward_metadata(fb)
    gathered._init_ones = lambda *a: None
    gathered.init_forward_metadata(fb)
    assert split.ones is not None and gathered.ones is None
    T = fb.num_tokens
    q, k, v = (torch.randn(T, h, 16, generator=g) for h in (4, 2, 2))
    a, b = split.forward(q, k, v, 0, fb), gathered.forward(q, k, v, 0, fb)
    assert (a - b).abs().max().item() < 1e-5
