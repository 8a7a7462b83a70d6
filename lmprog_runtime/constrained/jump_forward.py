"""Compressed FSM (jump-forward): strings the grammar forces, and canonical re-tokenization.

`CharAutomaton` is the character-level DFA of the same regex the token index was built
from (via `interegular`). From a state, the *forced string* follows edges while the
state is not accepting and has exactly one live outgoing edge labelled by exactly one
character. The token index works on the UTF-8 bytes of the same language, so any
tokenization of `text + forced` is legal there too.
"""
from __future__ import annotations

from typing import Optional, Sequence

import interegular
from interegular.fsm import anything_else


class CharAutomaton:
    """Character DFA with dead states pruned and per-state forced edges precomputed."""

    def __init__(self, regex: str):
        fsm = interegular.parse_pattern(regex).to_fsm()
        self.initial = fsm.initial
        self.finals = set(fsm.finals)
        self._map = fsm.map
        self._symbol = fsm.alphabet  # char -> transition key
        self._chars = fsm.alphabet.by_transition  # key -> [chars]
        self._live = self._live_states()
        self._forced: dict[int, Optional[tuple[str, int]]] = {}

    def _live_states(self) -> set:
        rev: dict = {}
        for s, edges in self._map.items():
            for t in edges.values():
                rev.setdefault(t, set()).add(s)
        live, todo = set(self.finals), list(self.finals)
        while todo:
            for p in rev.get(todo.pop(), ()):
                if p not in live:
                    live.add(p)
                    todo.append(p)
        return live

    def step(self, state, ch: str):
        """Next state after `ch`, or None when `ch` leaves the language."""
        key = self._symbol[ch] if ch in self._symbol else self._symbol[anything_else]
        nxt = self._map.get(state, {}).get(key)
        return nxt if nxt in self._live else None

    def walk(self, state, text: str):
        for ch in text:
            if state is None:
                return None
            state = self.step(state, ch)
        return state

    def _forced_edge(self, state) -> Optional[tuple[str, int]]:
        if state in self._forced:
            return self._forced[state]
        edge = None
        if state not in self.finals:
            live = [(k, t) for k, t in self._map.get(state, {}).items() if t in self._live]
            if len(live) == 1:
                chars = self._chars.get(live[0][0], [])
                if len(chars) == 1 and chars[0] is not anything_else:
                    edge = (chars[0], live[0][1])
        self._forced[state] = edge
        return edge

    def forced_string(self, state, limit: int = 1024) -> str:
        out = []
        while state is not None and len(out) < limit:
            edge = self._forced_edge(state)
            if edge is None:
                break
            out.append(edge[0])
            state = edge[1]
        return "".join(out)


def jump_forward_retokenize(tokenizer, output_ids: Sequence[int], jump_str: str,
                            prompt_tail_ids: Sequence[int] = ()) -> tuple[int, list[int]]:
    """Re-tokenize `decode(output_ids) + jump_str` canonically.

    Returns (keep, new_ids): the output becomes `output_ids[:keep] + new_ids`. The prompt's
    tail gives the tokenizer its left context; if the output's first token would fuse
    with the prompt, the output is tokenized on its own instead.
    """
    text = tokenizer.decode(list(output_ids), skip_special_tokens=False) + jump_str
    ids = None
    tail = list(prompt_tail_ids)
    if tail:
        prefix = tokenizer.decode(tail, skip_special_tokens=False)
        joined = tokenizer.encode(prefix + text, add_special_tokens=False)
        if joined[: len(tail)] == tail:
            ids = joined[len(tail):]
    if ids is None:
        ids = tokenizer.encode(text, add_special_tokens=False)
    keep = 0
    for a, b in zip(output_ids, ids):
        if a != b:
            break
        keep += 1
    return keep, list(ids[keep:])
