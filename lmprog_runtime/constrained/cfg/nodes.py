"""Grammar rules of a compiled JSON Schema: one `Node` per (sub)schema.

A node is a nonterminal of the value grammar: which value kinds may start here (`types`,
`literals`), the lexeme constraints of its strings (length counters, regex states, an enum
trie) and numbers (exact bounds on the number's text), and the rules of its object members
and array items (other nodes, so `$ref` recursion is a cycle, never an unrolling). `alts`
makes the node a choice between other nodes (anyOf/oneOf); the matcher follows each.

Invariant: the structural language of a node contains every instance valid under its
schema. Keywords the structure does not express exactly put the whole (sub)schema into
`residual`, which the matcher checks on the value's text the moment the value is complete,
so the combination accepts exactly the valid instances.
"""
from __future__ import annotations

from decimal import MAX_EMAX, MIN_EMIN, ROUND_CEILING, ROUND_FLOOR, Context, Decimal, localcontext
from typing import Optional

_EXACT = Context(prec=2000, Emax=MAX_EMAX, Emin=MIN_EMIN)  # number checks are exact on JSON-sized numbers
ALL_TYPES = frozenset(("null", "boolean", "object", "array", "string", "number", "integer"))


class Node:
    __slots__ = ("schema", "types", "literals", "min_len", "max_len", "patterns", "enum", "lo", "lo_excl",
                 "hi", "hi_excl", "multiple_of", "integer", "num_enum", "props", "pattern_props", "additional",
                 "required", "min_props", "max_props", "dep_required", "key_node", "prefix", "items",
                 "min_items", "max_items", "unique", "alts", "residual", "checked_kinds", "never", "_child", "name")

    def __init__(self, schema=None):
        self.schema = schema
        self.types = ALL_TYPES
        self.literals = frozenset(("true", "false", "null"))
        self.min_len, self.max_len = 0, None          # characters (code points), as JSON Schema counts
        self.patterns: tuple[int, ...] = ()           # RegexPool start states, all must match
        self.enum: Optional[tuple[str, ...]] = None   # sorted allowed strings
        self.lo: Optional[Decimal] = None
        self.lo_excl = False
        self.hi: Optional[Decimal] = None
        self.hi_excl = False
        self.multiple_of: Optional[Decimal] = None
        self.integer = False                          # numbers must be integral
        self.num_enum: Optional[tuple[Decimal, ...]] = None  # an enum's numbers: a number must equal one
        self.props: dict[str, "Node"] = {}
        self.pattern_props: tuple[tuple[int, "Node"], ...] = ()
        self.additional: Optional["Node"] = None      # None: undeclared keys are refused
        self.required: frozenset = frozenset()
        self.min_props, self.max_props = 0, None
        self.dep_required: dict[str, tuple[str, ...]] = {}
        self.key_node: Optional["Node"] = None        # string rule for keys (propertyNames, closed keys)
        self.prefix: tuple["Node", ...] = ()
        self.items: Optional["Node"] = None           # None: no items past the prefix
        self.min_items, self.max_items = 0, None
        self.unique = False
        self.alts: Optional[tuple["Node", ...]] = None
        self.residual = None                          # schema checked on the complete value's text
        self.checked_kinds: Optional[frozenset] = None  # the value kinds the check may refuse (None: all)
        self.never = False
        self._child: dict = {}
        self.name = ""

    def variant(self, **changes) -> "Node":
        """A copy of this rule with `changes` made, and a memo (`_child`) of its own."""
        got = Node(self.schema)
        for slot in Node.__slots__:
            setattr(got, slot, getattr(self, slot))
        got._child = {}
        for name, value in changes.items():
            setattr(got, name, value)
        return got

    def twin(self, key, **changes) -> "Node":
        """`variant(**changes)` made once per rule and `key` (memoized in `_child`, one node
        also when two threads make it at once, so states built from it are equal)."""
        got = self._child.get(key)
        if got is None:
            got = self._child.setdefault(key, self.variant(**changes))
        return got

    def allows_string(self) -> bool:
        return "string" in self.types

    def allows_number(self) -> bool:
        return "number" in self.types or "integer" in self.types

    def still_required(self, seen: frozenset = frozenset()) -> set:
        """The keys an object of this rule with `seen` keys must still have: its required
        keys and those dependentRequired by a key seen, with theirs in turn (each key that
        must come brings its own)."""
        out = set(self.required)
        for k in seen:
            out.update(self.dep_required.get(k) or ())
        todo = list(out)
        while todo:
            for k in self.dep_required.get(todo.pop()) or ():
                if k not in out:
                    out.add(k)
                    todo.append(k)
        return out - seen

    def integer_only(self) -> bool:
        return self.integer or ("integer" in self.types and "number" not in self.types)

    def number_ok(self, text: str) -> bool:
        """The complete JSON number `text` satisfies the node's number rules (exactly, in decimal)."""
        if self.multiple_of is None:
            got = self._scaled_ok(text)
            if got is not None:
                return got
        try:
            with localcontext(_EXACT):
                return self._number_ok(Decimal(text))
        except ArithmeticError:  # an exponent past any double: no bound can be decided on it
            return False

    def number_prefix_ok(self, text: str) -> bool:
        """Some completion of the number prefix `text` (sign, integer digits, fraction; no
        exponent) can lie within [lo, hi] or equal a number of the enum: a number drifting
        out of bounds, or away from every enum value, is stopped at the digit that leaves
        them, not left to grow forever. With an enum the bounds are not read: its members
        are those within them (schema.py _numbers_meeting), so every spelling of one is
        taken (`0.2e1` for 2 under `minimum: 0.5`, whose mantissa alone is below it; read
        apart, the two checks took `0` and then no digit both take)."""
        if self.num_enum is None:
            if self.lo is None and self.hi is None:
                return True
            got = self._scaled_prefix_ok(text)
            if got is not None:
                return got
        try:
            with localcontext(_EXACT):
                if self.num_enum is not None:
                    return any(_enum_mantissa_ok(text, v, not self.integer_only()) for v in self.num_enum)
                if self.lo is None and self.hi is None:
                    return True
                whole = self.integer_only()
                return any(self._meets(*span) for span in _reachable(text, self._bound_digits(), whole))
        except ArithmeticError:
            return True

    def number_exponent_ok(self, text: str) -> bool:
        """Some completion of `text`, a number prefix inside its exponent (`1.5e`, `2E-0`),
        equals a number of the enum (true without one: bounds read the complete text)."""
        if self.num_enum is None:
            return True
        try:
            with localcontext(_EXACT):
                return any(_enum_exponent_ok(text, v) for v in self.num_enum)
        except ArithmeticError:
            return True

    def _bound_digits(self) -> int:
        return max(len(str(abs(int(x)))) for x in (self.lo, self.hi) if x is not None) + 1

    def _scaled(self):
        """The bounds as integers in units of 10^-scale: (scale, lo, hi, `_bound_digits`), or
        False where a bound has more than SCALED_DIGITS digits or places (memoized): the
        checks on a number's text then run on Python integers, exactly, as the decimal ones."""
        got = self._child.get(_SCALED)
        if got is None:
            got = False
            bounds = [x for x in (self.lo, self.hi) if x is not None]
            if bounds and all(x.is_finite() and -SCALED_DIGITS <= x.as_tuple().exponent and x.adjusted() < SCALED_DIGITS
                              for x in bounds):
                scale = max(max(-x.as_tuple().exponent for x in bounds), 0)
                got = (scale, _units(self.lo, scale), _units(self.hi, scale), self._bound_digits())
            got = self._child.setdefault(_SCALED, got)
        return got

    def _scaled_prefix_ok(self, text: str) -> Optional[bool]:
        """number_prefix_ok without an enum, on integers (`_scaled`), or None where the text
        or the bounds are not of that kind (the decimal check then)."""
        got = self._scaled()
        parts = _decimal_parts(text) if got else None
        if parts is None:
            return None
        neg, ip, dot, frac = parts
        scale, lo, hi = _at_places(got, len(frac))
        more = got[3]
        unit, whole = 10 ** scale, self.integer_only()
        if dot or ip == "0":
            v = int(ip + frac) * 10 ** (scale - len(frac))
            spans = [(v, v, True, True) if whole else (v, v + 10 ** (scale - len(frac)), True, False)]
        else:
            d = int(ip) * unit
            spans = [(d * 10 ** k, (d + unit) * 10 ** k, True, False) for k in range(more + 1)]
            spans.append((d * 10 ** (more + 1), _INF, True, False))
        for a, b, a_in, b_in in spans:
            if neg:
                a, b, a_in, b_in = -b, -a, b_in, a_in
            if self._meets_scaled(a, b, a_in, b_in, lo, hi, unit, whole):
                return True
        return False

    def _meets_scaled(self, a, b, a_in: bool, b_in: bool, lo, hi, unit: int, whole: bool) -> bool:
        """`_meets` on integers in units of 1 / `unit` (a or b may be an infinite float)."""
        if lo is not None and (lo > a or (lo == a and self.lo_excl)):
            a, a_in = lo, not self.lo_excl
        if hi is not None and (hi < b or (hi == b and self.hi_excl)):
            b, b_in = hi, not self.hi_excl
        if whole:  # (the first and last whole number of the span, in units)
            if type(a) is int:
                a, a_in = (-(-a // unit) if a_in else a // unit + 1) * unit, True
            if type(b) is int:
                b, b_in = (b // unit if b_in else -(-b // unit) - 1) * unit, True
        return a < b or (a == b and a_in and b_in)

    def _scaled_ok(self, text: str) -> Optional[bool]:
        """number_ok without multipleOf, on integers (`_scaled`; bounds alone: True), or None
        where the text (an exponent) or the bounds are not of that kind."""
        got = self._scaled() if self.lo is not None or self.hi is not None else (0, None, None, 0)
        parts = _decimal_parts(text) if got else None
        if parts is None:
            return None
        neg, ip, _, frac = parts
        if self.integer_only() and frac.strip("0"):
            return False
        scale, lo, hi = _at_places(got, len(frac))
        v = int(ip + frac) * 10 ** (scale - len(frac))
        v = -v if neg else v
        if lo is not None and (v < lo or (self.lo_excl and v == lo)):
            return False
        return hi is None or not (v > hi or (self.hi_excl and v == hi))

    def _meets(self, a: Decimal, b: Decimal, a_in: bool, b_in: bool) -> bool:
        """The interval from a to b (each end in it where `a_in` / `b_in`) holds a value
        within the bounds (an integer, for an integer rule): exactly, so that no digit is
        offered after which no number within them can follow."""
        lo, lo_in = a, a_in
        if self.lo is not None and (self.lo > lo or (self.lo == lo and self.lo_excl)):
            lo, lo_in = self.lo, not self.lo_excl
        hi, hi_in = b, b_in
        if self.hi is not None and (self.hi < hi or (self.hi == hi and self.hi_excl)):
            hi, hi_in = self.hi, not self.hi_excl
        if self.integer_only():
            first = lo.to_integral_value(ROUND_CEILING) if lo_in else lo.to_integral_value(ROUND_FLOOR) + 1
            last = hi.to_integral_value(ROUND_FLOOR) if hi_in else hi.to_integral_value(ROUND_CEILING) - 1
            return first <= last
        return lo < hi or (lo == hi and lo_in and hi_in)

    def _number_ok(self, value: Decimal) -> bool:
        if self.integer_only() and value != value.to_integral_value():
            return False
        if self.lo is not None and (value < self.lo or (self.lo_excl and value == self.lo)):
            return False
        if self.hi is not None and (value > self.hi or (self.hi_excl and value == self.hi)):
            return False
        if self.multiple_of is not None:
            q = value / self.multiple_of
            if q != q.to_integral_value():
                return False
        return True

    def __repr__(self) -> str:
        return f"Node({self.name or sorted(self.types)})"


SCALED_DIGITS = 40  # bounds with at most this many digits before or after the point are checked on integers
_SCALED = ("__scaled__",)  # (Node._child key: the bounds as integers, Node._scaled)
_INF = float("inf")


def _units(x: Optional[Decimal], scale: int) -> Optional[int]:
    """Decimal x as an integer in units of 10^-scale (exactly: scale is at least its places)."""
    if x is None:
        return None
    sign, digits, exp = x.as_tuple()
    v = int("".join(map(str, digits)) or "0") * 10 ** (exp + scale)
    return -v if sign else v


def _decimal_parts(text: str) -> Optional[tuple]:
    """(negative, integer digits, ".", fraction digits) of a number's text without exponent
    (the point and fraction may be empty), or None."""
    neg = text[:1] == "-"
    ip, dot, frac = (text[1:] if neg else text).partition(".")
    if not ip.isdigit() or not ip.isascii() or (frac and not (frac.isdigit() and frac.isascii())):
        return None
    return neg, ip, dot, frac


def _at_places(scaled: tuple, places: int) -> tuple:
    """(scale, lo, hi) of `Node._scaled`'s bounds, in units of 10^-places where a text has
    more places than they."""
    scale, lo, hi = scaled[:3]
    if places <= scale:
        return scale, lo, hi
    f = 10 ** (places - scale)
    return places, None if lo is None else lo * f, None if hi is None else hi * f


def _reachable(text: str, max_more: int, whole: bool = False):
    """Intervals (a, b, a in it, b in it) covering exactly the values a number prefix (no
    exponent) can complete to: `12` to [12, 13) (its fraction) and [120, 130), [1200, 1300)
    ... (more digits), `1.5` to [1.5, 1.6); `whole`: an integer rule's, whose fraction can
    only be zeros (`12` is then 12 or [120, 129] ..., `12.` is 12)."""
    neg = text.startswith("-")
    body = text[1:] if neg else text
    inf = Decimal("Infinity")
    spans = []
    if not body:
        spans.append((Decimal(0), inf, True, False))
    else:
        ip, dot, frac = body.partition(".")
        if dot or ip == "0":
            v = Decimal(f"{ip}.{frac}" if frac else ip)
            spans.append((v, v, True, True) if whole else (v, v + Decimal(1).scaleb(-len(frac)), True, False))
        else:
            d = Decimal(ip)
            for k in range(max_more + 1):
                spans.append((d.scaleb(k), (d + 1).scaleb(k), True, False))
            spans.append((d.scaleb(max_more + 1), inf, True, False))
    for a, b, a_in, b_in in spans:
        yield (-b, -a, b_in, a_in) if neg else (a, b, a_in, b_in)


def _enum_mantissa_ok(text: str, v: Decimal, exponent: bool) -> bool:
    """Some JSON number starting with `text` (no exponent yet) equals v. With an exponent
    still possible only the significant digits and the sign decide (the exponent scales);
    without (integers) the integer digits are the value."""
    neg = text.startswith("-")
    if v and neg != (v < 0):
        return False
    ip, dot, frac = text.lstrip("-").partition(".")
    digits = (ip + frac).lstrip("0")
    if not v:
        return not digits
    if exponent:
        sig = "".join(map(str, abs(v).normalize().as_tuple().digits))  # no leading or trailing zeros
        return digits[:len(sig)] == sig[:len(digits)] and not digits[len(sig):].strip("0")
    if v != v.to_integral_value():
        return False
    whole = str(abs(int(v)))
    return (ip == whole) if dot else whole.startswith(ip)


def _enum_exponent_ok(text: str, v: Decimal) -> bool:
    """Some completion of the exponent of `text` (mantissa complete, `e` and maybe a sign
    and digits typed) makes the number equal v."""
    mant, _, exp = text.replace("E", "e").partition("e")
    m = Decimal(mant)
    sign, digits = (exp[0], exp[1:]) if exp[:1] in ("+", "-") else ("", exp)
    if not v or not m:
        return not v and not m  # 0 times any power is 0
    if (m < 0) != (v < 0):
        return False
    ratio = (abs(v) / abs(m)).normalize()
    if ratio.as_tuple().digits != (1,):
        return False  # not a power of ten
    need = ratio.as_tuple().exponent  # v = m * 10**need
    if (sign == "-" and need > 0) or (sign == "+" and need < 0):
        return False
    typed = digits.lstrip("0")
    return str(abs(need)).startswith(typed) if need else not typed
