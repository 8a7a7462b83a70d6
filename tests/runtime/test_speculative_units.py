"""Speculative decoding parts without a model: the flags, the n-gram trie, the adaptive
draft budget, greedy acceptance and the exactness of rejection sampling."""

import argparse
import math

import pytest
import torch

from lmprog_runtime.config import ServerArgs, add_cli_args, from_cli_namespace
from lmprog_runtime.speculative.config import resolve_speculative
from lmprog_runtime.speculative.ngram import NgramCorpus, NgramDraftSource
from lmprog_runtime.speculative.speculator import COOLDOWN_MAX, DraftBudget
from lmprog_runtime.speculative.tree import children, depths, extend_mask, keep_nodes, path_to
from lmprog_runtime.speculative.verify import (_accept_greedy, _accept_sampled, accept_tree_greedy,
                                               accept_tree_sampled)


# -- flags ------------------------------------------------------------------------------------
def test_flags_parse_and_resolve():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8",
                            "--speculative-ngram-max-trie-depth", "12"])
    args = from_cli_namespace(ns)
    spec = resolve_speculative(args)
    assert (spec.algorithm, spec.num_draft_tokens, spec.max_drafts, spec.ngram_max_trie_depth) == ("NGRAM", 8, 7, 12)
    assert resolve_speculative(ServerArgs()) is None
    assert resolve_speculative(ServerArgs(speculative_algorithm="NGRAM")).num_draft_tokens == 12
    standalone = resolve_speculative(ServerArgs(speculative_algorithm="STANDALONE",
                                                speculative_draft_model_path="x", speculative_num_steps=3))
    assert (standalone.num_steps, standalone.num_draft_tokens) == (3, 4)
    assert "NGRAM" in parser.format_help()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(speculative_algorithm="EAGLE"), "speculative_algorithm must be one of"),
    (dict(speculative_algorithm="STANDALONE"), "needs speculative_draft_model_path"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="m"), "only used with"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=9), "speculative_eagle_topk must be in [1, 8]"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="m", speculative_eagle_topk=2),
     "speculative_eagle_topk must be 1 with STANDALONE"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2, attention_backend="flashinfer"),
     "1 with attention_backend flashinfer"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=17), "in [2, 16]"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1), "in [2, 16]"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=8),
     "num_steps + 1 = 4"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_bfs_breadth=3,
          speculative_ngram_max_bfs_breadth=2), "at least speculative_ngram_min_bfs_breadth"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_match_type="DFS"), "ngram_match_type must be"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_max_trie_depth=1), "at least 2"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_capacity=10), "at least 1024"),
])
def test_bad_flags_fail_at_startup(kwargs, needle):
    with pytest.raises(ValueError) as e:
        ServerArgs(**kwargs)
    assert needle in str(e.value), str(e.value)


# -- n-gram trie ------------------------------------------------------------------------------
class _R:
    def __init__(self, rid, prompt, out=()):
        self.rid, self.origin_input_ids, self.output_ids = rid, list(prompt), list(out)


def test_ngram_drafts_the_continuation_of_a_seen_context():
    src = NgramDraftSource(max_depth=6, capacity=10_000)
    doc = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    r = _R("a", doc + [5, 12, 13])  # the tail "12 13" appeared in the document
    [d] = src.propose([r], [5])
    assert d.tokens == [14, 15, 16, 17, 18]  # continued past the trie's depth by re-matching
    [d] = src.propose([r], [2])
    assert d.tokens == [14, 15]


def test_ngram_prefers_frequent_and_longer_contexts():
    corpus = NgramCorpus(max_depth=4, capacity=10_000)
    from lmprog_runtime.speculative.ngram import _SeqState
    s = _SeqState(corpus.gen)
    corpus.feed(s, [1, 2, 3, 1, 2, 4, 1, 2, 4, 7, 2, 5])
    assert corpus.draft([9, 1, 2], 1) == [4]   # "1 2" → 4 twice, → 3 once
    assert corpus.draft([7, 2], 1) == [5]      # the longer context "7 2" beats "2" → 4
    assert corpus.draft([99, 98], 3) == []     # never seen: no draft
    assert corpus.draft([3, 2], 1) == []       # only "2" matches: too short a context


def test_ngram_chain_stops_where_the_corpus_has_seen_many_continuations():
    """After "1 2" the corpus saw 3 different values once each (a JSON key followed by the
    earlier requests' values): p = 1/3 < MIN_PATH_PROB, no row is drafted there; where one
    continuation dominates the chain goes on (p = 1 at every unbranched node)."""
    from lmprog_runtime.speculative.ngram import MIN_PATH_PROB, _SeqState
    corpus = NgramCorpus(max_depth=4, capacity=10_000)
    corpus.feed(_SeqState(corpus.gen), [1, 2, 30, 9, 1, 2, 31, 9, 1, 2, 32, 9, 5, 6, 7, 8])
    assert 1 / 3 < MIN_PATH_PROB <= 1 / 2
    assert corpus.draft([0, 1, 2], 3) == []
    assert corpus.draft([0, 5, 6], 3) == [7, 8]
    corpus.feed(_SeqState(corpus.gen), [1, 2, 32, 9])  # now 32 twice of four: p = 1/2
    assert corpus.draft([0, 1, 2], 2) == [32, 9]
    tokens, parents = corpus.draft_tree([0, 1, 2], 6, topk=3)  # trees: 30 and 31 (1/4 each) not drawn
    assert tokens[:2] == [32, 9] and parents[:2] == [-1, 0] and not {30, 31} & set(tokens)
    corpus.feed(_SeqState(corpus.gen), [1, 2, 33, 9, 1, 2, 34, 9])  # 32 is now 2 of 6: 1/3
    assert corpus.draft_tree([0, 1, 2], 6, topk=3) == ([], [])


def test_ngram_chain_probability_comes_from_a_short_context():
    """The deepest context matched is one earlier sequence (9 1 2 3 4 → 50, seen once: p = 1
    there), but after the last CONFIDENCE_CONTEXT tokens (1 2 3 4) three different tokens
    followed: p = 1/3, so the chain stops (each earlier request's own value after a JSON key)."""
    from lmprog_runtime.speculative.ngram import CONFIDENCE_CONTEXT, _SeqState
    assert CONFIDENCE_CONTEXT == 4
    corpus = NgramCorpus(max_depth=8, capacity=10_000)
    for lead, value in ((9, 50), (8, 51), (7, 52)):
        corpus.feed(_SeqState(corpus.gen), [lead, 1, 2, 3, 4, value, 60, 61])
    assert corpus.draft([9, 1, 2, 3, 4], 3) == []
    assert corpus.draft([9, 1, 2, 3, 4, 50], 2) == [60, 61]  # 50 → 60 always


def test_ngram_chain_may_start_from_the_last_token_alone():
    """No 2-token context matches: the last token alone drafts only where it has always been
    followed by the same token (discounted by SHORT_MATCH_PRIOR), e.g. a name from the prompt
    (40 41 = "Alice Martin") continued in a JSON value whose opening token (7) differs from
    the prompt's (3); a token seen before several different ones (3) does not draft."""
    from lmprog_runtime.speculative.ngram import MIN_PATH_PROB, SHORT_MATCH_PRIOR, _SeqState
    corpus = NgramCorpus(max_depth=4, capacity=10_000)
    corpus.feed(_SeqState(corpus.gen), [3, 40, 41, 50, 3, 60, 3, 61])
    assert SHORT_MATCH_PRIOR >= MIN_PATH_PROB
    assert corpus.draft([7, 40], 2) == [41, 50]  # 40 → 41 by the one token, then "40 41" → 50
    assert corpus.draft([7, 3], 2) == []          # 3 was followed by 40, 60 and 61


def test_ngram_chain_copies_the_requests_own_prompt():
    """Other records said "is 4 4" (30 4 → 4, twice); this request's record says "is 4 7":
    after its `: 4` (50 30 4, new to the trie) the trie's most frequent continuation is 4
    (2/3), its own prompt's 7 (copied so far whenever matched): a JSON extraction's digits.
    Where the trie matches longer (an earlier output went 50 51 30 4 → 4) the trie wins."""
    src = NgramDraftSource(max_depth=8, capacity=10_000)
    src.propose([_R("a", [9, 1, 30, 4, 4, 31, 30, 4, 4], [50, 51, 30, 4, 4, 52])], [1])
    b = _R("b", [9, 2, 30, 4, 7, 31], [50, 30, 4])
    assert src.propose([b], [1])[0].tokens == [7]
    assert src.propose([_R("c", [9, 2, 30, 4, 7, 31], [50, 51, 30, 4])], [1])[0].tokens == [4]


def test_prompt_index_defers_where_its_longest_matches_disagree():
    """A question quoting its document ("designed the bridge" → " with" in the document, "?"
    in the question): the prompt proposes nothing there, the trie's counts decide."""
    from lmprog_runtime.speculative.ngram import PromptIndex
    prompt = PromptIndex([5, 1, 2, 3, 9, 1, 2, 4, 8, 7, 2, 6])
    assert prompt.match([0, 1, 2], 8) == (-1, 0)  # "1 2" goes on with 3 and with 4
    assert prompt.match([5, 1, 2], 8) == (3, 3)   # "5 1 2" only once: → 3
    assert prompt.match([0, 7, 2], 8) == (11, 2)  # the longest match alone counts


def test_ngram_prompt_copies_stop_where_outputs_stopped_copying():
    """Outputs that matched 2 tokens of their prompt (1 2) and went on with 9 instead of the
    prompt's 3 (a JSON value closing where the prompt's sentence goes on) make such copies
    improbable: the chain from the prompt stops there."""
    from lmprog_runtime.speculative.ngram import PromptIndex
    corpus = NgramCorpus(max_depth=8, capacity=10_000)
    prompt = PromptIndex([1, 2, 3, 4, 5, 6])
    assert corpus.draft([7, 1, 2], 3, prompt) == [3, 4, 5]
    corpus.observe_copies(prompt, [1, 2, 3, 4, 5, 6] + [8, 1, 2, 9] * 4, 6)
    assert corpus.copy_rate(2) < 0.4
    assert corpus.draft([7, 1, 2], 3, prompt) == []


def test_ngram_chain_skips_what_the_grammar_forbids():
    """After 5 (a JSON integer's comma) the prompts went on with 40 (" lives") twice and an
    output with 6 ("\n") once: the grammar allows only 6 there, so the chain drafts it, with
    its share of the allowed continuations (1), and goes on."""
    from lmprog_runtime.speculative.ngram import _SeqState
    corpus = NgramCorpus(max_depth=4, capacity=10_000)
    for seq in ([1, 5, 40, 41], [2, 5, 40, 41], [3, 5, 6, 7]):
        corpus.feed(_SeqState(corpus.gen), seq)
    assert corpus.draft([8, 5], 2) == []  # 40 (2 of 3) after the single token 5: p = 1/3
    assert corpus.draft([8, 5], 2, allows=lambda draft, t: t != 40) == [6, 7]


def test_ngram_chain_discounts_other_requests_values():
    """Past a key (1 2 3 4) two requests wrote their own values (50, 51): a third request
    whose prompt holds neither drafts nothing there (1/2 each, squared: 1/4), one whose
    prompt holds 51 drafts it (1/2)."""
    from lmprog_runtime.speculative.ngram import MIN_PATH_PROB
    assert 0.5 >= MIN_PATH_PROB > 0.25
    src = NgramDraftSource(max_depth=8, capacity=10_000)
    for rid, value in (("a", 50), ("b", 51)):
        src.propose([_R(rid, [20, value, 21], [1, 2, 3, 4, value, 60])], [1])
    assert src.propose([_R("c", [20, 52, 21], [1, 2, 3, 4])], [1]) == [None]
    assert src.propose([_R("d", [20, 51, 21], [1, 2, 3, 4])], [1])[0].tokens[0] == 51


class _ListGrammar:
    """A matcher over tokens 0..9 that allows only 6 after 5 (and anything elsewhere)."""

    def __init__(self):
        self.accepted = [1]

    def write_mask(self, row):
        row[:] = self.accepted[-1] != 5
        row[6] = True

    def accept_token(self, t):
        self.accepted.append(t)

    def rollback(self, k):
        del self.accepted[len(self.accepted) - k:]

    def is_terminated(self):
        return False


def test_grammar_guide_follows_any_draft_and_rolls_back():
    from lmprog_runtime.speculative.guide import GrammarGuide
    g = _ListGrammar()
    guide = GrammarGuide(g, 10, prefix=[2])
    assert guide.allows([], 5) and guide.allows([5], 6) and not guide.allows([5], 7)
    assert guide.allows([3], 7) and g.accepted == [1, 2, 3]  # back to the common part, then on
    assert not guide.allows([5, 7], 1) and not guide.allows([], 11)  # a forbidden draft; out of vocab
    guide.close()
    assert g.accepted == [1]
    bad = GrammarGuide(g, 10, prefix=[5, 7])  # the prefix itself forbidden: nothing follows
    assert not bad.allows([], 1)
    bad.close()
    assert g.accepted == [1]


def test_ngram_tree_branches_best_first_by_count():
    corpus = NgramCorpus(max_depth=4, capacity=10_000)
    from lmprog_runtime.speculative.ngram import _SeqState
    # after "1 2": 4 (three times), 3 (once); after "2 4": 7 twice, 8 once
    corpus.feed(_SeqState(corpus.gen), [1, 2, 4, 7, 1, 2, 3, 5, 1, 2, 4, 7, 1, 2, 4, 8])
    tokens, parents = corpus.draft_tree([9, 1, 2], 4, topk=2)
    assert tokens[:2] == [4, 7] and parents[:2] == [-1, 0]  # the most probable path first
    assert set(zip(tokens, parents)) >= {(3, -1), (8, 0)} or len(tokens) == 4
    assert all(p < j for j, p in enumerate(parents))
    for j in range(len(tokens)):  # siblings carry distinct tokens
        sib = [tokens[i] for i in range(len(tokens)) if parents[i] == parents[j]]
        assert len(sib) == len(set(sib))
    # topk 1 is the chain draft
    chain, chain_parents = corpus.draft_tree([9, 1, 2], 3, topk=1)
    assert chain == corpus.draft([9, 1, 2], 3) and chain_parents == [-1, 0, 1]
    assert corpus.draft_tree([99, 98], 5, topk=3) == ([], [])


def test_tree_shapes():
    parents = [-1, -1, 0, 0, 2]  # root → a(0), b(1); a → c(2), d(3); c → e(4)
    assert depths(parents) == [1, 1, 2, 2, 3]
    assert path_to(parents, 4) == [0, 2, 4]
    assert children(parents) == [[0, 1], [2, 3], [], [4], [], []]
    m = extend_mask(parents, lead=1)
    assert m.shape == (6, 6)
    assert m[5].tolist() == [True, True, False, True, False, True]  # e sees root, a, c, itself
    assert m[2].tolist() == [True, False, True, False, False, False]  # b: root and itself
    assert keep_nodes([10, 11, 12, 13, 14], parents, [True, True, False, True, True]) == (
        [10, 11, 13], [-1, -1, 0])  # c dropped, so is its child e
    from lmprog_runtime.speculative.tree import well_formed
    # a repeated sibling token (node 1 = node 0's) and a forward parent are dropped with their subtrees
    assert well_formed([10, 10, 12, 13, 14], [-1, -1, 0, 5, 1]) == ([10, 12], [-1, 0])


def test_tree_greedy_follows_the_argmax_path():
    parents = [-1, -1, 0, 0, 2]
    draft = [5, 6, 7, 8, 9]
    scaled = torch.full((6, 12), -1.0)
    for row, best in enumerate([6, 1, 2, 3, 4, 11]):  # row 0 picks b (6); b's row picks 2: no child
        scaled[row, best] = 1.0
    assert accept_tree_greedy(scaled, draft, parents) == ([6, 2], [1])
    for row, best in enumerate([5, 7, 1, 4, 3, 11]):  # root → a (5) → c (7) → row of c picks 4, not e (9)
        scaled[row].fill_(-1.0)
        scaled[row, best] = 1.0
    assert accept_tree_greedy(scaled, draft, parents) == ([5, 7, 4], [0, 2])


def test_tree_rejection_sampling_emits_the_target_distribution():
    """The root has two drafted children (tokens 0 and 2), child 0 has one (token 1). The
    first emitted token must follow p_0 and, after 0 was accepted, the second p_1 (5 sigma)."""
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.2, 0.5, 0.3, 0.0], [0.1, 0.1, 0.1, 0.7],
                      [0.25, 0.25, 0.25, 0.25]])
    draft, parents = [0, 2, 1], [-1, -1, 0]
    gen = torch.Generator().manual_seed(3)
    n = 20000
    first, second = torch.zeros(4), torch.zeros(4)
    seconds = 0
    for _ in range(n):
        tokens, path = accept_tree_sampled(p, draft, parents, gen)
        assert tokens[:len(path)] == [draft[j] for j in path] and len(tokens) == len(path) + 1
        first[tokens[0]] += 1
        if tokens[0] == 0:
            second[tokens[1]] += 1
            seconds += 1
    for freq, probs, m in ((first / n, p[0], n), (second / seconds, p[1], seconds)):
        for f, q in zip(freq.tolist(), probs.tolist()):
            assert abs(f - q) <= 5 * math.sqrt(q * (1 - q) / m) + 1e-9, (freq, probs)
    assert second[3] == 0


def test_ngram_shares_between_requests_and_forgets_released_state():
    src = NgramDraftSource(max_depth=8, capacity=10_000)
    src.propose([_R("a", [1, 2, 3, 4, 5, 6])], [1])
    [d] = src.propose([_R("b", [9, 3, 4])], [2])
    assert d.tokens == [5, 6]
    src.release(_R("a", []))
    assert set(src.states) == {"b"}


def test_ngram_capacity_rotates_generations():
    corpus = NgramCorpus(max_depth=3, capacity=1024)
    from lmprog_runtime.speculative.ngram import _SeqState
    s = _SeqState(corpus.gen)
    corpus.feed(s, list(range(100)) + [1, 2])
    first = corpus.draft([0, 1], 1)
    assert first == [2]
    for i in range(5):  # far more than capacity / 2 new nodes: two rotations
        corpus.feed(_SeqState(corpus.gen), list(range(1000 + 1000 * i, 1000 + 1000 * i + 400)))
    assert corpus.gen >= 2 and corpus.nodes < 1024
    assert corpus.draft([0, 1], 1) == []  # the oldest generation is gone


def test_ngram_rewritten_tail_restarts_cleanly():
    src = NgramDraftSource(max_depth=5, capacity=10_000)
    r = _R("a", [1, 2, 3], [4, 5])
    src.propose([r], [1])
    r.output_ids = [7]  # a jump-forward rewrote the output
    src.propose([r], [1])
    assert src.states["a"].fed == 4 and src.states["a"].last == 7


# -- adaptive budget --------------------------------------------------------------------------
def test_budget_shrinks_grows_and_cools_down():
    b = DraftBudget(8)
    b.update(8, 2, 8)
    assert b.k == 3 and b.cooldown == 0
    b.update(3, 3, 8)
    assert b.k == 6
    b.update(6, 0, 8)
    assert b.k == 1 and b.cooldown == 0 and b.misses == 1
    b.update(1, 0, 8)
    assert b.cooldown == 2
    pauses = []
    for _ in range(10):
        b.update(1, 0, 8)
        pauses.append(b.cooldown)
    assert pauses[0] == 4 and pauses[-1] == COOLDOWN_MAX and pauses == sorted(pauses)
    b.update(1, 1, 8)
    assert b.misses == 0


# -- verification -----------------------------------------------------------------------------
def test_greedy_acceptance_is_longest_matching_prefix_plus_bonus():
    scaled = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 9]):
        scaled[row, best] = 1.0
    assert _accept_greedy(scaled, [3, 5, 7]) == ([3, 5, 7, 9], 3)
    assert _accept_greedy(scaled, [3, 6, 7]) == ([3, 5], 1)
    assert _accept_greedy(scaled, [0, 5, 7]) == ([3], 0)


def test_rejection_sampling_emits_the_target_distribution():
    """Two positions with known p; the draft proposes a likely token then an unlikely one.
    The first emitted token must follow p_0, and the second (when the first draft was
    accepted) p_1. Tolerance: 5 standard deviations of a frequency over n draws."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]])
    gen = torch.Generator().manual_seed(1)
    n = 20000
    first = torch.zeros(4)
    second = torch.zeros(4)
    seconds = 0
    for _ in range(n):
        tokens, accepted = _accept_sampled(p, [0, 2], gen)
        assert 1 <= len(tokens) <= 3 and tokens[:accepted] == [0, 2][:accepted]
        first[tokens[0]] += 1
        if len(tokens) >= 2:
            second[tokens[1]] += 1
            seconds += 1
    for freq, probs, m in ((first / n, p[0], n), (second / seconds, p[1], seconds)):
        for f, q in zip(freq.tolist(), probs.tolist()):
            assert abs(f - q) <= 5 * math.sqrt(q * (1 - q) / m) + 1e-9, (freq, probs)
    assert second[3] == 0 and first[3] == 0  # a zero-probability token never appears


# -- the per-step cap -------------------------------------------------------------------------
class _Sampling:
    frequency_penalty = presence_penalty = 0.0
    repetition_penalty = 1.0


class _Running:
    """What `speculator.eligible` reads from a running request in a plain decode step."""

    def __init__(self, rid):
        self.rid, self.finished, self.grammar, self.sampling = rid, False, None, _Sampling()
        self.extend_len, self.kv_len, self.prompt_len = 1, 10, 5
        self.output_ids, self.min_new_tokens, self.max_new_tokens = [7], 0, 100
        self.spec = None


def test_step_cap_gives_the_best_acceptors_their_drafts_first():
    from lmprog_runtime.speculative.base import Draft, DraftSource
    from lmprog_runtime.speculative.config import SpecConfig
    from lmprog_runtime.speculative.speculator import Speculator

    class Fixed(DraftSource):
        def propose(self, reqs, budgets, prefixes=None):
            return [Draft([1, 2, 3, 4][:k]) for k in budgets]

    sp = Speculator(SpecConfig("NGRAM", num_draft_tokens=5, num_steps=4), Fixed(), vocab_size=10,
                    jump_forward=False, stats={}, step_draft_tokens=6, cost_rule=False)
    reqs = [_Running(r) for r in "abc"]
    drafts = sp.propose(reqs)
    assert [len(drafts[id(r)].tokens) if id(r) in drafts else 0 for r in reqs] == [4, 2, 0]
    sp.after_verify(reqs[2], 4, 4, [1, 2, 3, 4, 5])  # c's drafts were all accepted: it goes first
    sp.after_verify(reqs[0], 4, 0, [9])
    drafts = sp.propose(reqs)
    assert [len(drafts[id(r)].tokens) if id(r) in drafts else 0 for r in reqs] == [0, 2, 4]
    assert sp.stats["spec_num_verify"] == 2 and sp.stats["spec_num_accepted_tokens"] == 4


def test_cost_rule_draft_length_and_fit():
    from lmprog_runtime.speculative.cost import Acceptance, StepCost, draft_length, worth_it
    assert draft_length(0.8, c=10.0, m=0.5, limit=15) == 13  # 0.8^13 * 10 = 0.55 >= 0.5 > 0.8^14 * 10
    assert draft_length(0.3, c=2.5, m=1.0, limit=15) == 0    # even the first draft does not pay
    assert draft_length(0.9, c=1.0, m=0.0, limit=7) == 7
    cost = StepCost()
    assert cost.model(16) is None
    for _ in range(5):
        cost.observe(16, 0, 0.040)          # plain decode steps at batch 16: 40 ms
    assert cost.model(16) is None           # no verify measured yet
    for d in (4, 8, 12, 16, 4) * 2:
        cost.observe(16, d, 0.040 + 0.006 + 0.001 * d)  # s = 6 ms, m = 1 ms per draft token
    c, s, m = cost.model(16)
    assert abs(c - 0.0025) < 1e-9 and abs(s - 0.006) < 1e-6 and abs(m - 0.001) < 1e-6
    assert cost.model(12)[1:] == cost.model(16)[1:]  # one bucket for 9..16 (c is per request)
    assert worth_it((c, s, m), [(0.9, 4, 4)] * 4)       # 4 good drafters pay for the verify
    assert not worth_it((c, s, m), [(0.2, 1, 1)] * 4)   # 4 poor ones do not
    a = Acceptance()
    for _ in range(10):
        a.update(4, 0)
    assert a.rate < 0.15
    assert abs(a.seed(weight=2.0).ok + a.seed(weight=2.0).miss - 2.0) < 1e-9


def test_cost_rule_turns_poor_drafters_off_and_keeps_good_ones():
    """Measured step times where one draft token costs 40% of a decoded token's share of
    the step: a request accepting nothing stops drafting, one accepting everything keeps
    drafting; the idled one's shadow drafts (checked against its plain outputs, no verify)
    bring it back once its outputs follow them."""
    from lmprog_runtime.scheduler.batch import PlannedDraft, PlannedReq, StepPlan
    from lmprog_runtime.speculative.base import Draft, DraftSource
    from lmprog_runtime.speculative.config import SpecConfig
    from lmprog_runtime.speculative.speculator import Speculator

    class Fixed(DraftSource):
        cheap = True

        def propose(self, reqs, budgets, prefixes=None):
            return [Draft([1, 2, 3, 4, 5, 6][:k]) for k in budgets]

    sp = Speculator(SpecConfig("NGRAM", num_draft_tokens=7, num_steps=6), Fixed(), vocab_size=10,
                    jump_forward=False, stats={}, step_draft_tokens=64)
    good, poor = _Running("good"), _Running("poor")
    assert sp.propose([good, poor]) == {}  # no plain step measured at batch 2: it runs plain
    assert sp.stats["spec_num_steps_calibrating"] == 1
    for _ in range(6):
        sp.after_verify(good, 4, 4, [1, 2, 3, 4, 5])
        sp.after_verify(poor, 4, 0, [9])

    def step(drafts: int) -> StepPlan:
        plan = StepPlan()
        for i, r in enumerate((good, poor)):
            d = PlannedDraft([1] * drafts) if drafts and i == 0 else None
            plan.items.append(PlannedReq(r, 1 + (drafts if d else 0), 10, None, draft=d))
        return plan

    for _ in range(5):
        sp.observe_step(step(0), 0.020)                  # c = 10 ms per token at batch 2
    for d in (2, 4, 6, 2, 4) * 2:
        sp.observe_step(step(d), 0.020 + 0.004 * d)      # m = 4 ms per draft token
    poor.output_ids = [7]  # the shadow's tokens predict what follows this
    drafts = sp.propose([good, poor])
    assert id(poor) not in drafts and len(drafts[id(good)].tokens) >= 4
    for _ in range(20):  # poor's plain steps produce exactly what its shadows said
        if id(poor) in drafts:
            break
        poor.output_ids = poor.output_ids + [1, 2, 3, 4]
        drafts = sp.propose([good, poor])
    assert id(poor) in drafts and sp.stats["spec_num_shadow_accepted"] >= 4
    assert sp.stats["spec_num_shadow_drafts"] == sp.stats["spec_num_shadow_accepted"] // 4


@pytest.mark.parametrize("cost_rule", [True, False])
def test_cost_rule_can_be_turned_off(cost_rule):
    """Drafts that cost 10x a decoded token: the rule declines them all; with the rule off
    (--speculative-disable-cost-rule) the budgets' heuristic drafts regardless of timing."""
    from lmprog_runtime.scheduler.batch import PlannedDraft, PlannedReq, StepPlan
    from lmprog_runtime.speculative.base import Draft, DraftSource
    from lmprog_runtime.speculative.config import SpecConfig
    from lmprog_runtime.speculative.speculator import Speculator

    class Fixed(DraftSource):
        def propose(self, reqs, budgets, prefixes=None):
            return [Draft([1, 2, 3, 4][:k]) for k in budgets]

    sp = Speculator(SpecConfig("NGRAM", num_draft_tokens=5, num_steps=4), Fixed(), vocab_size=10,
                    jump_forward=False, stats={}, step_draft_tokens=64, cost_rule=cost_rule)
    r = _Running("r")

    def step(drafts: int) -> StepPlan:
        d = PlannedDraft([1] * drafts) if drafts else None
        return StepPlan(items=[PlannedReq(r, 1 + drafts, 10, None, draft=d)])

    for _ in range(5):
        sp.observe_step(step(0), 0.010)
    for d in (1, 2, 3, 4) * 3:  # 12 verifies: past the rule's MIN_VERIFY (EMA weight 6)
        sp.observe_step(step(d), 0.010 + 0.100 * d)
    drafted = id(r) in sp.propose([r])
    assert drafted is not cost_rule


def test_forced_text_joins_the_ngram_continuation():
    """Where jump-forward forces text, the draft is the request's own draft if it goes past
    the forced text, else the forced tokens + the source's continuation after them (chain or
    tree, the tree hanging below the last forced token)."""
    from lmprog_runtime.scheduler.batch import PlannedDraft
    from lmprog_runtime.speculative.base import Draft, DraftSource
    from lmprog_runtime.speculative.config import SpecConfig
    from lmprog_runtime.speculative.speculator import Speculator

    class Source(DraftSource):
        def __init__(self):
            self.seen = []

        def propose(self, reqs, budgets, prefixes=None):
            self.seen.append(prefixes)
            if prefixes:  # continues after the forced text: a small tree
                return [Draft([7, 8, 9][:k], [-1, -1, 0][:k]) for k in budgets]
            return [Draft([5][:k]) for k in budgets]  # its own draft: shorter than the forced text

    src = Source()
    sp = Speculator(SpecConfig("NGRAM", num_draft_tokens=9, num_steps=8, topk=2), src, vocab_size=10,
                    jump_forward=True, stats={}, step_draft_tokens=64, cost_rule=False)
    r = _Running("a")
    forced = {id(r): PlannedDraft([5, 6], forced=True)}
    d = sp.propose([r], forced)[id(r)]
    assert src.seen[-1] == [[5, 6]]
    assert (d.tokens, d.parents, d.num_forced, d.forced) == ([5, 6, 7, 8, 9], [-1, 0, 1, 1, 2], 2, False)
    own = sp._choose(r, 6, Draft([5, 6, 1]), forced[id(r)], Draft([7]))
    assert own.tokens == [5, 6, 1] and own.num_forced == 0  # its own draft spells the forced text and more


def test_stream_interval_is_kept_when_a_step_adds_several_tokens():
    """interval 4: chunks at lengths 1, 5, 9, ... one token per step; a verified run that
    steps over such a length (3 → 6) still sends, and the cadence continues from there."""
    from lmprog_runtime.scheduler.outbox import Outbox

    class _S:
        stream_interval = None

    class _R:
        rid, stream, finished, finished_reason, return_logprob = "r", True, False, None, False
        prompt_len, cached_tokens, num_retractions, spec, sampling = 3, 0, 0, None, _S()
        sent_output_len = first_changed = 0
        output_ids: list = []

    box, r, sent = Outbox(stream_interval=4), _R(), []
    r.output_ids = []
    for step in [1, 1, 1, 3, 1, 1, 1, 1]:  # tokens added per step: lengths 1 2 3 6 7 8 9 10
        r.output_ids = r.output_ids + [0] * step
        box.stream(r)
        sent += [len(r.output_ids)] * len(box.take())
    assert sent == [1, 6, 9]


def test_speculation_turns_the_overlap_loop_off():
    from types import SimpleNamespace

    from lmprog_runtime.scheduler.scheduler import Scheduler

    runner = SimpleNamespace(device=torch.device("cpu"))
    assert Scheduler._overlap_pool(ServerArgs(force_overlap_schedule=True), runner) is not None
    assert Scheduler._overlap_pool(ServerArgs(force_overlap_schedule=True, speculative_algorithm="NGRAM"),
                                   runner) is None


def _measured_b16(sp, plain_s=0.165, s=0.080, m=0.017):
    """Step times as measured for chat at batch 16 on the development CPU (docs/speculative.md):
    a plain step 165 ms; a verify adds s = 80 ms plus m = 17 ms per draft token."""
    from lmprog_runtime.scheduler.batch import PlannedDraft, PlannedReq, StepPlan

    reqs = [_Running(f"r{i}") for i in range(16)]

    def step(drafts: int) -> StepPlan:
        plan = StepPlan()
        for i, r in enumerate(reqs):
            d = PlannedDraft([1] * drafts) if drafts and i == 0 else None
            plan.items.append(PlannedReq(r, 1 + (drafts if d else 0), 10, None, draft=d))
        return plan

    for _ in range(5):
        sp.observe_step(step(0), plain_s)
    for d in (2, 6, 10, 14, 4, 8) * 2:
        sp.observe_step(step(d), plain_s + s + m * d)
    return reqs


class _Counting:
    """A draft source that always finds a 4-token draft, counting its calls (a lookup)."""
    cheap = True

    def __init__(self):
        self.calls = []

    def propose(self, reqs, budgets, prefixes=None):
        from lmprog_runtime.speculative.base import Draft
        self.calls.append(list(budgets))
        return [Draft([1, 2, 3, 4][:k]) for k in budgets]

    def on_verified(self, req, tokens, accepted):
        pass


def test_cost_rule_declines_poor_acceptance_at_batch_16():
    """Measured costs at batch 16 injected (no timing of this run): a plain step 165 ms, a
    verify 80 ms more plus 2 ms per draft token. Requests that accept about one draft token
    in four each pay for a 1-token draft alone, but 16 of them do not pay for the verify:
    the step never verifies, and the lookups for drafts the rule could not use are not made
    (only shadow drafts, 4 tokens, once per request until decided). Requests accepting
    everything verify. With chat's measured m = 17 ms (more than a decoded token's 10 ms
    share) nothing ever drafts."""
    from lmprog_runtime.speculative.config import SpecConfig
    from lmprog_runtime.speculative.speculator import Speculator

    src = _Counting()
    sp = Speculator(SpecConfig("NGRAM", num_draft_tokens=5, num_steps=4), src, vocab_size=10,
                    jump_forward=False, stats={}, step_draft_tokens=64)
    reqs = _measured_b16(sp, m=0.002)
    c, s, m = sp.cost.model(16)
    assert abs(c - 0.165 / 16) < 1e-9 and abs(s - 0.080) < 1e-6 and abs(m - 0.002) < 1e-6
    sp.propose(reqs)  # creates the budgets
    for r in reqs:
        for _ in range(8):
            sp.after_verify(r, 4, 1, [1, 9])  # one of four accepted, every time
    src.calls.clear()
    declined = sp.stats["spec_num_steps_declined"]
    for _ in range(10):
        assert sp.propose(reqs) == {}
    assert sp.stats["spec_num_steps_declined"] == declined + 10
    assert src.calls in ([], [[4] * 16])  # at most the shadow drafts, once (outputs unchanged)
    for r in reqs:
        for _ in range(8):
            sp.after_verify(r, 4, 4, [1, 2, 3, 4, 5])
    drafts = sp.propose(reqs)
    assert len(drafts) == 16 and all(len(d.tokens) == 4 for d in drafts.values())

    chat = Speculator(SpecConfig("NGRAM", num_draft_tokens=5, num_steps=4), _Counting(), vocab_size=10,
                      jump_forward=False, stats={}, step_draft_tokens=64)
    reqs = _measured_b16(chat, m=0.017)
    chat.propose(reqs)
    for r in reqs:
        for _ in range(8):
            chat.after_verify(r, 4, 4, [1, 2, 3, 4, 5])
    assert chat.propose(reqs) == {}


def test_cost_rule_step_test_counts_the_fixed_cost_once():
    """A request whose drafts pay their own tokens (a^k * c >= m) but not the step's fixed cost
    alone: declined in a plain step; verified where the step verifies forced text anyway."""
    from lmprog_runtime.scheduler.batch import PlannedDraft
    from lmprog_runtime.speculative.config import SpecConfig
    from lmprog_runtime.speculative.cost import worth_it
    from lmprog_runtime.speculative.speculator import Speculator

    sp = Speculator(SpecConfig("NGRAM", num_draft_tokens=5, num_steps=4), _Counting(), vocab_size=10,
                    jump_forward=True, stats={}, step_draft_tokens=64)
    reqs = _measured_b16(sp, m=0.002)
    for r in reqs[1:]:
        r.max_new_tokens = len(r.output_ids) + 1  # one token left: they do not draft
    sp.propose(reqs)
    for _ in range(8):
        sp.after_verify(reqs[0], 4, 4, [1, 2, 3, 4, 5])
    model = sp.cost.model(16)
    a = sp.budgets[reqs[0].rid].acc.rate
    assert not worth_it(model, [(a, 4, 4)]) and worth_it(model, [(a, 4, 4)], sunk=True)
    assert sp.propose(reqs) == {}
    forced = {id(reqs[1]): PlannedDraft([5], forced=True)}
    assert len(sp.propose(reqs, forced)[id(reqs[0])].tokens) == 4


def test_shadow_drafts_resolve_like_a_verify():
    from lmprog_runtime.speculative.shadow import Shadow, main_chain
    sh = Shadow(2, [5, 6, 7])
    assert sh.resolve([1, 2]) is None and sh.resolve([1, 2, 5, 6]) is None  # agreeing so far
    assert sh.resolve([1, 2, 5, 6, 7]) == (3, 3)
    assert sh.resolve([1, 2, 5, 9]) == (3, 1) and sh.resolve([1, 2, 8]) == (3, 0)
    assert main_chain([5, 6, 7], None) == [5, 6, 7]
    # root -> 0 -> 2 -> 4 (first children); 1 and 3 are alternatives
    assert main_chain([10, 11, 12, 13, 14], [-1, -1, 0, 0, 2]) == [10, 12, 14]


def test_cost_model_interpolates_between_measured_batch_sizes():
    """Batch sizes 1 and 4 measured: 2 and 3 get the linear interpolation of P, s and m (a
    draining batch does not measure every size); 5 and up, beyond both, stay unknown."""
    from lmprog_runtime.speculative.cost import StepCost
    cost = StepCost()
    for b, plain, s, m in ((1, 0.020, 0.002, 0.004), (4, 0.050, 0.008, 0.010)):
        for _ in range(5):
            cost.observe(b, 0, plain)
        for d in (1, 3, 5, 7, 2, 4) * 2:
            cost.observe(b, d, plain + s + m * d)
    c, s, m = cost.model(2)
    assert abs(c * 2 - 0.030) < 1e-9 and abs(s - 0.004) < 1e-6 and abs(m - 0.006) < 1e-6
    assert cost.plain_known(3) and not cost.plain_known(5) and cost.model(6) is None
    cost.observe(3, 2, 0.040 + 0.006 + 2 * 0.008)  # a verify at 3 is fitted against P(3) interpolated
    assert 3 in cost.fits


def test_cost_model_prices_a_token_at_the_batch_sizes_its_bucket_was_measured_at():
    """Batches 9..16 share a bucket: P measured at 16 (and 15) is a step of ~16 requests, so a
    token is worth P / ~16 whatever smaller batch of the bucket asks (P / 10 overstated it and
    made drafts look worth more), and a verify at 10 is fitted against P scaled to 10."""
    from lmprog_runtime.speculative.cost import StepCost
    cost = StepCost()
    for b in (16, 15, 16, 15, 16, 16):
        cost.observe(b, 0, 0.002 * b)  # 2 ms a request
    for d in (4, 8, 12, 16, 4, 8) * 2:
        cost.observe(10, d, 0.002 * 10 + 0.005 + 0.001 * d)  # s = 5 ms, m = 1 ms at batch 10
    c, s, m = cost.model(10)
    assert abs(c - 0.002) < 1e-6 and cost.model(16)[0] == c
    assert abs(s - 0.005) < 1e-4 and abs(m - 0.001) < 1e-5


def test_acceptance_of_a_request_that_never_accepts_falls_below_5_percent():
    """Its failures saturate at 1 / (1 - ACCEPT_DECAY) = 5: the prior must not hold a above
    the few % of a step that a 1-token verify costs at batch 1."""
    from lmprog_runtime.speculative.cost import Acceptance
    a = Acceptance()
    assert a.rate == 0.5
    for _ in range(40):
        a.update(1, 0)
    assert a.rate < 0.05
