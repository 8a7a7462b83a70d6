"""The lazy token index (byte DFA + trie walk) allows exactly what outlines-core's
full-vocabulary index allows, in C and in the numpy fallback."""
import random

import numpy as np
import outlines_core
import pytest

from lmprog_runtime.constrained.index import ByteDFA, token_bytes
from lmprog_runtime.constrained.trie_walk import TokenTrie, c_walker

REGEXES = [
    r'\{[ ]?"name"[ ]?:[ ]?"[^"\\]{0,12}"[ ]?,[ ]?"age"[ ]?:[ ]?(0|[1-9][0-9]{0,2})[ ]?\}',
    r"(yes|no|maybe)\.",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"caf\u00e9 [\u4e00-\u9fff]{1,3}!",  # multi-byte characters split across tokens
]


@pytest.fixture(scope="module")
def table(tokenizer):
    t = token_bytes(tokenizer)
    t[tokenizer.eos_token_id] = None
    return t


def reference_rows(regex, table, eos):
    """State -> allowed token ids, from outlines-core's full-vocabulary index."""
    by_bytes: dict = {}
    for i, b in enumerate(table):
        if b is not None:
            by_bytes.setdefault(b, []).append(i)
    index = outlines_core.Index(regex, outlines_core.Vocabulary(eos, by_bytes))
    return index


@pytest.mark.parametrize("regex", REGEXES)
def test_masks_match_outlines_full_index(regex, table, tokenizer):
    eos = tokenizer.eos_token_id
    ref = reference_rows(regex, table, eos)
    dfa = ByteDFA(regex)
    tries = [TokenTrie(table)] + ([TokenTrie(table, use_c=False)] if c_walker() else [])
    rng = random.Random(0)
    # walk random paths in both automata together, comparing allowed sets at each step
    for _ in range(20):
        ref_state, state = ref.get_initial_state(), dfa.initial
        for _ in range(12):
            want = set(ref.get_allowed_tokens(ref_state) or []) - {eos}
            for trie in tries:
                row = np.zeros(len(table) + 1, dtype=np.bool_)
                trie.mask(dfa, state, row)
                assert set(np.nonzero(row)[0].tolist()) == want
            assert (state in dfa.finals) == ref.is_final_state(ref_state)
            if not want:
                break
            tok = rng.choice(sorted(want))
            ref_state = ref.get_next_state(ref_state, tok)
            state = dfa.walk(state, table[tok])


def test_tokens_with_equal_bytes_share_the_answer():
    table = [b"a", b"ab", None, b"ab", b"b"]
    dfa = ByteDFA("ab?")
    for trie in (TokenTrie(table), TokenTrie(table, use_c=False)):
        row = np.zeros(len(table) + 1, dtype=np.bool_)
        trie.mask(dfa, dfa.initial, row)
        assert row.tolist() == [True, True, False, True, False, False]


def test_trie_skip_pointers_cover_subtrees(table):
    trie = TokenTrie(table[:3000])
    d = trie.depth.astype(int)
    for i in range(0, trie.n_nodes, 97):
        j = trie.skip[i]
        assert all(d[k] > d[i] for k in range(i + 1, j))
        assert j == trie.n_nodes or d[j] <= d[i]
