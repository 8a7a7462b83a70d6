"""Forced-text drafts (scheduler/jump_forward.py): tokens, grammar walk, limits."""


def test_drafts_respect_limits_and_grammar(tokenizer):
    """Units: forced tokens spell the text after the output's tail; a draft stops before
    the token that completes the grammar and within max_new_tokens;
    the matcher ends where it began."""
    from types import SimpleNamespace

    from lmprog_runtime.constrained import create_grammar_backend
    from lmprog_runtime.constrained.jump_forward import forced_token_ids
    from lmprog_runtime.scheduler.jump_forward import draft_limit, grammar_draft

    tail = tokenizer.encode('Answer: {"', add_special_tokens=False)
    ids = forced_token_ids(tokenizer, 'name": "', tail)
    assert tokenizer.decode(tail + ids) == 'Answer: {"name": "'
    be = create_grammar_backend("outlines", tokenizer, 49152, [tokenizer.eos_token_id], whitespace_pattern="")
    try:
        g = be.get_future("regex", r"(Yes|No), because the sky\.").result(timeout=120)
        g.accept_token(tokenizer.encode("Yes", add_special_tokens=False)[0])
        jump = g.jump_forward_str()
        assert jump == ", because the sky."
        tokens = forced_token_ids(tokenizer, jump, tokenizer.encode("Yes", add_special_tokens=False))
        state = g.state
        kept, mask = grammar_draft(g, tokens, 49152)
        assert g.state == state
        assert kept == tokens[:-1]  # the last token completes the grammar: it comes as the bonus
        assert mask.shape == (len(kept) + 1, 49152) and all(mask[i, t] for i, t in enumerate(kept))
        assert mask[len(kept), tokens[-1]] and mask[len(kept)].sum() >= 1
    finally:
        be.shutdown()
    r = SimpleNamespace(output_ids=[1, 2, 3], max_new_tokens=10, min_new_tokens=0)
    assert draft_limit(r) == 6  # 6 drafts + a bonus = the 7 tokens left


class _DeadEndMatcher:
    """A matcher whose language has a dead end: after token 1 nothing may follow (an engine
    bug the draft must not turn into a verify row sampled from an empty mask)."""

    def __init__(self, vocab):
        self.vocab, self.out = vocab, []

    def write_mask(self, row):
        row[:] = False
        if not self.out:
            row[1] = row[2] = True
        elif self.out[-1] == 2:
            row[3] = True

    def accept_token(self, t):
        self.out.append(t)

    def rollback(self, n):
        del self.out[len(self.out) - n:]

    def is_terminated(self):
        return False


def test_a_draft_stops_before_a_dead_end():
    from lmprog_runtime.scheduler.jump_forward import grammar_draft
    from lmprog_runtime.speculative.tree import grammar_tree_draft

    g = _DeadEndMatcher(8)
    kept, mask = grammar_draft(g, [1], 8)
    assert kept == [] and mask.shape == (1, 8) and mask[0].any() and g.out == []
    kept, parents, mask = grammar_tree_draft(g, [1, 2], [-1, -1], 8)
    assert (kept, parents) == ([2], [-1]) and bool(mask.any(dim=-1).all()) and g.out == []
