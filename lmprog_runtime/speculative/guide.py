"""What a request's grammar allows along a draft being built: a draft source asks token by
token instead of proposing a chain the grammar cuts at its first forbidden token (after a
JSON integer's `,` the prompt goes on with ` lives` where only whitespace or `"` may come).

    guide = GrammarGuide(req.grammar, vocab_size, prefix)   # prefix: forced text drafted first
    guide.allows(draft, token)   # may `token` follow prefix + draft?
    guide.close()                # the matcher back where it was (the speculator's duty)

The matcher follows the draft asked about (rolled back to the common part when it differs
from the last one), so a source may ask in any order; masks are computed once per state.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np


class GrammarGuide:
    def __init__(self, grammar, vocab_size: int, prefix: Sequence[int] = ()):
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.pushed: List[int] = []  # tokens the matcher accepted since it was handed over
        self.rows: Dict[int, np.ndarray] = {}  # j -> mask of the state after pushed[:j]
        self.prefix = list(prefix)

    def allows(self, draft: Sequence[int], token: int) -> bool:
        """Whether the grammar allows `token` after the prefix and `draft` (False where the
        prefix or the draft is already forbidden)."""
        return (0 <= token < self.vocab_size and self._follow(self.prefix + list(draft))
                and bool(self._row()[token]))

    def close(self) -> None:
        self.grammar.rollback(len(self.pushed))
        self.pushed, self.rows = [], {}

    def _follow(self, tokens: List[int]) -> bool:
        """Put the matcher after `tokens`; False (the matcher after an allowed prefix of
        them) where one is forbidden."""
        same = 0
        while same < min(len(tokens), len(self.pushed)) and tokens[same] == self.pushed[same]:
            same += 1
        self.grammar.rollback(len(self.pushed) - same)
        del self.pushed[same:]
        self.rows = {j: row for j, row in self.rows.items() if j <= same}
        for t in tokens[same:]:
            if not (0 <= t < self.vocab_size and self._row()[t]) or self.grammar.is_terminated():
                return False
            self.grammar.accept_token(t)
            self.pushed.append(t)
        return True

    def _row(self) -> np.ndarray:
        """The mask of the matcher's current state."""
        j = len(self.pushed)
        if j not in self.rows:
            self.rows[j] = np.empty(self.vocab_size, dtype=np.bool_)
            self.grammar.write_mask(self.rows[j])
        return self.rows[j]
