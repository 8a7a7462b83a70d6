"""The C table walk of cfg masks (cfg/table.py, table_walk.c) against the Python walk as
oracle: bit-identical masks on every state reached by the valid and invalid instances of
dev-corpus and JSON-Schema-Test-Suite schemas (token by token, SmolLM2 tokenizer), and on
schemas built to hit the abstracted parts (keys of open objects, residual checks that
capture text, uniqueItems items, patterns, bounded strings, anyOf alternatives)."""
import gc
import json
import pathlib
import sys
from decimal import Decimal

import numpy as np
import pytest

from lmprog_runtime.constrained.base import GrammarBackendConfig, GrammarError
from lmprog_runtime.constrained.cfg.backend import CfgBackend, compile_machine
from lmprog_runtime.constrained.cfg.mask import MaskEngine, VocabInfo, _past_value_start
from lmprog_runtime.constrained.cfg.canonical import NeedsText, canonical
from lmprog_runtime.constrained.cfg.table import DEAD, PYTHON, _no_ctx, c_table_walker
from tiny_model import smollm2_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from bench_grammar import SUITE_REMOTES, compact, load_cases  # noqa: E402

HANDWRITTEN = [
    ({"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                                       "kind": {"not": {"const": "x"}, "type": "string", "maxLength": 4}},
      "required": ["ids"]},
     [{"ids": [1, 2, 3], "kind": "ab"}, {"ids": [1, 1]}, {"ids": [], "kind": "x"}, {"ids": [2], "other": {"a": [1]}}]),
    ({"type": "object", "additionalProperties": {"type": "string", "pattern": "^[a-z]+[0-9]*$", "minLength": 2}},
     [{"name": "john7", "city": "oslo"}, {"a": "b"}, {"key with spaces": "zz9", "\u00e9t\u00e9": "ete"}]),
    ({"anyOf": [{"type": "number", "minimum": 1.5, "maximum": 99}, {"type": "string", "enum": ["a\u00e9", "bc"]},
                {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
     [12.25, 1, "a\u00e9", "bc", "zz", [True, False], [True, True, True], None]),
    ({"type": "object", "properties": {"if": {"if": {"type": "integer"}, "then": {"minimum": 3}}}},
     [{"if": 4}, {"if": 1}, {"if": "s"}, {}]),
]


@pytest.fixture(scope="module")
def backend():
    if c_table_walker() is None:
        pytest.skip("no C compiler: the cfg masks take the Python walk (nothing to compare)")
    tok = smollm2_tokenizer()
    return tok, CfgBackend(tok, len(tok), [tok.eos_token_id])


def _walk(tok, g0, oracle, text: str, label, must_accept: bool = False) -> int:
    """C masks against the Python walk's (`oracle`) along `text`'s tokens from grammar `g0`,
    up to the first token the grammar refuses (`must_accept`: none may be); how many."""
    sh, g, n = g0._shared, g0.copy(), 0
    for tid in tok.encode(text, add_special_tokens=False):
        hist = bytes(g._hist)
        oracle._memo.clear()  # (the oracle walks every state afresh: none of its masks is memoized)
        got, want = sh.engine.mask(g.state, hist), oracle.mask(g.state, hist)
        assert np.array_equal(got, want), (label, hist, np.nonzero(got != want)[0][:8])
        n += 1
        if not want[tid]:
            assert not must_accept, (label, hist, tid)
            break
        g.accept_token(tid)
    return n


def _compare(tok, be, schema, instances) -> int:
    """Masks compared along each instance; returns how many (0 when the schema is refused)."""
    try:
        g0 = be.compile("json", json.dumps(schema))
    except GrammarError:
        return 0
    sh = g0._shared
    oracle = MaskEngine(sh.machine, sh.engine.vocab, use_c=False)
    n = sum(_walk(tok, g0, oracle, compact(inst), schema) for inst in instances)
    assert sh.engine._tw, "the C table walk was not used"
    return n


def _walked(monkeypatch, eng, of=lambda state, hist: state) -> list:
    """What `eng` walks from now on (no memoized mask): `of(state, hist)` of each walk."""
    walked = []
    compute = eng._compute
    monkeypatch.setattr(eng, "_compute",
                        lambda key, state, hist: walked.append(of(state, hist)) or compute(key, state, hist))
    return walked


@pytest.mark.parametrize("corpus,limit", [("dev", 24), ("suite", 60)])
def test_table_walk_masks_equal_python_walk_on_corpora(backend, corpus, limit):
    tok, be = backend
    n = sum(_compare(tok, be, case["schema"], [t["data"] for t in case["tests"]])
            for case in load_cases(corpus)[:limit])
    assert n > 200


@pytest.mark.parametrize("corpus,cases", [("dev", slice(0, 252, 21)), ("suite", slice(0, 383, 16))])
def test_memoized_masks_equal_python_walk_along_random_walks(backend, corpus, cases):
    """Off the instances' paths too: after each schema's instances fill its memo (masks
    shared by canonical, near and context keys, under pending checks too), random walks
    (each token drawn from the mask, seeded) meet memoized masks at states no instance
    reaches, and each equals the memo-free Python walk."""
    tok, be = backend
    rng, n = np.random.default_rng(7), 0
    remotes = CfgBackend(tok, len(tok), [tok.eos_token_id], GrammarBackendConfig(schema_remotes=SUITE_REMOTES))
    for case in load_cases(corpus)[cases]:
        try:
            g0 = (remotes if corpus == "suite" else be).compile("json", json.dumps(case["schema"]))
        except GrammarError:
            continue
        oracle = MaskEngine(g0._shared.machine, g0._shared.engine.vocab, use_c=False)
        for t in case["tests"][:2]:
            _walk(tok, g0, oracle, compact(t["data"]), case["name"])
        for _ in range(2):
            g = g0.copy()
            for _ in range(16):
                hist = bytes(g._hist)
                oracle._memo.clear()
                got, want = g0._shared.engine.mask(g.state, hist), oracle.mask(g.state, hist)
                assert np.array_equal(got, want), (case["name"], hist, np.nonzero(got != want)[0][:8])
                n += 1
                allowed = np.nonzero(want)[0]
                if not len(allowed):
                    break
                g.accept_token(int(rng.choice(allowed)))
    assert n > 200


def test_unique_items_seen_are_abstracted_in_table_states(backend):
    """A uniqueItems array's items seen are read only where an item completes (its text
    read first: a PYTHON step), so table states inside and between items are one whatever
    came before (ANY_SEEN), and masks along arrays with repeated items, literals, numbers
    written alike and nested values still equal the Python walk's."""
    tok, be = backend
    schema = {"type": "array", "uniqueItems": True}
    g0 = be.compile("json", json.dumps(schema))
    canon = g0._shared.engine._walker()._canon
    states = []
    for text in ('[1,"a",', '[[2],true,', '[1,"ab', '[[2],"b'):
        states.append(canon(_after(tok, g0, text).state))
    assert states[0] == states[1] and states[2] == states[3]
    instances = [[1, 2, 1], [True, False, True], [None, 1, None], [1, 1.0], ["a", "b", "a"], [[1], [1.0]],
                 [{"a": 1}, {"a": 1.0}], [{"a": [1, True]}, {"a": [1, True]}], [0, False, None, "", [], {}]]
    assert _compare(tok, be, schema, instances) > 60
    # (an enum's item: a seen member is refused at its first byte, every member seen the comma)
    assert _compare(tok, be, {"type": "array", "uniqueItems": True, "items": {"enum": [1, True, "x", None]}},
                    instances + [[1, "x", True, None], ["x", None, 1]]) > 30
    # before the first item none are seen: its end is a table step (no text read), and the
    # table state after it is the one after any first item
    tw = g0._shared.engine._walker()
    for text in ('["ab', '[[2', '[1'):
        g = _after(tok, g0, text)
        tw.walk(g.state, bytes(g._hist), *g0._shared.engine._trie_of(None, g.state))
        assert not tw.read_text, text
    tab = tw.table
    first = [tab.intern(canon(_after(tok, g0, text).state)) for text in ('["ab",', '[[2],', '[1,')]
    assert len(set(first)) == 1 and first[0] == tab.intern(canon(_after(tok, g0, '[1,"a",').state))


def _after(tok, g0, text: str):
    g = g0.copy()
    for t in tok.encode(text, add_special_tokens=False):
        g.accept_token(t)
    return g


def test_unique_items_masks_from_none_seen_equal_python_walk(backend, monkeypatch):
    """Inside a uniqueItems array with items seen, a mask is that of the state with none seen
    less the tokens completing a seen item (cfg/unique.py): equal to the Python walk along
    texts with duplicates spelled raw, escaped and spaced, literals, numbers, containers
    and strings a single token spells, prefixes of seen items; and with no walk at all along
    a second tags array (its masks come from those with none seen, met along the first)."""
    tok, be = backend
    texts = ['["a","b","c"]', '["foo","fo","foo"]', '["ab","a\\u0062"]', '["\\u00e9","é","e"]',
             '[true,"true",false,null,true]', '["x" , "y",  "x"]', '[ "a", "b" ]', '["machine learning","machine"]',
             '["ab","a","ab"]', '["a\\"b","a\\"","a\\"b"]', '["",""]', '[1,"1",1.0]', '[[1],"a",[1]]',
             '[[],{},[]]', '[{}, {}]', '[",",":",","]', '["ab","ab"]', '["a","ab","a"]', '["b", "ab", "b"]',
             '["_","a"]', '["_", "_"]',
             # (nested inside an item: the tokens closing every container open in it are stepped)
             '[[[1],"foo"],[[true],"foo"],[[1],"foo"]]', '[{"foo":{"bar":{"baz":true}}},{"foo":{"bar":{"baz":true}}}]',
             '[{"a":1,"b":2},{"a":2,"b":1},{"b":2, "a":1}]', '[[1,2],[1, 2 ]]', '[[["x"]],[["x"]],[["y"]]]',
             '[{"a":"]}"},{"a":"]}"}]', '[[{}],[{}]]', '[[true],[true]]', '[{"a":[1]},{"a":[1]}]']
    n = 0
    for schema in ({"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                   {"type": "array", "uniqueItems": True},
                   {"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True},
                   {"type": "array", "prefixItems": [{"type": "string"}], "items": {"enum": ["a", "b", "x"]},
                    "uniqueItems": True},
                   {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                              "uniqueItems": True, "maxItems": 3}}},
                   # (a string may have to end where a seen one does: the tokens spelling it are stepped)
                   {"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True},
                   {"type": "array", "items": {"enum": ["a", "ab", "b", "foo", "x", "y", "é"]}, "uniqueItems": True},
                   {"type": "array", "items": {"type": "string", "pattern": "^(ab|[a-c])$"}, "uniqueItems": True},
                   {"type": "array", "items": {"enum": ["_", "a"]}, "uniqueItems": True}):  # (`"_` is one token)
        wrapped = [t if "properties" not in schema else '{"tags":' + t + '}' for t in texts]
        n += _compare_texts(tok, be, schema, wrapped)
    assert n > 900
    g0 = be.compile("json", json.dumps({"type": "array", "items": {"type": "string"}, "uniqueItems": True}))
    row = np.zeros(len(tok), dtype=np.bool_)
    for k, text in enumerate(('["python","machine learning","data science"]', '["rust","compilers","type theory"]')):
        if k:  # (a second array: its masks with items seen come from those with none, all met before)
            walked = _walked(monkeypatch, g0._shared.engine)
        g = g0.copy()
        for tid in tok.encode(text, add_special_tokens=False):
            g.write_mask(row)
            assert row[tid]
            g.accept_token(tid)
    assert not walked


def test_number_masks_from_their_end_equal_python_walk(backend, monkeypatch):
    """Inside a number a mask is its own tokens (number bytes first: the frame alone) and
    those of the number's end: equal to the Python walk along numbers free, checked,
    bounded, enumerated, in objects, arrays, under uniqueItems and contains, at the root;
    and a number met in a new context or with a new text does not walk the vocabulary."""
    tok, be = backend
    n = 0
    for schema, texts in (
            ({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "integer", "minimum": 3}}},
             ['{"a":1.5,"b":4}', '{"a":-0.25e+3,"b":17}', '{"b":3 ,"a":1E-2}', '{"a":0 }']),
            ({"type": "array", "items": {"type": "number", "multipleOf": 0.5, "exclusiveMaximum": 10.5}},
             ['[1.5,2,-3.5]', '[10,0.0,1e0]', '[ 9.5 , 7 ]']),
            ({"type": "array", "items": {"enum": [1, 2.5, -7, "x"]}, "uniqueItems": True},
             ['[1,2.5,-7]', '[2.50,1.0]', '["x",1]']),
            ({"type": "array", "contains": {"type": "integer", "minimum": 5}, "maxContains": 2},
             ['[3,4,5,6]', '[50,1.5,7]']),
            ({"const": 12}, ['12', '12.0', '1.2e1']),
            ({"type": "number", "maximum": 0.003}, ['0.003', '-4', '2e-3'])):
        n += _compare_texts(tok, be, schema, texts)
    assert n > 250
    g0 = be.compile("json", json.dumps({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.5},
                                                                         "b": {"type": "integer"}}}))
    walked = _walked_again(tok, g0, monkeypatch, '{"a":1.5,"b":4}', '{"b":17,"a":22.5}')
    assert not [st for st in walked if st[0][0][0] == "N"], "a number walked the vocabulary"


def test_free_number_parts_are_shared_by_grammars_and_tell_their_rules_apart(backend):
    """A free number's own tokens (no bounds, multipleOf or enum) are read once per tokenizer
    (VocabInfo.free_numbers) and serve every grammar: an integer's apart from a number's, a
    draft-04 integer (no fraction at all) apart from a later one's (`1.0` is one), each
    equal to the Python walk."""
    tok, be = backend
    shared = None
    texts = {"number": ['[1.5,-0.25e+3,1E-2,0 ]', '[12,3.0]'], "integer": ['[12,3.0,-7]', '[1 ,0]']}
    for dialect in (None, "http://json-schema.org/draft-04/schema#"):
        for kind in ("number", "integer"):
            for extra in ({}, {"maxItems": 9}):  # (two grammars of each rule: the second reads the first's parts)
                schema = dict({"type": "array", "items": {"type": kind}}, **extra)
                if dialect:
                    schema["$schema"] = dialect
                got = [t for t in texts[kind] if not (dialect and kind == "integer" and ".0" in t)]
                assert _compare_texts(tok, be, schema, got) > 5
                g0 = be.compile("json", json.dumps(schema))
                assert shared is None or g0._shared.engine.vocab.free_numbers is shared
                shared = g0._shared.engine.vocab.free_numbers
    keys = {k[:2] for k in shared}
    assert {(False, False), (True, False), (True, True)} <= keys, keys


def test_number_masks_with_tokens_past_a_number_end_equal_python_walk():
    """In a vocabulary whose tokens go on past a number's end (`5,`, `12]`, `1e5}`), a
    number's mask is still the Python walk's (those tokens read the stack below: walked)."""
    from lmprog_runtime.constrained.cfg.mask import VocabInfo
    table = [bytes([b]) for b in range(0x20, 0x7F)] + [b"5,", b"12]", b"0}", b"1e5}", b"2.5]", b"3 ", b"7,\"",
                                                        b"--", b"..", b"e-", b"ee", b"-1", b".5", b"99"]
    vocab = VocabInfo(table)
    n = 0
    for schema, texts in (({"type": "array", "items": {"type": "number", "maximum": 50}}, ["[12,5,0.5,1e1]"]),
                          ({"type": "object", "additionalProperties": {"type": "integer"}}, ['{"a":12,"b":-7}']),
                          ({"type": "array", "items": {"enum": [5, 12, 99]}, "uniqueItems": True}, ["[5,12,99]"])):
        machine = compile_machine("json", json.dumps(schema))
        eng, oracle = MaskEngine(machine, vocab), MaskEngine(machine, vocab, use_c=False)
        for text in texts:
            data, state = text.encode(), machine.initial()
            for k, b in enumerate(data):
                if state[0][0][0] == "N":
                    hist = data[:k]
                    assert (eng.mask(state, hist) == oracle.mask(state, hist)).all(), (schema, hist)
                    n += 1
                state = machine.advance(state, b, k, lambda a, z: data[a:z])
    assert n >= 12


def test_a_state_met_again_after_a_shared_mask_is_its_own_memo_hit(backend, monkeypatch):
    """A mask found under a canonical, near or context key is kept under the state's own
    key too: the same state met again makes none of those keys, and every mask is still
    the Python walk's."""
    tok, be = backend
    g0 = be.compile("json", json.dumps({"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "number"}}, "b": {"type": "string"}}, "additionalProperties": {"type": "integer"}}))
    eng = g0._shared.engine
    oracle = MaskEngine(g0._shared.machine, eng.vocab, use_c=False)
    _walk(tok, g0, oracle, '{"a":[1,23,456],"b":"xy","c":7}', "first", must_accept=True)
    made = []
    for name in ("_canon_key", "_key_near", "_ctx_key"):
        made_key = getattr(eng, name)
        monkeypatch.setattr(eng, name, lambda *a, f=made_key: made.append(a[1]) or f(*a))
    _walk(tok, g0, oracle, '{"a":[1,23,456],"b":"xy","c":7}', "again", must_accept=True)
    assert not made, "a state met again made its shared keys"
    _walk(tok, g0, oracle, '{"a":[98,7,654],"d":5}', "others", must_accept=True)
    assert made  # (other digits, another key: met under the shared keys)


def test_texts_under_a_check_share_masks_by_their_checks_verdicts(backend, monkeypatch):
    """A state whose walk read the text (a token there completes a checked value) is walked
    once per set of verdicts of the checks that walk made, not once per text: another text
    with the same verdicts is a memo hit, one with other verdicts a walk; every mask is the
    Python walk's."""
    tok, be = backend
    g0 = be.compile("json", json.dumps({"type": "array", "contains": {"type": "integer", "minimum": 5},
                                        "maxContains": 2}))
    eng = g0._shared.engine
    oracle = MaskEngine(g0._shared.machine, eng.vocab, use_c=False)
    eng._memo.clear()  # (the warm-up's walks met both verdicts)
    eng._decided.clear()
    _walk(tok, g0, oracle, "[1,2", "first", must_accept=True)
    walked = _walked(monkeypatch, eng, lambda state, hist: hist)
    _walk(tok, g0, oracle, "[3,4", "same verdicts", must_accept=True)
    assert not walked, "a text with the same verdicts walked"
    _walk(tok, g0, oracle, "[6,5,1", "other verdicts", must_accept=True)
    assert walked  # (`]` after [6] passes where after [1] and [3] it did not: walked)
    walked.clear()
    _walk(tok, g0, oracle, "[9,8,0]", "verdicts met", must_accept=True)
    assert not walked


def test_table_walk_masks_equal_python_walk_on_abstracted_states(backend):
    tok, be = backend
    assert sum(_compare(tok, be, schema, instances) for schema, instances in HANDWRITTEN) > 100


def test_table_walk_masks_equal_python_walk_on_ebnf_and_regex(backend):
    tok, be = backend
    cases = [("ebnf", 'root ::= "The capital is " city "." [ ]*\ncity ::= "Paris" | "Rome" | [A-Z][a-z]+',
              ["The capital is Oslo.", "The capital is Rome.  "]),
             ("regex", r"[a-z]{3,8}@example\.com( [0-9]+)?", ["abc@example.com", "johnny@example.com 42"])]
    n = 0
    for kind, spec, texts in cases:
        g0 = be.compile(kind, spec)
        sh = g0._shared
        oracle = MaskEngine(sh.machine, sh.engine.vocab, use_c=False)
        n += sum(_walk(tok, g0, oracle, text, kind, must_accept=True) for text in texts)
        assert sh.engine._tw
    assert n > 10


def test_key_closes_read_in_c_match_python_walk(backend):
    """Walks met again (the mask LRU emptied), from roots inside keys and before them: the
    C walk finds a closing quote's state from the key text (root text + path) registered
    when Python met that close the second time."""
    tok, be = backend
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "names": {"type": "integer"},
                                               "id": {"type": "boolean"}}, "additionalProperties": {"type": "null"}}
    g0 = be.compile("json", json.dumps(schema))
    sh = g0._shared
    oracle = MaskEngine(sh.machine, sh.engine.vocab, use_c=False)
    for rnd in range(3):  # a close met twice is registered for C; the third pass reads it there
        sh.engine._memo.clear()
        for prefix in ('{"', '{"na', '{"nam', '{"name', '{"x', '{"id', '{"i'):
            g = g0.copy()
            for tid in tok.encode(prefix, add_special_tokens=False):
                g.accept_token(tid)
            hist = bytes(g._hist)
            assert np.array_equal(sh.engine.mask(g.state, hist), oracle.mask(g.state, hist)), (rnd, prefix)
    assert sh.engine._tw.table.keys.n > 0


def test_key_close_table_keeps_entries_when_it_grows():
    from lmprog_runtime.constrained.cfg.keycloses import KeyCloses, key_hash

    keys = KeyCloses()
    entries = [(s % 7, f"key{s}".encode(), s) for s in range(3000)]
    for s, text, t in entries:
        keys.add(s, text, t)
    assert keys.cap >= 4096
    for s, text, t in entries:  # the probe table_walk.c makes
        slot = key_hash(s, text) & (keys.cap - 1)
        while True:
            h, value, off, n = keys.table[slot].tolist()
            assert n >= 0, (s, text)
            if (h & (2 ** 64 - 1)) == key_hash(s, text) and bytes(keys.pool[off:off + n]) == text and value >> 32 == s:
                assert value & 0xFFFFFFFF == t
                break
            slot = (slot + 1) & (keys.cap - 1)


def test_lexeme_map_keeps_entries_when_it_grows():
    """LexRows rehashes its (rep, below) -> id map in bulk when it grows: every entry stays
    where table_walk.c's probe (and `find`) reaches it, across colliding home slots."""
    import random

    from lmprog_runtime.constrained.cfg.lexrows import LexRows, _slot

    rng = random.Random(0)
    rows, entries = LexRows(), {}
    inside, lives = np.zeros(1 << 13, dtype=np.uint8), np.zeros(1 << 13, dtype=np.uint8)
    while len(entries) < 3000:
        key = (rng.randrange(1 << 12) << 32) | rng.randrange(64)  # (few distinct keys: collisions)
        if key in entries:
            continue
        rows._put(key, len(entries))
        entries[key] = len(entries)
        if 2 * len(entries) > len(rows.map) // 2:
            rows.grow(2 * len(rows.rep), inside, lives, 1 << 14)
    cap = len(rows.map)
    assert cap >= 8192
    for key, value in entries.items():
        slot = _slot(key, cap)
        while rows.map[slot, 0] != key:
            assert rows.map[slot, 0] != -1, key  # (a probe chain crosses filled slots only)
            slot = (slot + 1) & (cap - 1)
        assert rows.map[slot, 1] == value


def test_full_table_leaves_the_rest_to_python(backend, monkeypatch):
    """Past HARD_STATES new steps go to the Python walk, past SOFT_STATES the table is
    emptied before a walk: the masks stay those of the Python walk."""
    from lmprog_runtime.constrained.cfg import table

    monkeypatch.setattr(table, "HARD_STATES", 40)
    monkeypatch.setattr(table, "SOFT_STATES", 25)
    tok, be = backend
    assert sum(_compare(tok, be, schema, instances) for schema, instances in HANDWRITTEN[:2]) > 50


def _compare_texts(tok, be, schema, texts, rounds: int = 2) -> int:
    """Masks along raw texts (duplicate keys are spelled here, which dicts cannot), each
    walked `rounds` times with the mask LRU emptied in between (so C meets the table's
    generic closes and EXTRA states again); returns how many were compared."""
    g0 = be.compile("json", json.dumps(schema))
    sh = g0._shared
    oracle = MaskEngine(sh.machine, sh.engine.vocab, use_c=False)
    n = 0
    for _ in range(rounds):
        sh.engine._memo.clear()
        n += sum(_walk(tok, g0, oracle, text, schema) for text in texts)
    return n


def test_additional_property_keys_close_in_c(backend):
    """Keys of additionalProperties close to one EXTRA state per key state (table_walk.c's
    generic close); declared and already seen keys are registered apart (a seen key is a
    duplicate: dead), and a value's end under an EXTRA key is stepped from the concrete
    state (the key joins the seen keys there)."""
    tok, be = backend
    schemas = [
        {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 3}},
         "additionalProperties": {"type": "array", "items": {"type": "object"}}},
        {"type": "object", "additionalProperties": {"type": "object", "additionalProperties": {"type": "integer"}},
         "maxProperties": 3},
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
         "propertyNames": {"maxLength": 3}},
    ]
    texts = ['{"id":1,"name":"ab","tags":[{},{"x":1}],"ids":[],"id":2}', '{"x":[],"x":[]}',
             '{"a":{"b":1,"c":2},"d":{},"a":{}}', '{"ab":{"ab":1,"ab":2}}', '{"a":"x","abcd":1}',
             '{"name":"abcd"}', '{"a b":{"\\u00e9":3}}']
    assert sum(_compare_texts(tok, be, s, texts) for s in schemas) > 150
    g = be.compile("json", json.dumps(schemas[1]))
    for text in texts[:4]:
        g2 = g.copy()
        for tid in tok.encode(text, add_special_tokens=False):
            g2.write_mask(np.zeros(len(tok), dtype=np.bool_))
            try:
                g2.accept_token(tid)
            except GrammarError:
                break
    walker = g._shared.engine._tw
    assert (walker.table.generic[:len(walker.table.states)] >= 0).any(), "no generic key close was set"


def test_value_ends_under_the_roots_own_extra_key_are_bound_for_one_walk(backend, monkeypatch):
    """A value's end in a member whose key is EXTRA is stepped from the concrete state (the
    key joins the keys seen); where the member is the walk root's own and the step reads no
    text, one such step serves the walk's other paths to the same state and byte (`1,`
    `2,` `true,` ...: TableWalker._bind) and the table is PYTHON there again after the walk.
    Masks equal the Python walk's, under pending checks, uniqueItems arrays with items
    seen, members of nested open objects, and paths that open another member (a colon on
    the path: not bound) or close the object and open another one."""
    tok, be = backend
    from lmprog_runtime.constrained.cfg import table as table_mod
    bound, kept = [], []
    original = table_mod.TableWalker._bind

    def spy(self, p, b, t, path, d):
        n = len(self._bound)
        original(self, p, b, t, path, d)
        if len(self._bound) > n:
            bound.append((self, p, b))
    monkeypatch.setattr(table_mod.TableWalker, "_bind", spy)
    original_walk = table_mod.TableWalker.walk

    def walk(self, *args):
        got = original_walk(self, *args)
        kept.append(not self._bound and all(self.table.trans[p * 256 + b] == PYTHON for w, p, b in bound
                                            if w is self))
        return got
    monkeypatch.setattr(table_mod.TableWalker, "walk", walk)
    schemas = [
        {"type": "object", "additionalProperties": True},
        {"type": "array", "uniqueItems": True, "items": {"type": "object", "additionalProperties": True}},
        {"not": {"type": "object", "required": ["zz"]}, "additionalProperties": {"type": ["integer", "boolean",
                                                                                        "string", "array"]}},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
         "additionalProperties": {"type": "object", "additionalProperties": {"type": "integer"}}},
    ]
    texts = ['{"x":1,"y":true,"z":"s","w":[1,{"q":null}],"v":{"u":2}}', '[{"a":1},{"a":1,"b":2},{"a":[]}]',
             '{"k":12,"l":false,"m":"a,b:c","n":[true,"x"]}', '{"a":1,"b":{"c":1,"d":2},"e":{}}',
             '{"p":{"q":1}, "r": {"s": 2}}', '[{"x":{"y":1}},{"x":{"y":1}}]', '{"a":1,"a":2}']
    assert sum(_compare_texts(tok, be, s, texts) for s in schemas) > 250
    assert len(bound) > 20, "no step was bound for a walk"
    assert kept and all(kept), "a bound step outlived its walk"


def test_a_value_end_in_a_member_a_token_opened_is_not_bound():
    """A token that ends the root's member, opens another object's member and ends its value
    (`1},{"b":2,` in an array of open objects) reaches a state equal to the one the root's
    own member reaches (the array's count is clamped, the new object's keys seen are
    empty), but ends the value of another key: the step is not bound there (a colon on the
    path), so `"a"` stays allowed after it. A vocabulary of such tokens, C walk against the
    Python walk."""
    if c_table_walker() is None:
        pytest.skip("no C compiler: the cfg masks take the Python walk (nothing to compare)")
    table = [b'1', b'2', b'3', b',', b'}', b']', b'[', b'{', b'"', b'a', b'b', b':', b'1},{"b":2,',
             b'1},{"b":2,"a":3}', b'1},{"b":2,"a"', b'"a":', b'"b":', b'},{', b'2,"a"', None]
    vocab = VocabInfo(table)
    machine = compile_machine("json", json.dumps(
        {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "integer"}}}))
    engine, oracle = MaskEngine(machine, vocab), MaskEngine(machine, vocab, use_c=False)
    n = 0
    for text in ['[{"a":1},{"b":2,"a":3}]', '[{"a":1,"b":2},{"a":3}]', '[{"b":1},{"b":2}]']:
        data, state = text.encode(), machine.initial()
        for k in range(len(data) + 1):
            got, want = engine.mask(state, data[:k]), oracle.mask(state, data[:k])
            assert np.array_equal(got, want), (text, data[:k], [table[i] for i in np.nonzero(got != want)[0]])
            n += 1
            if k < len(data):
                state = machine.advance(state, data[k], k, lambda a, b: data[a:b])
    assert n > 60


def test_tables_of_all_grammars_stay_within_the_budget(backend, monkeypatch):
    """Past the process-wide total the least recently walked tables are emptied (a table
    being walked by another thread is skipped); masks stay those of the Python walk."""
    from lmprog_runtime.constrained.cfg.table_budget import BUDGET

    tok, be = backend
    schema_a, texts_a = HANDWRITTEN[0]
    schema_b = {"type": "object", "additionalProperties": {"type": "string", "maxLength": 5}}
    ga = be.compile("json", json.dumps(schema_a))
    _compare(tok, be, schema_a, texts_a)  # (another compile: its own table, walked)
    for inst in texts_a:  # ga's table filled
        g = ga.copy()
        for tid in tok.encode(compact(inst), add_special_tokens=False):
            g.write_mask(np.zeros(len(tok), dtype=np.bool_))
            try:
                g.accept_token(tid)
            except GrammarError:
                break
    tab_a = ga._shared.engine._tw.table
    assert len(tab_a.states) > 20
    monkeypatch.setattr(BUDGET, "total", 0)  # over the total at every walk
    monkeypatch.setattr(BUDGET, "low", 0)
    with tab_a.lock:  # ga "walked by another thread": kept
        assert _compare_texts(tok, be, schema_b, ['{"ab":"xyz","c":"d"}'], rounds=1) > 5
        assert len(tab_a.states) > 20
    assert _compare_texts(tok, be, schema_b, ['{"ab":"xyz"}'], rounds=1) > 3
    assert len(tab_a.states) == 0, "the idle table was not emptied"
    assert tab_a._held[0] < 256 << 10  # (an emptied table keeps its 64-state arrays)
    gc.collect()
    tables = list(BUDGET._tables)
    BUDGET.resize(0)  # (collected tables' bytes counted)
    assert BUDGET.used == sum(t._held[0] for t in tables)


def test_string_steps_made_in_c_match_python_walk(backend):
    """A string body in a new context takes the steps its lexeme's first state knows in C
    (lexrows.py: new state ids made there, their tuples built when Python reads them)."""
    tok, be = backend
    schema = {"type": "object", "properties": {
        "rows": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
        "name": {"type": "string", "maxLength": 6}, "tag": {"type": "string", "pattern": "^[a-z]+$"}},
        "additionalProperties": {"type": "string"}}
    texts = ['{"rows":[["ab","c\\u00e9d"],["ef \\"q\\""],[]],"name":"jo\\u00ebl","tag":"xyz","x":"y"}',
             '{"name":"abcdefg"}', '{"tag":"aB"}', '{"rows":[["\u00e9t\u00e9","\\n"]],"z":"\\ud83d\\ude00"}']
    assert _compare_texts(tok, be, schema, texts) > 80
    g = be.compile("json", json.dumps(schema))
    for text in texts:
        g2 = g.copy()
        for tid in tok.encode(text, add_special_tokens=False):
            g2.write_mask(np.zeros(len(tok), dtype=np.bool_))
            try:
                g2.accept_token(tid)
            except GrammarError:
                break
    tab = g._shared.engine._tw.table
    lx = tab.lexrows
    made = np.nonzero((lx.src[:len(tab.states)] >= 0) & (lx.kind[:len(tab.states)] < 3))[0]
    assert len(made) > 0, "the C walk made no string state"
    belows, shared = list(lx.below_ids), 0
    for i in made.tolist():  # their source's frame with their own node, over their own stack
        st, src = tab.states[i], tab.states[int(lx.src[i])]
        assert (st[0][1], st[0][0][1]) == (belows[int(lx.below[i])][1], belows[int(lx.below[i])][0])
        assert st[0][0][2:] == src[0][0][2:] and st in tab.ids
        assert (st[0][0][1].max_len, st[0][0][1].min_len) == (src[0][0][1].max_len, src[0][0][1].min_len)
        shared += st[0][0][1] is not src[0][0][1]
    assert shared, "no string state took its steps off another node's"


def test_unbounded_numbers_share_states_and_keep_exponents_exact(backend):
    """An unbounded number's text is "0" in the table (only its exponent's size and the
    length cap read it): its `e` is stepped from that "0" too, as no token has the 18+
    exponent digits that make whether `number_ok` fails depend on the digits before them,
    and a walk rooted inside an exponent steps from its own text, so masks stay those of
    the Python walk, huge exponents included."""
    tok, be = backend
    schemas = [{"type": "array", "items": {"type": "number"}},
               {"anyOf": [{"type": "number"}, {"type": "array", "items": {"type": "integer"}}]},
               {"type": "object", "additionalProperties": {"type": "integer"}}]
    texts = ["[1.5e3,123456789012345678901234567890,-0.0,1e99999999999999999999999999999,2E-5]",
             "[12,30.0,7e2]", "1e99999999999999999999999999999", "-12.75E+3", '{"a":10,"b":1.0,"c":1e5}',
             "[" + "9" * 180 + "]", "[99e999999999999999999,1]", "[9e999999999999999999]", "99e999999999999999999"]
    assert sum(_compare_texts(tok, be, s, texts) for s in schemas) > 100
    g = be.compile("json", json.dumps(schemas[0]))
    g2, eng = g.copy(), g._shared.engine
    for tid in tok.encode("[1234,56789", add_special_tokens=False):
        if g2.state[0][0][0] == "N":  # (a number's mask is read off its end: the table walked from it here)
            eng._walker().walk(g2.state, bytes(g2._hist), *eng._trie_of(None, g2.state))
        g2.write_mask(np.zeros(len(tok), dtype=np.bool_))
        g2.accept_token(tid)
    tab = eng._tw.table
    free = [i for i, st in enumerate(tab.states) if len(st) == 1 and st[0][0][0] == "N" and st[0][0][2] == "0"]
    assert free
    assert g._shared.engine.vocab.max_digits < 17
    steps = [int(tab.trans[i * 256 + b]) for i in free for b in b"eE"]
    assert PYTHON not in steps and any(t >= 0 for t in steps), "the exponent of a free number left to Python"


def test_numbers_alike_but_for_their_digits_share_one_memoized_mask(backend, monkeypatch):
    """A walk that read no text is memoized under its root's canonical state too: a free
    number met again in the same place, with other digits, is a memo hit (no walk), and its
    mask is the Python walk's. Where some token spells an exponent long enough for
    number_ok's overflow, the mantissa's digits matter and nothing is shared."""
    tok, be = backend
    schema = json.dumps({"type": "array", "items": {"type": "number"}})
    g0 = be.compile("json", schema)
    eng = g0._shared.engine
    oracle = MaskEngine(g0._shared.machine, eng.vocab, use_c=False)
    _walk(tok, g0, oracle, "[12,345,6.55", "first", must_accept=True)
    numbers = [k[1] for k in eng._memo if k[0] == "canon" and k[1][0][0][0] == "N"]
    assert [st for st in numbers if g0._shared.machine.advance(st, 0x65, 0, lambda a, b: b"")]
    walked = _walked(monkeypatch, eng)
    _walk(tok, g0, oracle, "[98,761,3.25", "again", must_accept=True)
    assert not [st for st in walked if st[0][0][0] == "N"], "a number's mask walked again"
    monkeypatch.setattr(eng.vocab, "max_digits", 20)
    g1 = be.compile("json", json.dumps({"type": "array", "items": {"type": "number"}, "maxItems": 9}))
    _walk(tok, g1, oracle, "[12,345,6.5", "long exponents", must_accept=True)
    machine = g1._shared.machine
    shared = [k[1] for k in g1._shared.engine._memo if k[0] == "canon" and k[1][0][0][0] == "N"]
    assert not [st for st in shared if machine.advance(st, 0x65, 0, lambda a, b: b"")], "shared across an exponent"


def test_a_number_class_first_met_as_itself_serves_the_others(backend, monkeypatch):
    """A bounded number's text stands for its class (the first text of the class met): the
    mask of that very text is memoized under the canonical key too, so another text of its
    class met later (in [0, 99]: 1-9 alike) is a memo hit, and each mask is the Python
    walk's."""
    tok, be = backend
    machine = compile_machine("json", json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99}}), be.whitespace)
    eng, oracle = MaskEngine(machine, be.vocab), MaskEngine(machine, be.vocab, use_c=False)  # (no warm-up)
    walked = _walked(monkeypatch, eng, lambda state, hist: hist)
    for text in (b"[5", b"[7", b"[5,3"):
        state = machine.initial()
        for k, b in enumerate(text):
            state = machine.advance(state, b, k, lambda start, end: text[start:end])
        assert np.array_equal(eng.mask(state, text), oracle.mask(state, text)), text
    assert walked == [b"[5"]  # (7 and 3: the class 5 stands for, its mask memoized under it)


def test_free_numbers_after_other_keys_share_one_memoized_mask(backend, monkeypatch):
    """A free number's canonical form ("0") told with its objects by their checks (both
    sharing rules at once): the same property's number met after other keys, with other
    digits, is a memo hit; every mask is still the Python walk's."""
    tok, be = backend
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                               "n": {"type": "number"}}}
    g0 = be.compile("json", json.dumps(schema))
    eng = g0._shared.engine
    oracle = MaskEngine(g0._shared.machine, eng.vocab, use_c=False)
    _walk(tok, g0, oracle, '{"a":1,"n":12', "first", must_accept=True)
    walked = _walked(monkeypatch, eng)
    _walk(tok, g0, oracle, '{"b":2,"n":345}', "again", must_accept=True)
    assert not [st for st in walked if st[0][0][0] == "N"], "a number's mask walked again"
    assert any(k[0] == "cctx" for k in eng._memo)


def _walked_again(tok, g0, monkeypatch, first: str, again: str) -> list:
    """The states whose masks were walked (not memo hits) along `again`, after `first`;
    every mask along both equal to the Python walk's."""
    eng = g0._shared.engine
    oracle = MaskEngine(g0._shared.machine, eng.vocab, use_c=False)
    _walk(tok, g0, oracle, first, "first", must_accept=True)
    walked = _walked(monkeypatch, eng)
    _walk(tok, g0, oracle, again, "again", must_accept=True)
    return walked


def test_a_string_body_after_other_keys_shares_its_masks_at_every_length(backend, monkeypatch):
    """A free string's body told as the fast path reads it (its count clamped) with its
    objects told by their checks: the same property's string, met after other keys and at
    other lengths than before, is a memo hit."""
    tok, be = backend
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    g0 = be.compile("json", json.dumps(schema))
    b = g0._shared.machine.root.props["b"]
    walked = _walked_again(tok, g0, monkeypatch, '{"a":"x","b":"yz"}', '{"b":"the quick brown fox jumps over"}')
    assert not [st for st in walked if st[0][0][0] == "S" and st[0][0][1] is b], "the string body walked again"


def test_a_number_past_its_minimum_is_a_free_number(backend, monkeypatch):
    """A number bounded by a minimum alone, whose text meets it (no sign), takes the free
    twin of its rule in the table's canonical form: its mantissa reads no further, so
    longer texts share one mask; a text short of the minimum keeps its own, and the masks
    stay the Python walk's (an exclusive minimum met only past equality, `-0`, exponents
    that take a number below its minimum)."""
    tok, be = backend
    assert be.vocab.exponent_free  # (SmolLM2: no token writes an exponent's digit)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10},
                                               "x": {"type": "integer", "exclusiveMinimum": 7},
                                               "f": {"type": "number", "minimum": 1}}}
    g0 = be.compile("json", json.dumps(schema))
    walked = _walked_again(tok, g0, monkeypatch, '{"n":123,"x":71,"f":2.5', '{"n":45678,"x":8,"f":3.25}')
    texts = [st[0][0][2] for st in walked if st[0][0][0] == "N"]
    assert not [t for t in texts if len(t) > 2], texts
    texts = ['{"n":9,"x":7}', '{"n":10,"x":71}', '{"n":-10}', '{"n":10.0}', '{"f":12.5}', '{"f":1.5e-3}',
             '{"f":-0.5}', '{"f":0.99}', '{"f":5E2,"x":-0}', '{"f":1e0}']
    assert _compare_texts(tok, be, schema, texts) > 40



def test_a_vocabulary_with_exponent_digits_is_not_exponent_free():
    """Where a token read from inside a number writes an exponent's digit (`5e3`, `e-2`),
    a walk may complete a number's exponent, which reads the mantissa: no number but an
    integer then takes a free twin past its minimum."""
    from lmprog_runtime.constrained.cfg.mask import VocabInfo
    from lmprog_runtime.constrained.cfg.nodes import Node
    assert VocabInfo([b"a", b"e", b"E", b"1", b"-", b"ee", b"+.", b"x5e3"]).exponent_free
    assert not VocabInfo([b"a", b"e", b"5e3"]).exponent_free
    assert not VocabInfo([b"a", b"e-2"]).exponent_free
    node = Node()
    node.types, node.lo = frozenset(("number",)), Decimal(1)
    state = ((("N", node, "25", 3), (("D", 0), None)),)
    assert canonical(state) is state
    assert canonical(state, exponent_free=True)[0][0][1:3] != (node, "25")


def test_after_an_undeclared_key_one_mask_for_every_such_key(backend, monkeypatch):
    """The state right after a key's closing quote (phase 1) told by its value's rule and
    the object's checks: undeclared keys whose last token ends at their quote share it,
    after other keys seen too."""
    tok, be = backend
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g0 = be.compile("json", json.dumps(schema))
    walked = _walked_again(tok, g0, monkeypatch, '{"a":1,"builtin ":"x"}', '{"feature ":"y","a":2}')
    assert not [st for st in walked if st[0][0][0] == "O" and st[0][0][2] == 1], "after the key walked again"


def test_pattern_property_keys_share_masks_by_their_pattern_states(backend, monkeypatch):
    """Inside a key of patternProperties the text is read only by the patterns (their
    states after it) and the names it may complete: other keys in the same pattern states
    are memo hits; near a declared name the text is kept (the tokens that complete it
    depend on it), and every mask is the Python walk's."""
    tok, be = backend
    schema = {"type": "object", "properties": {"fb_user": {"type": "integer"}},
              "patternProperties": {"^[a-z_]+$": {"type": "string"}, "^x": {"type": "integer"}},
              "additionalProperties": False}
    g0 = be.compile("json", json.dumps(schema))
    walked = _walked_again(tok, g0, monkeypatch, '{"fb_user_id":"1"}', '{"salesforce_customer_id":"2"}')
    assert not [st for st in walked if st[0][0][0] == "S" and type(st[0][0][7]) is str], "a key walked again"
    texts = ['{"fb_user":1,"fb_use":"a"}', '{"fb_user":"a"}', '{"xa":1,"xb":"a"}', '{"fb_user_x":"a","fb_user":2}']
    assert _compare_texts(tok, be, schema, texts) > 40


def test_a_string_bodys_tokens_look_its_mask_up_once(backend, monkeypatch):
    """Along a string body the stack below it is one object: after its first token the
    body's mask is found by that stack's identity (the entry holds the stack, so no other
    takes its id), not by hashing and comparing the stack again; a body under a captured
    value (a check reads its text) is never found so, and every mask is the Python walk's."""
    tok, be = backend
    schema = {"type": "object", "properties": {"s": {"type": "string"},
                                               "u": {"type": "array", "uniqueItems": True, "items": {"type": "string"}}}}
    g0 = be.compile("json", json.dumps(schema))
    eng = g0._shared.engine
    looked = []
    masked = eng._masked
    monkeypatch.setattr(eng, "_masked", lambda key, state, hist: looked.append(state) or masked(key, state, hist))
    oracle = MaskEngine(g0._shared.machine, eng.vocab, use_c=False)
    text = '{"s":"the quick brown fox jumps over the lazy dog","u":["one two three four","one two three five"]}'
    assert _walk(tok, g0, oracle, text, "body", must_accept=True) > 20
    s = g0._shared.machine.root.props["s"]
    assert len([st for st in looked if st[0][0][0] == "S" and st[0][0][1] is s and st[0][1][0][0] == "O"]) == 1
    assert len([st for st in looked if st[0][0][0] == "S" and st[0][1][0][0] == "U"]) > 6  # (by text there)


BOUNDED_STRINGS = [
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 12},
                                       "b": {"type": "string", "maxLength": 5}}, "required": ["a"]},
     ['{"a":"Jo\\u00e9 \\ud83d\\ude00 x","b":"x\\"y"}', '{"a":"ab\\"cdefghijk","b":""}',
      '{"b":"12345","a":"\u00e9\u00e9\u00e9"}', '{"a":"abc\\n\\tdef", "b":"\\ud83d\\ude00"}']),
    ({"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 30}},
     ['["My Load Balancer","x\\\\y","' + "a" * 30 + '"]', '["ab","\\u00e9\\u00e9"]']),
    ({"type": "object", "additionalProperties": {"type": "string", "minLength": 20}},
     ['{"k":"' + "abc def " * 4 + '","k2":"\\ud83d\\ude00' + "z" * 19 + '"}']),
]


@pytest.mark.parametrize("schema,texts", BOUNDED_STRINGS)
def test_bounded_string_masks_equal_the_full_walk_at_every_length(backend, schema, texts, monkeypatch):
    """Inside strings with maxLength / minLength, at every byte (every count, escapes and
    surrogate pairs half read), the mask equals the Python walk of the whole vocabulary:
    a string body's cached mask is never that of another length (plain tokens longer than
    any walked token's text count up to max_chars), and the walked part shared by every
    length (MaskEngine._bounded) keeps each token's counters."""
    tok, be = backend
    g0 = be.compile("json", json.dumps(schema))
    eng, machine = g0._shared.engine, g0._shared.machine
    v, n = eng.vocab, 0
    walked = _walked(monkeypatch, eng)
    for text in texts:
        data, state = text.encode(), machine.initial()
        for k, b in enumerate(data):
            hist = data[:k]
            got = eng.mask(state, hist)
            want = eng._walk_py(state, hist, v.trie, v.lists)
            assert np.array_equal(got, want), (text, hist, np.nonzero(got != want)[0][:8])
            state = machine.advance(state, b, k, lambda start, end: data[start:end])
            assert state, (text, k)
            n += 1
    assert n > 60
    # (at a character boundary each context's body is walked once, without its bounds)
    assert not [st for st in walked if st[0][0][0] == "S" and not any(st[0][0][3:6])
                and (st[0][0][1].max_len is not None or st[0][0][1].min_len)]


def test_string_steps_shared_across_nodes_keep_each_nodes_bounds(backend):
    """Strings of different nodes share their steps only where the steps agree: the same
    maxLength, and the same minLength (no maxLength: the canonical count is clamped at it)."""
    tok, be = backend
    schema = {"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "string", "minLength": 3}, "c": {"type": "string", "minLength": 3},
        "d": {"type": "string", "maxLength": 4}, "e": {"type": "string", "maxLength": 4, "minLength": 2}}}
    valid = ['{"a":"x","b":"abc","c":"abcdef"}', '{"b":"abcd","a":""}', '{"d":"abcd","e":"ab","a":"q"}']
    invalid = ['{"a":"x","b":"ab"}', '{"a":"xyz","c":"ab"}', '{"d":"x","e":"a"}', '{"e":"abcde"}']
    assert _compare_texts(tok, be, schema, valid + invalid) > 60
    g0 = be.compile("json", json.dumps(schema))
    for text in valid:
        assert _walk(tok, g0, MaskEngine(g0._shared.machine, g0._shared.engine.vocab, use_c=False), text, text,
                     must_accept=True) > 5
        g = g0.copy()
        for tid in tok.encode(text, add_special_tokens=False):
            g.accept_token(tid)
        assert g._accepting(), text
    for text in invalid:
        g, ok = g0.copy(), True
        for tid in tok.encode(text, add_special_tokens=False):
            row = np.zeros(len(tok), dtype=np.bool_)
            g.write_mask(row)
            if not row[tid]:
                ok = False
                break
            g.accept_token(tid)
        assert not (ok and g._accepting()), text
    tab = g0._shared.engine._tw.table
    lx, n = tab.lexrows, len(tab.states)
    for i in np.nonzero((lx.src[:n] >= 0) & (lx.kind[:n] < 3))[0].tolist():
        node, src = tab.states[i][0][0][1], tab.states[int(lx.src[i])][0][0][1]
        assert (node.min_len, node.max_len) == (src.min_len, src.max_len)


def test_states_made_in_c_are_built_when_read_or_iterated():
    from lmprog_runtime.constrained.cfg.lexrows import LexRows, States, StrContext

    class Tab:
        lexrows, ids = LexRows(), {}

    tab = Tab()
    states = States(tab)
    below = (("A", None, 4, 0, None, 0), (("D", 0), None))
    top = ("S", "node0", 1, 0, 0, 0, (), None)
    states.append(((top, (("O",), None)),))  # id 0: a rep, over another stack
    tab.lexrows.register(0, 0, StrContext(("node0", (("O",), None))), 1)
    tab.lexrows.below_ids[StrContext(("node1", below))] = 1
    states.sync(2)
    tab.lexrows.src[1], tab.lexrows.below[1] = 0, 1  # id 1: made by C (rep 0's frame, node1, over `below`)
    assert list.__getitem__(states, 1) is None
    want = ((("S", "node1") + top[2:], below),)
    assert list(states)[1] == want and tab.ids[want] == 1


def test_whitespace_steps_made_in_c_match_python_walk(backend):
    """Whitespace between JSON tokens is a lexeme (lexrows.py kinds 3 / 4): in a new context
    (another array item, another member) its steps are made in C off the first state with
    the same whitespace state, its non-ws steps read off the context's first state; masks
    stay those of the Python walk, with whitespace runs up to and past the pattern's limit,
    and the states C made are the context's frame with their source's whitespace state."""
    from lmprog_runtime.constrained.cfg.lexrows import WsContext, ws_of

    tok, be = backend
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                                               "b": {"type": "object", "additionalProperties": {"type": "boolean"}}}}
    pad = " " * 15
    texts = ['{"a":[1, 2,\n 3 ,4],"b":{"x": true , "y":\tfalse}}', '{"a" :[' + pad + '5' + pad + ']}',
             '{"b":{' + " " * 17 + '"z":null}}', '{ "a": [ ] , "b": { } }']
    assert _compare_texts(tok, be, schema, texts) > 40
    g = be.compile("json", json.dumps(schema))
    for text in texts:
        g2 = g.copy()
        for tid in tok.encode(text, add_special_tokens=False):
            g2.write_mask(np.zeros(len(tok), dtype=np.bool_))
            try:
                g2.accept_token(tid)
            except GrammarError:  # (17 spaces: past the whitespace pattern's 16)
                break
    tab = g._shared.engine._tw.table
    lx = tab.lexrows
    n = len(tab.states)
    made = np.nonzero((lx.src[:n] >= 0) & (lx.kind[:n] >= 3))[0]
    assert len(made) > 10, "the C walk made no whitespace state"
    belows = list(lx.below_ids)
    for i in made.tolist():
        st, src = tab.states[i], tab.states[int(lx.src[i])]
        ctx = belows[int(lx.below[i])]
        assert type(ctx) is WsContext and WsContext.of(st[0]) == ctx and st in tab.ids
        assert ws_of(st[0][0]) == ws_of(src[0][0])


def test_masks_under_a_pending_check_are_keyed_by_text_only_where_read(backend):
    """Under a residual check (a C frame: here the root's `not`, and a string's own), a
    mask whose walk reads no captured text (no token completes the checked value) is
    memoized by the state alone; one that does is keyed by the text too (mask.py _BY_TEXT).
    Masks stay the Python walk's, for texts the check accepts and refuses, and when met
    again along other texts."""
    from lmprog_runtime.constrained.cfg.mask import _BY_TEXT, _capture_start

    tok, be = backend
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"},
                                               "t": {"type": "string", "not": {"const": "xy"}}},
              "not": {"required": ["bad"], "minProperties": 3}}  # (two keywords: a check, not structure)
    texts = ['{"s":"a long string value, with words and more words","n":12}', '{"bad":1}', '{"t":"xy"}',
             '{"t":"xyz","s":"x"}', '{"n":1,"bad":2}', '{"s":"q","bad":[1,2]}']
    for c_walk in (True, False):
        g0 = be.compile("json", json.dumps(schema))
        sh = g0._shared
        sh.engine.use_c, sh.engine._tw, sh.engine._memo = c_walk, None, type(sh.engine._memo)()
        oracle = MaskEngine(sh.machine, sh.engine.vocab, use_c=False)
        assert sum(_walk(tok, g0, oracle, text, schema) for text in texts) > 40
        memo = sh.engine._memo
        by_state = [k for k, v in memo.items() if v is not _BY_TEXT and type(k) is tuple and k[0] != "fast"
                    and len(k) == 1 and _capture_start(k) is not None]
        assert by_state, "no mask under the pending check was kept by its state"
        assert any(v is _BY_TEXT for v in memo.values()), "no mask read the captured text"
        # again, memo kept: masks met along other texts
        assert sum(_walk(tok, g0, oracle, text, schema) for text in reversed(texts)) > 40


def test_masks_under_a_pending_check_are_shared_where_no_text_was_read(backend, monkeypatch):
    """Under the root's check (a C frame: its start is read only with the text), a mask
    whose walk read no text is memoized under its canonical and context keys too, so the
    same place after other keys (an item of `a` after `c` was seen) is a memo hit; a
    mask that read the text (a token may end the checked object) is not shared, and
    every mask is the Python walk's."""
    tok, be = backend
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                                               "b": {"type": "integer"}, "c": {"type": "integer"}},
              "not": {"required": ["bad"], "minProperties": 3}}  # (two keywords: a check, not structure)
    g0 = be.compile("json", json.dumps(schema))
    eng = g0._shared.engine
    oracle = MaskEngine(g0._shared.machine, eng.vocab, use_c=False)
    _walk(tok, g0, oracle, '{"a":[1,2],"b":3}', "first", must_accept=True)
    walked = _walked(monkeypatch, eng, lambda state, hist: bytes(hist))
    monkeypatch.setattr(eng, "_decided_mask", lambda key, hist: None)  # (texts alike by their checks' verdicts: not here)
    _walk(tok, g0, oracle, '{"c":3,"a":[1,2]}', "again", must_accept=True)  # (no sample has c then a)
    assert b'{"c":3,"a":[1,' not in walked, walked  # (after `,` no token ends the object)
    assert b'{"c":3,"a":[1,2' in walked, "a mask that read the text was shared"  # (`]}` may)
    walked.clear()  # (inside a key no token gets past the value's first byte: its text is never read)
    _walk(tok, g0, oracle, '{"a":[1],"bad":1}', "key", must_accept=False)
    _walk(tok, g0, oracle, '{"b":2,"bad":1}', "key again", must_accept=False)
    assert not [h for h in walked if h.endswith(b'"bad')], walked  # (keys seen differ, its near key does not)


def test_steps_filled_without_a_derivation_per_byte_match_python_walk(backend):
    """Table steps that are not derived byte by byte: bytes no string pattern takes are dead
    when the state is interned (strings.py string_bytes), and one derived step is copied to
    the bytes that step alike (canonical.py alike_bytes: a count-only string body's
    characters, a free number's digits). The pattern tokens walk the class table in sorted
    order (table_walk.c cfg_class_walk resumes at the prefix a token shares with the one
    before). A quote after `\\` in a key is a step of the table, not a close read in
    Python. Value starts a rule cannot take are not candidates (machine.py value_starts),
    in both walks: valid texts must be accepted whole."""
    tok, be = backend
    cases = [
        ({"type": "object", "properties": {
            "d": {"type": "string", "format": "date"}, "w": {"type": "string", "pattern": "^[a-z\u00e9]+$"},
            "u": {"type": "string", "pattern": "^\\p{L}*$"},
            "two": {"type": "string", "allOf": [{"pattern": "^[a-z]"}, {"pattern": "[0-9]$"}], "maxLength": 5}}},
         ['{"d":"2024-01-05","w":"\u00e9t\u00e9","u":"\u00c5ngstr\u00f6m\u03a9"}', '{"w":"a\u00e9\\u00e9"}',
          '{"two":"ab12","u":"x"}'],
         ['{"u":"x\\ud83d\\ude00"}', '{"d":"2024-13-01"}', '{"w":"A"}', '{"d":"\u00e9"}', '{"two":"abcd12"}']),
        ({"type": "object", "properties": {"i": {"type": "integer"}, "n": {"type": "number"},
                                           "b": {"type": "number", "maximum": 50}, "e": {"enum": [1, 2.5, "x"]},
                                           "k": {"enum": ["abc", "abd", "x y"]}},
          "additionalProperties": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3},
                                             {"type": "null"}]}},
         ['{"i":-120,"n":-0.125,"b":49.5,"e":2.5,"k":"abd"}', '{"k":"x y"}', '{"i":1.0,"n":10.50}', '{"n":-7.0e3,"i":10}',
          '{"x":12,"y":"abc","z":null,"w":-7}', '{"q\\"x":1,"p\\\\y":null,"\\"":"a"}'],
         ['{"i":1.5}', '{"k":"abx"}', '{"y":"abcd"}', '{"b":51}', '{"n":01}', '{"i":-01}']),
        ({"type": "array", "items": {"anyOf": [{"type": "boolean"}, {"const": None},
                                               {"type": "string", "minLength": 2}]}},
         ['[true,null,"ab"]', '["a b c d",false]'], ['[false,"a"]', '[1]', '[{}]', '[nul]']),
        ({"type": ["string", "null"], "maxLength": 3}, ['"abc"', "null", '"a\\"b"'], ['"abcd"', "12"]),
        # UTF-8 lead bytes of each decoder state (C2-DF, E0, E1-EC / EE-EF, ED, F0, F1-F3,
        # F4) and every continuation byte's range, in count-only values and FREE keys
        ({"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
          "additionalProperties": {"type": "string"}},
         ['{"s":"\u00e9\U0001f4a9\u4e2d\u0800","\u043a\u043b\u044e\u0447":"\ud7ff\ue000\uffef\u1100\U000f0000"}',
          '{"\U00010000\U000e0041":"\U00100000\U0010ffff\u07ff\u00ff"}'],
         ['{"s":"\u00e9\u00e9\u00e9\u00e9\u00e9"}']),
    ]
    n = 0
    for schema, valid, invalid in cases:
        g0 = be.compile("json", json.dumps(schema))
        oracle = MaskEngine(g0._shared.machine, g0._shared.engine.vocab, use_c=False)
        for _ in range(2):  # (again with the mask LRU emptied: the table's steps read back)
            g0._shared.engine._memo.clear()
            n += sum(_walk(tok, g0, oracle, text, schema, must_accept=True) for text in valid)
            n += sum(_walk(tok, g0, oracle, text, schema) for text in invalid)
        assert _audit_steps(g0._shared.machine, g0._shared.engine._tw.table) > 100
        if schema is cases[0][0]:
            tab = g0._shared.engine._tw.table
            assert any(len(st) == 1 and st[0][0][0] == "S" and st[0][0][6] and tab.trans[i * 256 + 0xC3] == -2
                       for i, st in enumerate(tab.states)), "no pattern state had its lead bytes dead at interning"
        if schema is cases[-1][0]:  # (a lead byte's step filled for its whole group, a continuation's for its range)
            tab = g0._shared.engine._tw.table
            rows = [tab.trans[i * 256:(i + 1) * 256] for i, st in enumerate(tab.states)
                    if len(st) == 1 and st[0][0][0] == "S" and not st[0][0][3] and tab.trans[i * 256 + 0xE4] >= 0]
            assert rows and all((row[0xE1:0xED] == row[0xE4]).all() and (row[0xEE:0xF0] == row[0xE4]).all()
                                and (row[0xC2:0xE0] == row[0xC3]).all() for row in rows)
    assert n > 300


def _audit_steps(machine, tab) -> int:
    """Every filled transition of the table (derived, copied, or dead at interning) is the
    matcher's step from its state, canonical; a string frame's node aside (lexeme rows share
    steps across the nodes of one shape); and every liveness known (set at interning, or
    derived) is the one-byte lookahead's. Steps that read the output text are skipped.
    Returns how many transitions were checked."""
    def shape(state):
        return tuple((st[0][:1] + st[0][2:], st[1]) if st[0][0] == "S" else st for st in state)

    n = 0
    for s in range(len(tab.states)):
        st = tab.states[s]
        for b in range(256):
            t = int(tab.trans[s * 256 + b])
            if t < 0 and t != DEAD:
                continue
            try:
                nxt = machine.advance(st, b, 0, _no_ctx)
            except NeedsText:
                continue
            if t == DEAD:
                assert not nxt, (st, b)
            else:
                assert shape(tab.canon(nxt)) == shape(tab.states[t]), (st, b)  # (the vocabulary's canonical)
            n += 1
        if tab.lives[s] in (1, 2):  # (a liveness set at interning, or derived: the lookahead's verdict)
            cands = machine.candidates(st)
            try:
                lives = (cands is None or machine.complete(st) or machine.accepting(st, 0, _no_ctx)
                         or any(machine.advance(st, c, 0, _no_ctx) for c in cands))
            except NeedsText:
                continue
            assert tab.lives[s] == (1 if lives else 2), st
    return n


def test_keys_seen_are_cut_to_those_a_token_can_close_when_masks_are_shared(backend, monkeypatch):
    """Masks inside an object key are memoized with the keys seen cut to those that begin
    with the text typed (a closed object: its names still open there; an open one: only
    those a token can close, i.e. whose rest a token spells before its quote) and, for an
    undeclared key no check reads, without its text: a key position met again after other
    keys is a memo hit, and every mask is the Python walk's, duplicates included (and a
    key whose first character is an escaped quote right after the walk's root: that quote
    opens nothing)."""
    tok, be = backend
    vocab = be.vocab
    assert vocab.keys_stop_at_value and b"" in vocab.quote_heads  # SmolLM2: at most `":"` past a key
    assert _past_value_start(b'":1') and _past_value_start(b'":""') and _past_value_start(b'x" : {"')
    assert not _past_value_start(b'":"') and not _past_value_start(b'abc') and not _past_value_start(b'" :[')
    open_obj = {"type": "object", "properties": {"name": {"type": "integer"}, "nam": {"type": "string"},
                                                  "port": {"type": "integer"}}}
    closed = {**open_obj, "additionalProperties": False}
    texts = ['{"name":1,"port":2}', '{"port":2,"name":1}', '{"port":2,"nam":"x","name":1}', '{"nam":"x","nam":"y"}',
             '{"":1,"":2}', '{"":1,"\\"":2,"":3}', '{"foo":1,"bar":2,"baz":3}', '{"name":1,"name":2}',
             '{"port":1,"nom":2}']
    for schema in (open_obj, closed):
        g0 = be.compile("json", json.dumps(schema))
        eng = g0._shared.engine
        oracle = MaskEngine(g0._shared.machine, vocab, use_c=False)
        walked = _walked(monkeypatch, eng)
        assert sum(_walk(tok, g0, oracle, text, schema) for text in texts) > (60 if schema is open_obj else 40)
        keys = [(st[0][0][7], st[0][1][0][3]) for st in walked if st[0] is not None and st[0][0][0] == "S"
                and st[0][1] is not None and st[0][1][0][0] == "O" and st[0][1][0][4] is None]
        if schema is open_obj:  # a key's start after any keys but "" (a token closes it: `"`): one walk
            assert {k for k in keys if k[0] == ""} == {("", frozenset({""}))}, keys  # (right after `"`, `\\`)
            assert not [k for k in keys if k[0] in ("bar", "baz")], keys  # undeclared texts alike
        else:  # closed: the names seen with the text typed as prefix tell masks apart, nothing else
            near = [(typed, frozenset(k for k in seen if k.startswith(typed))) for typed, seen in keys]
            assert len(set(near)) == len(near), keys
    g1 = be.compile("json", json.dumps(open_obj))
    for tid in tok.encode('{"port":1,"na', add_special_tokens=False):
        g1.accept_token(tid)
    near = g1._shared.engine._key_near(None, g1.state, None)
    assert near is not None and near[3] == frozenset()  # inside the key "na", "port" seen
    monkeypatch.setattr(vocab, "keys_stop_at_value", False)  # a token could reach past the value: no sharing
    assert g1._shared.engine._key_near(None, g1.state, None) is None


def test_objects_keys_seen_are_read_as_their_checks_when_masks_are_shared(backend, monkeypatch):
    """A value's masks are memoized with each object it is inside told by what a token can
    still ask of its keys seen (may `,` follow, may `}`, are names left), so the same
    property met after other keys shares them; every mask is still the Python walk's:
    maxProperties, a closed object's last name, names left by propertyNames, required,
    dependentRequired and nested objects closing (`}}`) where the keys seen differ."""
    tok, be = backend
    assert be.vocab.no_key_after_comma and be.vocab.comma_quote_ends  # SmolLM2: `,"` ends a token
    inner = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
             "required": ["x"], "additionalProperties": False}
    schemas = [
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": inner},
         "required": ["a"], "dependentRequired": {"b": ["c"]}, "additionalProperties": False},
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "maxProperties": 2},
        {"type": "object", "properties": {"c": inner, "d": {"type": "array", "items": inner}}, "minProperties": 2},
        {"type": "object", "propertyNames": {"enum": ["p", "q"]}},  # open, but no name left after both
    ]
    texts = ['{"a":1,"b":"x","c":{"x":1}}', '{"b":"x","a":1}', '{"c":{"y":2,"x":1},"a":12}', '{"a":1,"c":{"x":3,"y":4}}',
             '{"b":"q","c":{"x":1},"a":3}', '{"c":{"x":1},"d":[{"x":2},{"y":1,"x":3}]}', '{"d":[{"x":2}],"c":{"x":5}}',
             '{"a":7,"b":"y","z":1}', '{"a":1,"b":"x","a":2}', '{"q":1,"p":2}', '{"p":2,"q":1,"p":3}']
    for schema in schemas:
        g0 = be.compile("json", json.dumps(schema))
        eng = g0._shared.engine
        shared = []
        ctx_key = eng._ctx_key
        monkeypatch.setattr(eng, "_ctx_key", lambda key, state, start: shared.append(1) or ctx_key(key, state, start))
        oracle = MaskEngine(g0._shared.machine, be.vocab, use_c=False)
        assert sum(_walk(tok, g0, oracle, text, schema) for text in texts) > 30
        assert shared and any(k[0] == "ctx" for k in eng._memo), "no mask memoized by its objects' checks"
    monkeypatch.setattr(be.vocab, "no_key_after_comma", False)  # a key could close after `,"`: nothing shared
    g1 = be.compile("json", json.dumps(schemas[0]))
    for tid in tok.encode('{"a":1,"b":"x', add_special_tokens=False):
        g1.accept_token(tid)
    assert g1._shared.engine._ctx_key(None, g1.state, None) is None


def test_below_an_object_that_cannot_close_nothing_is_read_when_masks_are_shared(backend, monkeypatch):
    """Inside an object whose required keys are not all seen, no token reaches its `}`, so
    the objects below it (whatever keys they have seen) do not tell its values' masks
    apart: the second record's value masks are memoized ones, and each is the Python
    walk's (an object that may close keeps the stack below it in the key)."""
    tok, be = backend
    inner = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
             "required": ["x", "y"]}
    schema = {"type": "object", "properties": {"p": inner, "q": inner, "r": {"type": "string"}}, "required": ["r"]}
    g0 = be.compile("json", json.dumps(schema))
    eng = g0._shared.engine
    oracle = MaskEngine(g0._shared.machine, be.vocab, use_c=False)
    assert _walk(tok, g0, oracle, '{"p":{"x":12,"y":3},"r":"a"}', "p", must_accept=True) > 8
    walked = _walked(monkeypatch, eng, lambda state, hist: bytes(hist))
    # (q after p and r: the root may close there, but no token gets past q's value `x`)
    assert _walk(tok, g0, oracle, '{"r":"a","p":{"x":12,"y":3},"q":{"x":12,"y":3}}', "q", must_accept=True) > 8
    assert not [h for h in walked if h.endswith((b'"q":{"x":', b'"q":{"x":1'))], walked
    g = g0.copy()
    for tid in tok.encode('{"r":"a","q":{"x":12', add_special_tokens=False):
        g.accept_token(tid)
    key = eng._ctx_key(None, g.state, None)
    assert key[2][-1] == ("unreached",) and len(key[2]) == 3  # (the number, q's object, then nothing)


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["dev", "suite"])
def test_no_dead_ends_along_corpus_instances(backend, corpus):
    """No token a mask allows leads where nothing may follow: at every state of each valid
    instance, eight allowed tokens (seeded) are each accepted and the next mask (EOS where
    the output may end) is not empty (bounded numbers' prefixes, literals under checks)."""
    import random

    from bench_grammar import SUITE_REMOTES

    from lmprog_runtime.constrained.base import GrammarBackendConfig
    tok, _ = backend
    be = CfgBackend(tok, len(tok), [tok.eos_token_id],
                    config=GrammarBackendConfig(schema_remotes=SUITE_REMOTES if corpus == "suite" else ()))
    rng = random.Random(0)
    dead, n = [], 0
    for case in load_cases(corpus):
        try:
            g0 = be.compile("json", json.dumps(case["schema"]))
        except GrammarError:
            continue
        for t in case["tests"]:
            if not t["valid"]:
                continue
            g = g0.copy()
            for tid in tok.encode(compact(t["data"]), add_special_tokens=False):
                row = np.zeros(len(tok), dtype=np.bool_)
                g.write_mask(row)
                for c in rng.sample(np.flatnonzero(row).tolist(), min(8, int(row.sum()))):
                    if c == tok.eos_token_id:
                        continue
                    h = g.copy()
                    h._states, h._hist, h._ends = list(g._states), bytearray(g._hist), list(g._ends)
                    try:
                        h.accept_token(c)
                    except GrammarError:  # (the mask allowed a token the matcher refuses)
                        dead.append((case["name"], bytes(g._hist)[-30:], tok.decode([c]), "refused"))
                        continue
                    nxt = np.zeros(len(tok), dtype=np.bool_)
                    h.write_mask(nxt)
                    n += 1
                    if not nxt.any():
                        dead.append((case["name"], bytes(g._hist)[-30:], tok.decode([c])))
                g.accept_token(tid)
    assert n > 10000 and not dead, dead[:10]


def test_compile_leaves_the_table_room_to_grow(backend):
    """After the warm-up the table holds TABLE_HEADROOM times its states, TABLE_LEAST at
    least (growing copies every array: a pause paid at compile time, not in a request's
    mask), and growing keeps the states and transitions."""
    from lmprog_runtime.constrained.cfg.backend import TABLE_HEADROOM, TABLE_LEAST
    tok, be = backend
    schema = {"type": "object", "properties": {f"p{k}": {"type": ["string", "integer"]} for k in range(12)}}
    g0 = be.compile("json", json.dumps(schema))
    tab = g0._shared.engine._tw.table
    n = int(tab.lexrows.n[0])
    assert n > 64 and len(tab.lives) >= max(n * TABLE_HEADROOM, TABLE_LEAST)
    assert len(be.compile("json", '{"type": "integer"}')._shared.engine._tw.table.lives) >= TABLE_LEAST
    trans = tab.trans[:n * 256].copy()
    tab.reserve(4 * len(tab.lives))
    assert len(tab.lives) >= 4 * n and (tab.trans[:n * 256] == trans).all() and int(tab.lexrows.n[0]) == n
    oracle = MaskEngine(g0._shared.machine, g0._shared.engine.vocab, use_c=False)
    assert _walk(tok, g0, oracle, compact({"p3": "abc", "p0": 7}), schema, must_accept=True) > 5


def test_a_closed_objects_key_start_is_the_union_of_its_names_left(backend, monkeypatch):
    """At the first byte of a closed object's key, the mask is the union of each name left's
    own tokens (MaskEngine._names_left, memoized per object and name, made in the compile's
    warm-up): keys met in another order walk nothing at their starts, and every mask is the
    Python walk's (a name that is a prefix of another, a name that needs an escape, a
    value's first byte after `":`)."""
    tok, be = backend
    names = ["id", "idx", "name", "na\"me", "tags", "when"]
    schema = {"type": "object", "additionalProperties": False,
              "properties": {n: {"type": ["string", "integer", "array", "object"]} for n in names}}
    g0 = be.compile("json", json.dumps(schema))
    first = compact({"id": 1, "idx": "a", "name": [], "na\"me": {}, "tags": 2, "when": "x"})
    again = compact({"when": "y", "tags": [1], "na\"me": 3, "idx": {}, "name": "z", "id": 7})
    walked = _walked_again(tok, g0, monkeypatch, first, again)
    starts = [st for st in walked if st[0][0][0] == "S" and st[0][0][7] == "" and st[0][0][1].enum is not None
              and len(st[0][0][1].enum) > 1]
    assert not starts, "a key start walked again"
    eng = g0._shared.engine
    assert len(eng._names) == len(names)  # (made by the compile's warm-up)
    eng._names.clear()  # names not made then: a request's key start is one walk, not one per name
    eng._memo.clear()
    walked = _walked_again(tok, g0, monkeypatch, "{}", again)
    assert not eng._names and [st for st in walked if st[0][0][0] == "S" and st[0][0][7] == ""]
