"""The cfg engine's matcher states are kept out of the cyclic garbage collector's view
(cfg/untrack.py): a full collection visits every tracked object of the process, and the
tables' interned states were most of them (one full collection 0.36-0.42 s after the dev
corpus, docs/constrained.md "Stop 54"); and a dropped grammar is still freed whole."""
import gc
import json

import numpy as np
import pytest

from lmprog_runtime.constrained import create_grammar_backend
from lmprog_runtime.constrained.cfg import untrack as untrack_module
from lmprog_runtime.constrained.cfg.nodes import Node

pytestmark = pytest.mark.skipif(untrack_module._UNTRACK is None, reason="no CPython C API to untrack with")

_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                            "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
                                            "n": {"type": "integer", "minimum": 1},
                                            "self": {"$ref": "#"}},
           "required": ["name"]}
_TEXT = '{"name":"Ada","tags":["a","b"],"n":12,"self":{"name":"x"}}'


def _tuples(x):
    """x and the tuples and frozensets inside it."""
    stack, seen = [x], set()
    while stack:
        y = stack.pop()
        if id(y) in seen:
            continue
        seen.add(id(y))
        yield y
        stack.extend(z for z in y if isinstance(z, (tuple, frozenset)))


def _walk(be, tokenizer, schema, text):
    g = be.get_future("json", json.dumps(schema)).result(timeout=60).copy()
    words = np.zeros(-(-be.vocab_size // 32), dtype=np.int32)
    for t in tokenizer.encode(text, add_special_tokens=False):
        g.write_bitmask(words)
        assert (words[t >> 5] >> (t & 31)) & 1
        g.accept_token(t)
    return g


def test_states_tables_and_memo_keys_are_untracked(tokenizer):
    be = create_grammar_backend("cfg", tokenizer, vocab_size=49152 + 64, eos_token_ids=[tokenizer.eos_token_id])
    try:
        g = _walk(be, tokenizer, _SCHEMA, _TEXT)
        engine = g._shared.engine
        tracked = [y for st in g._states[1:] for y in _tuples(st) if gc.is_tracked(y)]
        assert not tracked, tracked[:3]  # (the matcher's states, as accept_token leaves them)
        if engine._tw:  # (the C table walk's interned states; none where no C kernel is built)
            table = engine._tw.table
            states = [list.__getitem__(table.states, i) for i in range(len(table.states))]
            assert len(states) > 20
            assert not [y for st in states if st is not None for y in _tuples(st) if gc.is_tracked(y)]
        assert not [k for k in engine._memo if any(gc.is_tracked(y) for y in _tuples(k))]
    finally:
        be.shutdown()


def test_a_dropped_grammar_is_freed_whole(tokenizer):
    """Untracked tuples hold nodes the collector cannot see them hold: a grammar's node
    cycles are found one collection after its tables are freed, never kept."""
    def count():
        return sum(type(o) is Node for o in gc.get_objects())
    gc.collect()
    before = count()
    be = create_grammar_backend("cfg", tokenizer, vocab_size=49152 + 64, eos_token_ids=[tokenizer.eos_token_id])
    for k in range(3):
        schema = dict(_SCHEMA, title=f"variant {k}")
        _walk(be, tokenizer, schema, _TEXT)
    assert count() > before + 10
    be.shutdown()
    del be
    for _ in range(3):
        gc.collect()
    assert count() <= before


def _fresh_state(node, k: int):
    """A state-like structure of new, tracked tuples and frozensets (a shared tail included),
    as a table interns them: frames of nodes, strings, counts and key sets."""
    tail = (("O", node, 0, frozenset({"a", f"k{k}"}), None), None)
    frame = ("S", node, k, 0, 0, 0, False, "key", (k, ("nested", node), frozenset({("in a set", node)})))
    return ((frame, (("V", node, (1, 2)), tail)), (("N", node, str(k), 3), tail))


@pytest.mark.parametrize("walk", ["c", "python"])
def test_the_c_and_python_walks_untrack_every_tuple(walk, monkeypatch):
    """untrack.c's walk (where built) and the Python walk take off every tuple and frozenset
    of a state, down through frozensets and shared tails, and nothing else."""
    if walk == "c" and untrack_module._c_walk() is None:
        pytest.skip("untrack.c is not built here (no C compiler or no Python headers)")
    if walk == "python":
        monkeypatch.setattr(untrack_module, "_C", [None])
    node = Node(True)
    states = [_fresh_state(node, k) for k in range(50)]
    assert sum(gc.is_tracked(y) for st in states for y in _tuples(st)) > 8 * len(states)
    for st in states:
        untrack_module.untrack(st)
    assert not [y for st in states for y in _tuples(st) if gc.is_tracked(y)]
    assert gc.is_tracked(node)  # (a node holds the grammar's cycles: the collector still sees it)
