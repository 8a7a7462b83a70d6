"""The pushdown matcher of a compiled value grammar, one byte at a time.

A parse state is a tuple of stacks (one per live alternative of an anyOf/oneOf: a
GLR-style set, deduplicated). A stack is a cons list `(frame, rest)`, frames are tuples, so
states are immutable, hashable and shared: rollback is keeping the old state, and the
token-trie walk branches without copying. Frames (first field = kind):

    ("V", node, ws)                            a value of `node` may start; ws: whitespace regex state
    ("O", node, phase, seen, key, ws)          object; phase 0 `{` 1 key 2 value 3 `,` 4 in value
                                               (key EXTRA only in mask-table states: canonical.py)
    ("A", node, phase, count, seen, ws)        array; phase 0 `[` 2 item 3 `,` 4 in item (count: _counted)
    ("S", node, count, utf, esc, hs, pats, text)  string body: char count, UTF-8 (need, cp, lo, hi, raw) / escape
                                               decoder states, pending high surrogate, regex
                                               states, text (kept for keys and enums only)
    ("N", node, text, d)                       number text and its JSON-number DFA state
    ("L", literal, i)                          true / false / null, i bytes read
    ("C", node, start)                         residual check of the value starting at byte `start`
    ("U", start)                               capture of a uniqueItems array item
    ("R", term, utf)                           a whole-output regex (the `regex` kind)
    ("D", done)                                bottom; done = 1 once the root value is complete

`ctx(start, end)` returns output bytes [start, end) (committed output + the bytes being
tried), read only when a captured value completes.
"""
from __future__ import annotations

import threading
from typing import Optional

from lmprog_runtime.constrained.cfg.nodes import Node
from lmprog_runtime.constrained.cfg.residual import Residual, canonical
from lmprog_runtime.constrained.cfg.strings import EXTRA, Ctx, StringFrames, _enum_first_bytes, utf8_start  # noqa: F401

WS = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
# JSON number DFA: 0 start, 1 '-', 2 '0', 3 int, 4 '.', 5 frac, 6 'e', 7 exp sign, 8 exp
_NUM: list[dict[int, int]] = [{} for _ in range(9)]
for _d in DIGITS:
    _NUM[0][_d] = _NUM[1][_d] = 2 if _d == 0x30 else 3
    _NUM[3][_d] = 3
    _NUM[4][_d] = _NUM[5][_d] = 5
    _NUM[6][_d] = _NUM[7][_d] = _NUM[8][_d] = 8
_NUM[0][0x2D] = 1
for _s in (2, 3):
    _NUM[_s][0x2E] = 4
for _s in (2, 3, 5):
    _NUM[_s][0x65] = _NUM[_s][0x45] = 6
_NUM[6][0x2B] = _NUM[6][0x2D] = 7
NUM_COMPLETE = frozenset((2, 3, 5, 8))
NUMBER_BYTES = frozenset().union(*_NUM)  # every byte a number may take
# per DFA state, the bytes it takes in the order a number's continuation is most often
# found (a bound passed by more digits often admits a fraction, a lower one more digits)
NUMBER_STEPS = [tuple(sorted(d, key=b".0e9E12345678+-".index)) for d in _NUM]
MAX_NUMBER_CHARS = 400
# arrays and objects open at once: a `[` or `{` past it is refused (a bound, like every JSON
# parser's: Python's json module fails near 1,000 levels, serde_json at 128; each level is a
# frame of the state, so past it a mask costs more per level and the state's tuples more
# than Python compares before a RecursionError)
MAX_NESTING = 128


_VALUE_START = frozenset(b'"{[-0123456789tfn')


class NeedsText(Exception):
    """A table derivation read what a table state does not hold (the output text through
    ctx, a uniqueItems array's items): the step is not a function of the state (PYTHON)."""


class _AnySeen:
    """The items seen of a uniqueItems array in a table state (ANY_SEEN): they are read only
    where an item completes, which reads the item's text first (its U frame's check: a
    PYTHON step, replayed from the concrete state), so no table step reads them and the
    states inside and between items are one whatever came before (before the first item
    none are seen: a table state keeps the empty set, and its first item's end reads no
    text: `finish`). A step that reads them (a literal item's end checked at its first
    byte: Machine._literal_ends) is NeedsText."""

    __slots__ = ()

    def __contains__(self, item):
        raise NeedsText

    __or__ = __contains__

    def __repr__(self):
        return "ANY_SEEN"


ANY_SEEN = _AnySeen()
_FIRST_ITEM = object()  # (finish: a table state's first unique item, its value unread)
_KIND_OF = {0x22: "string", 0x7B: "object", 0x5B: "array", 0x74: "boolean", 0x66: "boolean", 0x6E: "null",
            **dict.fromkeys(b"-0123456789", "number")}  # (a value's kind by its first byte: Node.checked_kinds)
_FOLLOW = {"O": WS | frozenset(b",}"), "A": WS | frozenset(b",]"), "D": frozenset()}
_OBJ = {0: WS | frozenset(b'"}'), 1: WS | frozenset(b":"), 2: WS | frozenset(b",}"), 3: WS | frozenset(b'"')}
_ARR = {0: WS | _VALUE_START | frozenset(b"]"), 2: WS | frozenset(b",]"), 3: WS | _VALUE_START}
_NUM_NEXT = [frozenset(d) for d in _NUM]
_LEAD_BYTE = [frozenset((b,)) for b in range(256)]  # (a literal's next byte)
_NOTHING = frozenset()


def _follow(rest) -> frozenset:
    """Bytes that may come right after a complete value on top of `rest` (a superset)."""
    while rest[0][0] in ("C", "U"):
        rest = rest[1]
    return _FOLLOW[rest[0][0]]


class Machine(StringFrames):
    def __init__(self, root: Optional[Node], pool, residual: Optional[Residual], child_of, ws0: int,
                 regex_term: Optional[int] = None, whole_integers: bool = False):
        """ws0: the whitespace pattern's start state (a RegexPool term) between JSON tokens;
        whole_integers: an integer takes no fraction, not even a zero one (draft-04 and older:
        dialect.whole_integers)."""
        self.root, self.pool, self.residual, self.ws0 = root, pool, residual, ws0
        self.whole_integers = whole_integers
        self._child_of = child_of  # (node, key) -> Node | None
        # reads.log: where this thread's mask walk records the output text it reads (a check's
        # (start, text, rule, verdict); None for a uniqueItems item's value): MaskEngine._masked
        self.reads = threading.local()
        self.regex_term = regex_term
        self._starts: dict = {}  # node -> the bytes its values may start with (value_starts)
        self._starts_ws: dict = {}  # node -> those and the whitespace bytes (candidates of a V frame)
        self._pattern_bytes: dict = {}  # string patterns -> bytes (strings.py string_bytes)

    def initial(self) -> tuple:
        if self.regex_term is not None:
            return (((("R", self.regex_term, 0)), None),)
        return ((("V", self.root, self.pool.EPS), (("D", 0), None)),)  # no whitespace before the root

    # ------------------------------------------------------------ driving
    def advance(self, state: tuple, b: int, pos: int, ctx: Ctx) -> tuple:
        out: list = []
        for st in state:
            out.extend(self.step(st, b, pos, ctx))
        return tuple(dict.fromkeys(out)) if len(out) > 1 else tuple(out)

    def accepting(self, state: tuple, pos: int, ctx: Ctx) -> bool:
        for st in state:
            top = st[0]
            if top[0] == "D" and top[1]:
                return True
            if top[0] == "R" and top[2] == 0 and self.pool.nullable(top[1]):
                return True
            # (only a number that is the whole output can end it: `finish` reaches the
            # document frame through C / U frames alone; nested ones skip number_ok)
            if (top[0] == "N" and top[3] in NUM_COMPLETE and st[1] is not None and st[1][0][0] in ("D", "C", "U")
                    and top[1].number_ok(top[2])):
                if any(s[0] == ("D", 1) for s in self.finish(st[1], None, pos, ctx)):
                    return True
        return False

    def candidates(self, state: tuple):
        """A superset of the bytes `advance` may accept from `state` (frozenset), or None for
        "any": lets the trie walk skip subtrees without stepping into them."""
        if len(state) == 1:  # (the frozenset itself: its hash is kept, the mask table's rows are keyed by it)
            return self._candidates_of(state[0])
        out: set = set()
        for st in state:
            got = self._candidates_of(st)
            if got is None:
                return None
            out.update(got)
        return out

    def _candidates_of(self, st):
        """`candidates` of one stack: a frozenset shared by every caller (never changed), or
        None for "any"."""
        top = st[0]
        kind = top[0]
        if kind == "O":
            return _OBJ.get(top[2], WS)
        if kind == "A":
            return _ARR.get(top[2], WS)
        if kind == "V":
            got = self._starts_ws.get(top[1])
            if got is None:
                got = self._starts_ws[top[1]] = self.value_starts(top[1]) | WS
            return got
        if kind == "L":
            return _LEAD_BYTE[ord(top[1][top[2]])]
        if kind == "N":
            return _NUM_NEXT[top[3]] | _follow(st[1]) if top[3] in NUM_COMPLETE else _NUM_NEXT[top[3]]
        if kind == "D":
            return _NOTHING
        if kind == "S" and top[1].enum is not None and not top[3] and not top[4]:
            return _enum_first_bytes(top[1], top[7])
        return None

    def value_starts(self, node: Node) -> frozenset:
        """A superset of the first bytes of `node`'s values (start_value's cases), so that a
        walk does not step `{` into a string rule (memoized per node)."""
        got = self._starts.get(node)
        if got is None:
            self._starts[node] = _VALUE_START  # (meanwhile: a superset, were alts ever to cycle)
            if node.never:
                got = frozenset()
            elif node.alts is not None:
                got = frozenset().union(*(self.value_starts(alt) for alt in node.alts))
            else:
                out = {ord(lit[0]) for lit in node.literals}
                if "string" in node.types:
                    out.add(0x22)
                if "object" in node.types:
                    out.add(0x7B)
                if "array" in node.types:
                    out.add(0x5B)
                if node.allows_number():
                    out.update(DIGITS, (0x2D,))
                got = frozenset(out)
            self._starts[node] = got
        return got

    def complete(self, state: tuple) -> bool:
        """No byte can follow: every alternative is done."""
        return bool(state) and all(st[0] == ("D", 1) or (st[0][0] == "R" and st[0][1] == self.pool.EPS)
                                   for st in state)

    def step(self, st, b: int, pos: int, ctx: Ctx) -> list:
        top, rest = st
        kind = top[0]
        if kind == "S":
            return self._string(top, rest, b, pos, ctx)
        if kind == "V":
            if b in WS:
                ws = self.pool.step(top[2], b)
                return [(("V", top[1], ws), rest)] if ws != self.pool.NONE else []
            if not self.pool.nullable(top[2]):
                return []
            return self.start_value(rest, top[1], b, pos, ctx)
        if kind == "O":
            return self._object(top, rest, b, pos, ctx)
        if kind == "A":
            return self._array(top, rest, b, pos, ctx)
        if kind == "N":
            return self._number(top, rest, b, pos, ctx)
        if kind == "L":
            lit, i = top[1], top[2]
            if b != ord(lit[i]):
                return []
            return self.finish(rest, None, pos + 1, ctx) if i + 1 == len(lit) else [(("L", lit, i + 1), rest)]
        if kind == "R":
            return self._regex(top, rest, b)
        return []  # D: nothing after the root value

    def _literal_ends(self, lit: str, rest, pos: int, ctx: Ctx) -> bool:
        """Literal `lit`, begun at byte `pos`, completes where a pending check (C / U frame
        below it) lets it: the check read on the text with the literal's bytes to come."""
        end = pos + len(lit)
        tail = lit.encode()

        def ahead(start: int, stop: int) -> bytes:
            if start >= stop:  # (an empty read: finish's probe for an abstracted key, which ctx answers)
                return ctx(min(start, pos), min(stop, pos))
            head = ctx(start, pos) if start < pos else b""
            return head + tail[max(start - pos, 0):stop - pos]
        return bool(self.finish(rest, None, end, ahead))

    def start_value(self, rest, node: Node, b: int, pos: int, ctx: Ctx, entered: tuple = ()) -> list:
        """entered: the alternatives' nodes this value's start is already inside. A schema
        can be one of its own alternatives (`{"anyOf": [..., {"$ref": "#", ...}]}`): met
        again, such a node's values are those it starts with above, under more checks
        (a subset), so it is not expanded again."""
        if node.never:
            return []
        if node.residual is not None and (node.checked_kinds is None or _KIND_OF.get(b) in node.checked_kinds):
            rest = (("C", node, pos), rest)  # (a value of a kind the check passes whatever it is: none)
        if node.alts is not None:
            out: list = []
            entered += (node,)
            for alt in node.alts:
                if alt not in entered:
                    out.extend(self.start_value(rest, alt, b, pos, ctx, entered))
            return out
        types = node.types
        if b == 0x22:
            if "string" not in types or (node.enum is not None and not node.enum):
                return []
            text = "" if node.enum is not None else None
            return [(("S", node, 0, 0, 0, 0, node.patterns, text), rest)]
        if b == 0x7B:
            if "object" not in types or _nested_full(rest):
                return []
            return [(("O", node, 0, frozenset(), None, self.ws0), rest)]
        if b == 0x5B:
            if "array" not in types or _nested_full(rest):
                return []
            return [(("A", node, 0, 0, frozenset() if node.unique else None, self.ws0), rest)]
        if b in DIGITS or b == 0x2D:
            if not node.allows_number() or not node.number_prefix_ok(chr(b)):
                return []
            return [(("N", node, chr(b), _NUM[0][b]), rest)]
        for lit in node.literals:
            if b == ord(lit[0]):
                if len(lit) > 1 and _checked(rest) and not self._literal_ends(lit, rest, pos, ctx):
                    return []  # (its end is certain: a check it fails there is a dead end now, not later)
                return [(("L", lit, 1), rest)]
        return []

    # ------------------------------------------------------------ completion
    def finish(self, rest, result, end: int, ctx: Ctx) -> list:
        """The value on top of `rest` just completed (its text ends at byte `end`)."""
        top = rest[0]
        kind = top[0]
        if kind == "D":
            return [(("D", 1), rest[1])]
        if kind == "C":
            text = ctx(top[2], end)
            ok = self.residual.valid_text(text, top[1].residual)
            log = getattr(self.reads, "log", None)
            if log is not None:
                log.append((top[2], text, top[1].residual, ok))
            if not ok:
                return []
            return self.finish(rest[1], result, end, ctx)
        if kind == "U":
            below = rest[1][0]
            if top[1] < 0 and below[0] == "A" and below[4] is not None and not below[4]:
                # a table state's (unplaced) first item: none seen to compare it with, and the
                # items seen after it are ANY_SEEN whatever it is, so its text is not read
                return self.finish(rest[1], _FIRST_ITEM, end, ctx)
            value = canonical(ctx(top[1], end))
            log = getattr(self.reads, "log", None)
            if log is not None:
                log.append(None)
            return self.finish(rest[1], value, end, ctx)
        if kind == "A":
            seen = top[4]
            if seen is not None:
                if result is _FIRST_ITEM:
                    seen = ANY_SEEN
                elif result in seen:
                    return []
                else:
                    seen = seen | {result}
            return [(("A", top[1], 2, _counted(top[1], top[3] + 1), seen, self.ws0), rest[1])]
        if kind == "O":
            node, phase, seen = top[1], top[2], top[3]
            if phase == 4:
                if top[4] is EXTRA:  # an abstracted key (a table state) is read here: ctx raises
                    ctx(end, end)
                    raise RuntimeError("an abstracted object key reached a concrete match")
                return [(("O", node, 2, seen | {top[4]}, None, self.ws0), rest[1])]
            return self._key_done(top, rest[1], result)
        return []

    def _key_done(self, top, rest, key: str) -> list:
        node, seen = top[1], top[3]
        if key in seen or self._child_of(node, key) is None or not key_leaves_room(node, seen, key):
            return []
        kn = node.key_node
        if kn is not None and kn.residual is not None and not self.residual.valid(key, kn.residual):
            return []
        return [(("O", node, 1, seen, key, self.ws0), rest)]

    # ------------------------------------------------------------ containers
    def _object(self, top, rest, b: int, pos: int, ctx: Ctx) -> list:
        _, node, phase, seen, key, ws = top
        if b in WS:
            ws = self.pool.step(ws, b)
            return [(("O", node, phase, seen, key, ws), rest)] if ws != self.pool.NONE else []
        if not self.pool.nullable(ws):
            return []
        if phase == 1:
            if b != 0x3A:
                return []
            child = node.additional if key is EXTRA else self._child_of(node, key)
            return [(("V", child, self.ws0), (("O", node, 4, seen, key, 0), rest))]
        if b == 0x22 and phase in (0, 3):
            if node.max_props is not None and len(seen) >= node.max_props:
                return []
            kn = key_rule(node, seen)
            if kn.never or "string" not in kn.types or (kn.enum is not None and not kn.enum):
                return []
            return [(("S", kn, 0, 0, 0, 0, kn.patterns, ""), (("O", node, phase, seen, None, 0), rest))]
        if b == 0x7D and phase in (0, 2):
            if not (node.required <= seen and len(seen) >= node.min_props):
                return []
            for k in seen:
                deps = node.dep_required.get(k)
                if deps and not set(deps) <= seen:
                    return []
            return self.finish(rest, None, pos + 1, ctx)
        if b == 0x2C and phase == 2:
            if node.max_props is not None and len(seen) >= node.max_props:
                return []
            if node.additional is None and not node.pattern_props and len(seen) >= len(node.props):
                return []
            if (node.key_node.enum is not None or crowded(node)) and key_rule(node, seen).enum == ():
                return []  # (no key left: its enum's all seen, or none leaves room for those still required)
            return [(("O", node, 3, seen, None, self.ws0), rest)]
        return []

    def _array(self, top, rest, b: int, pos: int, ctx: Ctx) -> list:
        _, node, phase, count, seen, ws = top
        if b in WS:
            ws = self.pool.step(ws, b)
            return [(("A", node, phase, count, seen, ws), rest)] if ws != self.pool.NONE else []
        if not self.pool.nullable(ws):
            return []
        if b == 0x5D and phase in (0, 2):
            return self.finish(rest, None, pos + 1, ctx) if count >= node.min_items else []
        if b == 0x2C:
            if phase != 2 or (node.max_items is not None and count >= node.max_items):
                return []
            item = _item(node, count)  # (a comma only before an item some value can be)
            if item is None or item.never or (seen is not None and _exhausted(item, seen)):
                return []
            return [(("A", node, 3, count, seen, self.ws0), rest)]
        if phase == 2:
            return []
        item = _item(node, count)
        if item is None:
            return []
        if seen and (item.num_enum or item.enum):
            item = _unseen(item, seen)
        inner = (("A", node, 4, count, seen, 0), rest)
        if seen is not None:
            inner = (("U", pos), inner)
        return self.start_value(inner, item, b, pos, ctx)

    def _number(self, top, rest, b: int, pos: int, ctx: Ctx) -> list:
        _, node, text, d = top
        nd = _NUM[d].get(b)
        if nd is not None:
            if len(text) >= MAX_NUMBER_CHARS:
                return []
            if node.integer_only() and (nd >= 6 or (nd == 5 and b != 0x30) or (nd == 4 and self.whole_integers)):
                return []  # integers: digits, or a zero fraction (1.0 is an integer but in draft-04); no exponent
            if not (node.number_prefix_ok(text + chr(b)) if nd <= 5 else node.number_exponent_ok(text + chr(b))):
                return []
            return [(("N", node, text + chr(b), nd), rest)]
        if d not in NUM_COMPLETE or not node.number_ok(text):
            return []
        out: list = []
        for st in self.finish(rest, None, pos, ctx):
            out.extend(self.step(st, b, pos, ctx))
        return out

    # ------------------------------------------------------------ strings
def _nested_full(rest) -> bool:
    """MAX_NESTING arrays and objects are open in `rest` (one O / A frame each)."""
    n = 0
    while rest is not None:
        if rest[0][0] in ("O", "A"):
            n += 1
            if n >= MAX_NESTING:
                return True
        rest = rest[1]
    return False


def _checked(rest) -> bool:
    """A pending check (C / U frame) reads the value on top of `rest` when it completes."""
    return rest is not None and rest[0][0] in ("C", "U")


def _counted(node: Node, count: int) -> int:
    """An array's item count as its frame keeps it: exact up to the largest count any of its
    checks tells apart (minItems, maxItems, the prefixItems), then that count, so that the
    items past it (each of an unbounded array's) are in one state, not one per index."""
    return min(count, max(node.min_items, len(node.prefix), node.max_items or 0))


def _item(node: Node, i: int) -> Optional[Node]:
    return node.prefix[i] if i < len(node.prefix) else node.items


MAX_DOMAIN = 64  # an item rule's values counted (`_domain`) up to this many
MAX_VARIANTS = 256  # an item rule's variants for the items seen (`_unseen`) at most


def _domain(node: Node) -> Optional[frozenset]:
    """The values (residual.canonical's forms) of every value `node`'s own keywords admit
    (a superset of its values: a check may refuse some), where they are at most MAX_DOMAIN:
    literals, an enum's strings and numbers; None where they are more (memoized on the node)."""
    got = node._child.get("__domain__", False)
    if got is not False:
        return got
    if node.never:
        got = frozenset()
    elif (node.alts is not None or node.types & {"object", "array"}
          or ("string" in node.types and node.enum is None)
          or (node.allows_number() and node.num_enum is None)):
        got = None
    else:
        values = {("z",) if lit == "null" else ("b", lit == "true") for lit in node.literals}
        if "string" in node.types:
            values.update(("s", v) for v in node.enum)
        if node.allows_number():
            values.update(_number_value(v) for v in node.num_enum)
        got = frozenset(values) if len(values) <= MAX_DOMAIN else None
    node._child["__domain__"] = got
    return got


def _number_value(v) -> tuple:
    return ("n", v.normalize() if v else v.__class__(0))


def _exhausted(item: Node, seen) -> bool:
    """A uniqueItems array's next item (of rule `item`) can only equal one seen: every value
    the rule admits is among them (a comma there would begin an item no value can finish).
    Reads the items seen: NeedsText in a table state (ANY_SEEN), for a rule of few values."""
    domain = _domain(item)
    return domain is not None and all(v in seen for v in domain)


def _unseen(item: Node, seen) -> Node:
    """An item rule whose enum's strings and numbers are less those seen (a uniqueItems
    array): a value only a seen one can finish (`[1,1` under enum [1, 2], `["abc","a` under
    enum ["abc", "x"]) is stopped at its first byte, as one that leaves the enum is. Reads
    the items seen (NeedsText in a table state: ANY_SEEN)."""
    if seen is ANY_SEEN:
        raise NeedsText
    strings = tuple(v for v in item.enum if ("s", v) in seen) if item.enum else ()
    numbers = tuple(v for v in item.num_enum if _number_value(v) in seen) if item.num_enum else ()
    if not strings and not numbers:
        return item
    key = ("__unseen__", strings, numbers)
    if key not in item._child:
        made = item._child.get("__unseen_made__", 0)
        if made >= MAX_VARIANTS:
            return item  # (the enum whole: a seen member's prefix is refused at the item's end only)
        item._child["__unseen_made__"] = made + 1
    changes = {}
    if strings:
        changes["enum"] = tuple(v for v in item.enum if v not in strings)
    if numbers:
        changes["num_enum"] = tuple(v for v in item.num_enum if v not in numbers)
    return item.twin(key, **changes)


def key_rule(node: Node, seen: frozenset) -> Node:
    """The key rule of an object with `seen` keys: a closed object's enum less those keys,
    so a key prefix typed can always be finished, and under maxProperties, once the keys
    still required fill the room left, those of them that leave room for the rest
    (`key_leaves_room`; memoized on the object node, MAX_VARIANTS sets of seen keys at
    once: outputs write keys in any order, and the node lives as long as its grammar, for
    every request; past it they are made again as met)."""
    kn = node.key_node
    crowds = crowded(node)
    if not crowds and (kn.enum is None or not seen):
        return kn
    memo_key = ("__keys__", seen)
    got = node._child.get(memo_key)
    if got is None:
        made = node._child.get("__keys_made__", 0)
        if made >= MAX_VARIANTS:
            for k in [k for k in list(node._child) if type(k) is tuple and k[0] == "__keys__"]:
                node._child.pop(k, None)
            made = 0
        node._child["__keys_made__"] = made + 1
        names = kn.enum
        if crowds:
            missing = node.still_required(seen)
            if len(missing) >= node.max_props - len(seen):  # (only they fit: one of them is next)
                names = tuple(k for k in (names if names is not None else sorted(missing)) if k in missing)
        if names is not None:
            names = tuple(k for k in names if k not in seen and (not crowds or key_leaves_room(node, seen, k)))
        got = kn if names is None else kn.variant(enum=names)
        got = node._child.setdefault(memo_key, got)
    return got


def crowded(node: Node) -> bool:
    """Keys of the object may crowd out a required one: maxProperties beside required or
    dependentRequired keys."""
    return node.max_props is not None and bool(node.required or node.dep_required)


def key_leaves_room(node: Node, seen: frozenset, key: str) -> bool:
    """Under maxProperties, key `key` after the `seen` keys leaves room for every key then
    still required (Node.still_required: `key`'s own dependencies too): a key that does not
    begins an object nothing can close."""
    if not crowded(node):
        return True
    after = seen | {key}
    return len(node.still_required(after)) <= node.max_props - len(after)
