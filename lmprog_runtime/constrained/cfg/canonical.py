"""Canonical matcher states for the mask table (table.py): what no transition reads but a
lexeme's end abstracted away, so that states recur across masks; and the lexeme frames
(string body, number, literal) whose inside bytes never touch the stack below them.
"""
from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from typing import Optional

import numpy as np

from lmprog_runtime.constrained.cfg.machine import _NUM, ANY_SEEN, MAX_NUMBER_CHARS, NeedsText  # noqa: F401
from lmprog_runtime.constrained.cfg.nodes import _EXACT, _reachable
from lmprog_runtime.constrained.cfg.strings import EXTRA, FREE, utf8_start


def canonical(state: tuple, exponent_free: bool = False) -> tuple:
    """`state` with what no transition but a string's closing quote reads abstracted away:
    a string body's text (kept for keys; enum strings keep theirs) becomes FREE, and with
    no maxLength its character count is clamped at minLength (only `count < minLength`
    is ever read). The table's transitions from such a state are exact for every byte but
    that quote, which `_derive` leaves to the Python walk (PYTHON). An object's key whose
    member rule is additionalProperties becomes EXTRA (`_abstract_key`), and an unbounded
    number's text "0" (`_free_number`), as does that of an integer past its minimum, with
    its rule's free twin (`_met_minimum`; any number's where `exponent_free`: no token
    writes an exponent's digit, VocabInfo.exponent_free); a bounded number's text becomes
    the first text met with the same future under its bounds (`_number_class`)."""
    out = None
    for k, st in enumerate(state):
        if st is None:
            continue
        got = _abstract_key(st)
        if _captures(got):
            got = _unplace(got)
        elif type(got[0]) is tuple and got[0][0] == "A" and got[0][4] and got[0][4] is not ANY_SEEN:
            got = (unplaced(got[0]), got[1])  # (between a uniqueItems array's items)
        if got is not st:
            out = list(state) if out is None else out
            out[k] = st = got
        top = st[0]
        if type(top) is tuple and top[0] == "N":
            got = number_top(top, exponent_free)
            if got is not top:
                out = list(state) if out is None else out
                out[k] = (got, st[1])
            continue
        if type(top) is not tuple or top[0] != "S":
            continue
        node, count, utf, text = top[1], top[2], top[3], top[7]
        if node.enum is not None:
            continue
        if node.max_len is None and count > node.min_len:
            count = node.min_len
        if text is not None:
            text = FREE
        if utf and not top[6] and utf[1:5:3] != (0, b""):  # the partial character's bits are read
            utf = (utf[0], 0, utf[2], utf[3], b"")  # only by patterns and enums (and text: FREE)
        if count != top[2] or text is not top[7] or utf is not top[3]:
            out = list(state) if out is None else out
            out[k] = ((top[0], node, count, utf) + top[4:7] + (text,), st[1])
    if out is None:
        return state
    return (out[0],) if len(out) == 1 else tuple(dict.fromkeys(out))


def number_top(top: tuple, exponent_free: bool = False) -> tuple:
    """A number frame's canonical form (`canonical`'s: nothing below it is read): text "0"
    where `_free_number` or `_met_minimum` allows, its class's text where `_number_class`
    finds one, else the frame itself."""
    node = top[1] if _free_number(top) else _met_minimum(top, exponent_free)
    if node is not None:
        return ("N", node, "0", top[3])
    text = _number_class(top, exponent_free)
    return ("N", top[1], text, top[3]) if text is not None and text != top[2] else top


def _free_number(top) -> bool:
    """A number's text is read only by its bounds and a numeric enum (none here: `number_ok` is then true of
    every complete text without exponent the steps allow), by its exponent's size (so
    exponent states keep their text; the `e` is stepped from the "0" where no token spells
    the 18+ exponent digits whose overflow the mantissa decides, else from the concrete
    state: `free_number_exponent`, table.py `_derive_byte`) and by the MAX_NUMBER_CHARS cap,
    which a walk (at most 256 bytes deep) cannot reach from a text this short: it becomes "0"."""
    node, text = top[1], top[2]
    return _free_node(node) and top[3] <= 5 and text != "0" and len(text) < MAX_NUMBER_CHARS - 257


def _met_minimum(top, exponent_free: bool):
    """The free twin of a number rule bounded by a minimum alone (`_free_twin`), where the
    number's text already meets it and has no sign: every digit or fraction that follows
    keeps it there, so the rule reads the rest of the mantissa no more than a free one
    does; else None. Integers take no exponent; another number's `e` is stepped from the
    twin's "0" (`free_number_exponent`), whose masks below it are those of every mantissa
    only because no token writes an exponent's digit (`exponent_free`: the exponent cannot
    complete within a walk, and its lookahead byte's prefix checks pass whatever the
    mantissa)."""
    node, text = top[1], top[2]
    if (node.lo is None or node.hi is not None or node.multiple_of is not None or node.num_enum is not None
            or not (exponent_free or node.integer_only()) or not 2 <= top[3] <= 5 or text[0] == "-"
            or len(text) >= MAX_NUMBER_CHARS - 257):
        return None
    value = Decimal(text.rstrip("."))  # (states 2-5: digits, then a fraction begun; no exponent)
    if value < node.lo or (node.lo_excl and value == node.lo):
        return None
    return _free_twin(node)


def _classed(node, exponent_free: bool) -> bool:
    """A bounded number rule whose texts `_number_class` may stand for one another: bounds
    alone (no multipleOf, no enum), and no exponent a token's digits could complete (an
    integer takes none; another number's `e` is stepped from the concrete state:
    `class_exponent`)."""
    return ((node.lo is not None or node.hi is not None) and node.multiple_of is None and node.num_enum is None
            and (exponent_free or node.integer_only()))


def _number_class(top, exponent_free: bool) -> Optional[str]:
    """The representative text of a bounded number's text (digits begun, no exponent): the
    first text of its rule met with the same sign, DFA state and relation to the bounds of
    every span of values its completions reach (nodes._reachable: [12, 13), [120, 130) ...
    or [1.5, 1.6)), each wholly inside, wholly outside; None where one is partly inside
    (the digits to come decide) or the rule is not `_classed`. Texts alike so have the
    same future: each completion's value lies in the span of its level, which decides
    `number_ok` and every prefix check (`number_prefix_ok`: any span of the longer text
    meets the bounds; each lies within one of this text's), so the steps from either are
    the same. Memoized on the rule."""
    node, text, d = top[1], top[2], top[3]
    if d not in (3, 4, 5) or len(text) >= MAX_NUMBER_CHARS - 257 or not _classed(node, exponent_free):
        return None
    whole = node.integer_only()
    sig = [d, text[0] == "-"]
    with localcontext(_EXACT):
        for span in _reachable(text, node._bound_digits(), whole):
            if not node._meets(*span):
                sig.append(False)
            elif _within(node, *span, whole):
                sig.append(True)
            else:
                return None
    return node._child.setdefault((_CLASS, tuple(sig)), text)


def _within(node, a: Decimal, b: Decimal, a_in: bool, b_in: bool, whole: bool) -> bool:
    """Every value of the span from a to b (each end in it where `a_in` / `b_in`; integers
    only where `whole`) lies within the node's bounds (the span holds one: `_meets`)."""
    if whole:  # (its first and last integers)
        a, a_in = (a.to_integral_value(ROUND_CEILING) if a_in else a.to_integral_value(ROUND_FLOOR) + 1), True
        b, b_in = (b.to_integral_value(ROUND_FLOOR) if b_in else b.to_integral_value(ROUND_CEILING) - 1), True
    if node.lo is not None and (a < node.lo or (a == node.lo and a_in and node.lo_excl)):
        return False
    if node.hi is not None and (b > node.hi or (b == node.hi and b_in and node.hi_excl)):
        return False
    return True


def _free_twin(node):
    """`node` without its minimum (memoized on it: one twin per node, also when two
    threads make it at once, so their canonical states are the same)."""
    return node.twin(_TWIN, lo=None, lo_excl=False)


_TWIN = ("__free__",)  # (a tuple: no property name collides with it in Node._child)
_CLASS = "__class__"  # (Node._child keys (_CLASS, signature) -> a number class's first text)
_CHAR_BYTE = np.zeros(256, dtype=np.bool_)  # one-byte characters of a string body (strings.py _char)
_CHAR_BYTE[0x20:0x80] = True
_CHAR_BYTE[[0x22, 0x5C]] = False
_CHAR_BYTES = np.nonzero(_CHAR_BYTE)[0]
_DIGITS = np.arange(0x30, 0x3A)  # (number digits: the JSON-number DFA of machine.py)
# UTF-8 lead bytes by the decoder state they start (strings.py utf8_start: bytes still
# needed and the next byte's bounds; the code point's bits are not kept where no pattern or
# enum reads them): C2-DF, E1-EC with EE-EF, F1-F3 step alike; E0, ED, F0, F4 alone
_LEADS: dict = {}
for _b in range(0xC2, 0xF5):
    _LEADS.setdefault(utf8_start(_b)[0:1] + utf8_start(_b)[2:4], []).append(_b)
_LEAD_GROUP = {b: np.array(g) for g in _LEADS.values() for b in g}


def alike_bytes(state: tuple, b: int) -> Optional[np.ndarray]:
    """Bytes that step canonical `state` where b does (table.py derives b's step and fills
    theirs from it), or None: in a string body that keeps only its count (no pattern, no
    text: an enum's string keeps its text) every one-byte character, the UTF-8 lead bytes
    that start the same decoder state (`_LEAD_GROUP`), and inside a character every next
    byte within its bounds (the bits are dropped: canonical keeps the bounds); in a free number's
    integer or fraction digits ("0" whatever they were) every digit (the fraction's only of
    a non-integer); at the value start of a free number rule the digits 1-9."""
    if len(state) != 1 or state[0] is None or type(state[0][0]) is not tuple:
        return None
    top = state[0][0]
    kind = top[0]
    if kind == "S":
        if top[4] or top[6] or not (top[7] is None or top[7] is FREE):
            return None
        utf = top[3]
        if not utf:
            return _CHAR_BYTES if _CHAR_BYTE[b] else _LEAD_GROUP.get(b)
        if utf[1:5:3] == (0, b"") and utf[2] <= b <= utf[3]:  # (a partial character's bits not kept)
            return np.arange(utf[2], utf[3] + 1)
    elif kind == "N":
        if 0x30 <= b <= 0x39 and top[2] == "0" and _free_node(top[1]):
            if top[3] == 3 or (top[3] in (4, 5) and not top[1].integer_only()):
                return _DIGITS
            if top[3] == 1 and b != 0x30:
                return _DIGITS[1:]
    elif kind == "V":
        node = top[1]
        if 0x31 <= b <= 0x39 and node.alts is None and _free_node(node):
            return _DIGITS[1:]
    return None


def _free_node(node) -> bool:
    """No number rule reads the digits (the text of such a number is "0" in the table)."""
    return node.lo is None and node.hi is None and node.multiple_of is None and node.num_enum is None


def free_number_exponent(state: tuple, b: int) -> bool:
    """Byte b starts the exponent of a number whose text may have been made "0" (stepped
    from that "0" only where no token spells enough exponent digits to read the mantissa:
    table.py `_derive_byte`)."""
    if b not in (0x45, 0x65):
        return False
    tops = [st[0] for st in state if st is not None]
    return any(type(top) is tuple and top[0] == "N" and top[2] == "0" for top in tops)


def class_exponent(state: tuple, b: int, exponent_free: bool) -> bool:
    """Byte b starts the exponent of a bounded number whose text may stand for others
    (`_number_class`): the exponent's value is read with the mantissa's, so the `e` is
    stepped from the concrete state; below it, where no token writes an exponent's digit,
    a token's lookahead byte passes whatever the mantissa (no bound reads an unfinished
    exponent), so the mask there is every mantissa's."""
    if b not in (0x45, 0x65) or not exponent_free:
        return False
    return any(st is not None and type(st[0]) is tuple and st[0][0] == "N" and st[0][3] in (3, 5)
               and _classed(st[0][1], True) for st in state)


def extra_key(node, key) -> bool:
    """Key `key` of object `node` leads to additionalProperties and nothing but the value's
    end reads it (it joins the seen keys there): it may be EXTRA in a table state."""
    return (type(key) is str and node.additional is not None and not node.pattern_props
            and key not in node.props)


def _abstract_key(st):
    """The stack with the key of its object frame EXTRA where `extra_key` allows: the frame
    on top (after the key's closing quote) or under a value's start (after the colon).
    Deeper frames keep their keys (a value's end reads them: such steps would be PYTHON)."""
    top = st[0]
    if top[0] == "O" and top[2] == 1 and extra_key(top[1], top[4]):
        return (top[:4] + (EXTRA,) + top[5:], st[1])
    if top[0] == "V" and st[1] is not None:
        f = st[1][0]
        if f[0] == "O" and f[2] == 4 and extra_key(f[1], f[4]):
            return (top, (f[:4] + (EXTRA,) + f[5:], st[1][1]))
    return st


def _captures(st) -> bool:
    while st is not None:
        frame = st[0]
        if type(frame) is tuple and frame and frame[0] in ("C", "U"):
            return True
        st = st[1]
    return False


def _unplace(st):
    """A stack with its C / U frames' start offsets set to -1 (read only through ctx) and its
    uniqueItems arrays' items seen, where any, ANY_SEEN (`unplaced`); the part below its
    deepest such frame not yet so is the same tuple (a state stepped from a canonical one
    rebuilds only the frames it pushed), and a stack already so is itself."""
    top, nodes, frames, deepest = st, [], [], -1
    while st is not None:
        frame = unplaced(st[0])
        if frame is not st[0]:
            deepest = len(nodes)
        nodes.append(st)
        frames.append(frame)
        st = st[1]
    if deepest < 0:
        return top
    out = nodes[deepest][1]
    for k in range(deepest, -1, -1):
        out = (frames[k], out)
    return out


def unplaced(frame):
    """A C / U frame with its start offset set to -1, a uniqueItems array's items seen (where
    any) ANY_SEEN; any other frame as it is."""
    if frame[0] == "C":
        return frame if frame[2] == -1 else ("C", frame[1], -1)
    if frame[0] == "U":
        return frame if frame[1] == -1 else ("U", -1)
    if frame[0] == "A" and frame[4] and frame[4] is not ANY_SEEN:  # (none seen yet stays so: the
        return frame[:4] + (ANY_SEEN,) + frame[5:]                  # first item reads no text, Machine.finish)
    return frame


def closes_free(state: tuple) -> bool:
    """A quote may close a string whose text is FREE (a key's: its close reads the text).
    Not inside a UTF-8 character or an escape: there the quote is dead, or after `\\` a
    character of the text like any other."""
    for st in state:
        top = st[0] if st is not None else None
        if type(top) is tuple and top[0] == "S" and top[7] is FREE and not top[3] and not top[4]:
            return True
    return False


_ALL = np.ones(256, dtype=np.bool_)
_NONE = np.zeros(256, dtype=np.bool_)
_QUOTE = _NONE.copy()
_QUOTE[0x22] = True
_NUM_EXITS = [~np.isin(np.arange(256), list(d)) for d in _NUM]
EXITS = ("S", "N", "L")  # lexemes: frames whose steps touch the stack below only at their end


def exits(top) -> np.ndarray:
    """bool [256]: the bytes on which lexeme frame `top` may end (and read the stack below):
    a string's closing quote (outside an escape or a UTF-8 sequence), a number's first
    non-number byte, any byte at a literal's last character."""
    kind = top[0]
    if kind == "S":
        return _NONE if top[3] or top[4] else _QUOTE
    if kind == "N":
        return _NUM_EXITS[top[3]]
    return _ALL if top[2] + 1 == len(top[1]) else _NONE


def root_key(root: tuple) -> Optional[bytes]:
    """The text (UTF-8) of the key the walk's root is inside, when it is in plain mode."""
    top = root[0][0] if len(root) == 1 and root[0] is not None else None
    if top is None or top[0] != "S" or type(top[7]) is not str or top[1].enum is not None or top[3] or top[4] or top[5]:
        return None
    try:
        return top[7].encode("utf-8")
    except UnicodeEncodeError:  # (a lone surrogate: spelled only as an escape, never read off a path)
        return None


def root_escaped(root: tuple) -> bool:
    """Whether the walk's root is a string body right after a backslash: its path's first
    byte is an escaped character (a quote there opens no key)."""
    return any(st is not None and type(st[0]) is tuple and st[0][0] == "S" and st[0][4] == 1 for st in root)


def key_parent(root: tuple, canon: tuple, path: bytearray, d: int) -> Optional[tuple]:
    """The concrete state before node d-1 of `path` when it is inside a key string with
    FREE text (`canon`, its canonical form) and the key's text can be read off the path:
    that state with the text put back; None when it cannot be (escapes, a partial
    character, several stacks), then the caller replays the path."""
    if len(canon) != 1 or path[d - 1] != 0x22:
        return None
    top, rest = canon[0]
    if top[0] != "S" or top[7] is not FREE or top[3] or top[4] or top[5]:
        return None
    inside = bytes(path[:d - 1])
    if 0x5C in inside:
        return None
    q = inside.rfind(b'"')
    if q == 0 and root_escaped(root):  # (that quote is the escaped character of the root's `\`)
        return None
    if q >= 0:  # the key opened on the path (no escape: its last quote opened it)
        head, inside = "", inside[q + 1:]
    else:  # it opened before the walk's root, which is inside it
        rtop = root[0][0] if len(root) == 1 else None
        if rtop is None or rtop[0] != "S" or type(rtop[7]) is not str or rtop[3] or rtop[4] or rtop[5]:
            return None
        head = rtop[7]
    try:
        text = head + inside.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return ((top[:7] + (text,), rest),)
