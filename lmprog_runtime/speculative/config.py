"""The speculative-decoding flags, validated at start-up and resolved once (torch-free:
`ServerArgs.__post_init__` calls `validate_speculative_args` in the server process too).

Counting follows SGLang: `num_draft_tokens` is what one request adds to a verify forward,
the last verified token included, so a request drafts at most `num_draft_tokens - 1`
tokens per step. With `eagle_topk == 1` (chains) a STANDALONE draft model runs
`num_steps` autoregressive steps and `num_draft_tokens = num_steps + 1`. With
`eagle_topk > 1` (NGRAM only) a draft is a tree: each node has at most `eagle_topk`
children and `num_draft_tokens` bounds the tree's size (the verified token as its root
included), as SGLang's NGRAM trees; `num_steps` then plays no part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmprog_runtime.config import (MAX_EAGLE_TOPK, MAX_VERIFY_TOKENS, NGRAM_DEFAULT_DRAFT_TOKENS, NGRAM_MATCH_TYPES,
                                   SPECULATIVE_ALGORITHMS, STANDALONE_DEFAULT_STEPS)


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str                 # NGRAM | STANDALONE
    num_draft_tokens: int          # tokens per request in a verify forward (drafts + 1)
    num_steps: int                 # STANDALONE: autoregressive draft steps (= num_draft_tokens - 1)
    draft_model_path: Optional[str] = None
    ngram_max_trie_depth: int = 18
    ngram_capacity: int = 1_000_000
    ngram_match_type: str = "BFS"
    topk: int = 1                  # children per draft-tree node (1: chains)

    @property
    def max_drafts(self) -> int:
        return self.num_draft_tokens - 1


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"speculative_{name} must be {expected}, got {got!r}.")


def validate_speculative_args(args) -> None:
    """Raise ValueError naming the flag, what it must be and what it was."""
    algo = args.speculative_algorithm
    if algo is None:
        return
    if algo not in SPECULATIVE_ALGORITHMS:
        _fail("algorithm", f"one of {list(SPECULATIVE_ALGORITHMS)}", algo)
    if algo == "STANDALONE" and not args.speculative_draft_model_path:
        raise ValueError("speculative_algorithm STANDALONE needs speculative_draft_model_path "
                         "(a smaller model with the same tokenizer).")
    if algo == "NGRAM" and args.speculative_draft_model_path:
        raise ValueError("speculative_draft_model_path is only used with speculative_algorithm STANDALONE.")
    topk = args.speculative_eagle_topk
    if topk is not None and not 1 <= topk <= MAX_EAGLE_TOPK:
        _fail("eagle_topk", f"in [1, {MAX_EAGLE_TOPK}] (children per draft-tree node)", topk)
    tree = topk is not None and topk > 1
    if tree and algo != "NGRAM":
        _fail("eagle_topk", "1 with STANDALONE (the draft model drafts chains; trees come from NGRAM)", topk)
    if tree and args.attention_backend == "flashinfer":
        _fail("eagle_topk", "1 with attention_backend flashinfer (no tree mask there; use triton or "
              "torch_native)", topk)
    steps, n = args.speculative_num_steps, args.speculative_num_draft_tokens
    if steps is not None and not 1 <= steps <= MAX_VERIFY_TOKENS - 1:
        _fail("num_steps", f"in [1, {MAX_VERIFY_TOKENS - 1}]", steps)
    if n is not None and not 2 <= n <= MAX_VERIFY_TOKENS:
        _fail("num_draft_tokens", f"in [2, {MAX_VERIFY_TOKENS}] (the verified token + its drafts)", n)
    if not tree and steps is not None and n is not None and n != steps + 1:
        _fail("num_draft_tokens", f"num_steps + 1 = {steps + 1} with eagle_topk 1", n)
    lo, hi = args.speculative_ngram_min_bfs_breadth, args.speculative_ngram_max_bfs_breadth
    if lo < 1:
        _fail("ngram_min_bfs_breadth", "at least 1", lo)
    if hi < lo:
        _fail("ngram_max_bfs_breadth", f"at least speculative_ngram_min_bfs_breadth ({lo})", hi)
    if args.speculative_ngram_match_type not in NGRAM_MATCH_TYPES:
        _fail("ngram_match_type", f"one of {list(NGRAM_MATCH_TYPES)}", args.speculative_ngram_match_type)
    if args.speculative_ngram_max_trie_depth < 2:
        _fail("ngram_max_trie_depth", "at least 2", args.speculative_ngram_max_trie_depth)
    if args.speculative_ngram_capacity < 1024:
        _fail("ngram_capacity", "at least 1024 (trie nodes)", args.speculative_ngram_capacity)


def resolve_speculative(args) -> Optional[SpecConfig]:
    """The resolved settings, or None when speculation is off (args already validated)."""
    algo = args.speculative_algorithm
    if algo is None:
        return None
    steps, n = args.speculative_num_steps, args.speculative_num_draft_tokens
    topk = args.speculative_eagle_topk or 1
    if n is None:
        if steps is not None and topk == 1:
            n = steps + 1
        else:
            n = NGRAM_DEFAULT_DRAFT_TOKENS if algo == "NGRAM" else STANDALONE_DEFAULT_STEPS[2]
    return SpecConfig(algorithm=algo, num_draft_tokens=n, num_steps=n - 1,
                      draft_model_path=args.speculative_draft_model_path,
                      ngram_max_trie_depth=args.speculative_ngram_max_trie_depth,
                      ngram_capacity=args.speculative_ngram_capacity,
                      ngram_match_type=args.speculative_ngram_match_type, topk=topk)
