"""EBNF (SGLang's GBNF dialect) through the cfg engine: a grammar of rules over characters,
matched by a nondeterministic pushdown recognizer with the same interface as `Machine`
(initial / advance / accepting / complete / candidates), so masks and jump-forward take
the mask.py path of every other constraint.

    root ::= "The capital is " city "."      # rules, string literals, [a-z] classes, `.`,
    city ::= "Paris" | "Rome"                 # ( ) grouping, | * + ? {m,n}, # comments

A state is a tuple of stacks of pending symbols (cons lists); each stack is expanded until
its top is a character class (or it is empty: the grammar may end). Quantifiers become
helper rules at parse time. Left recursion, or a state of more than MAX_STACKS stacks, is
refused with a GrammarError.
"""
from __future__ import annotations

import re
from typing import Optional

from lmprog_runtime.constrained.base import GrammarError
from lmprog_runtime.constrained.cfg.regex import RegexPool, in_ranges, negate, normalize
from lmprog_runtime.constrained.cfg.strings import _UTF8_FLOOR, utf8_start

MAX_STACKS = 2048
MAX_DEPTH = 256
MAX_CLOSURES = 1 << 16  # expanded stacks memoized per grammar (emptied past it: a recursive rule's stacks never recur)
_TOKEN = re.compile(r'\s+|#[^\n]*|::=|"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\{\s*\d*\s*(?:,\s*\d*\s*)?\}|'
                    r'[A-Za-z_][A-Za-z0-9_\-]*|[()|*+?.]')
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^"}


def _unescape(body: str) -> list[int]:
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt in "xuU":
                n = {"x": 2, "u": 4, "U": 8}[nxt]
                out.append(int(body[i + 2:i + 2 + n], 16))
                i += 2 + n
                continue
            out.append(ord(_ESCAPES.get(nxt, nxt)))
            i += 2
            continue
        out.append(ord(ch))
        i += 1
    return out


def _char_class(body: str) -> tuple:
    neg = body.startswith("^")
    cps = _unescape(body[1:] if neg else body)
    ranges, i = [], 0
    while i < len(cps):
        if i + 2 < len(cps) and cps[i + 1] == ord("-"):
            ranges.append((cps[i], cps[i + 2]))
            i += 3
        else:
            ranges.append((cps[i], cps[i]))
            i += 1
    return negate(ranges) if neg else normalize(ranges)


class Grammar:
    """Parsed rules: name -> tuple of alternatives, each a tuple of symbols
    (("t", ranges) a character, ("n", name) a rule)."""

    def __init__(self, text: str):
        self.rules: dict[str, list[tuple]] = {}
        self._toks = self._tokenize(text)
        self._i = 0
        self._n = 0
        while self._i < len(self._toks):
            name = self._take()
            if self._take() != "::=":
                raise GrammarError(f"Failed to compile ebnf grammar: expected `::=` after {name!r}")
            self.rules.setdefault(name, []).extend(self._alternatives())
        if "root" not in self.rules:
            raise GrammarError("Failed to compile ebnf grammar: no `root` rule")
        for alts in self.rules.values():
            for alt in alts:
                for sym in alt:
                    if sym[0] == "n" and sym[1] not in self.rules:
                        raise GrammarError(f"Failed to compile ebnf grammar: undefined rule {sym[1]!r}")

    def _tokenize(self, text: str) -> list[str]:
        out, pos = [], 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                raise GrammarError(f"Failed to compile ebnf grammar: unexpected {text[pos:pos + 20]!r}")
            tok = m.group(0)
            if not tok.isspace() and not tok.startswith("#"):
                out.append(tok)
            pos = m.end()
        return out

    def _take(self) -> str:
        if self._i >= len(self._toks):
            raise GrammarError("Failed to compile ebnf grammar: unexpected end")
        self._i += 1
        return self._toks[self._i - 1]

    def _peek(self) -> Optional[str]:
        return self._toks[self._i] if self._i < len(self._toks) else None

    def _rule_starts(self) -> bool:
        return self._i + 1 < len(self._toks) and self._toks[self._i + 1] == "::="

    def _alternatives(self) -> list[tuple]:
        alts = [self._sequence()]
        while self._peek() == "|":
            self._i += 1
            alts.append(self._sequence())
        return alts

    def _sequence(self) -> tuple:
        out: list = []
        while self._peek() not in (None, "|", ")") and not self._rule_starts():
            atom = self._atom()
            out.extend(self._quantified(atom))
        return tuple(out)

    def _atom(self) -> list:
        tok = self._take()
        if tok.startswith('"'):
            return [("t", ((cp, cp),)) for cp in _unescape(tok[1:-1])]
        if tok.startswith("["):
            return [("t", _char_class(tok[1:-1]))]
        if tok == ".":
            return [("t", negate(((0x0A, 0x0A),)))]
        if tok == "(":
            alts = self._alternatives()
            if self._take() != ")":
                raise GrammarError("Failed to compile ebnf grammar: missing `)`")
            return [self._helper(alts)]
        if tok[0].isalpha() or tok[0] == "_":
            return [("n", tok)]
        raise GrammarError(f"Failed to compile ebnf grammar: unexpected {tok!r}")

    def _helper(self, alts: list[tuple]) -> tuple:
        self._n += 1
        name = f"__g{self._n}"
        self.rules[name] = list(alts)
        return ("n", name)

    def _quantified(self, atom: list) -> list:
        tok = self._peek()
        if tok not in ("*", "+", "?") and not (tok or "").startswith("{"):
            return atom
        self._i += 1
        body = tuple(atom)
        if tok == "?":
            return [self._helper([body, ()])]
        if tok in ("*", "+"):
            star = self._helper([])
            self.rules[star[1]] = [body + (star,), ()]
            return list(body) + [star] if tok == "+" else [star]
        lo_s, _, hi_s = tok[1:-1].replace(" ", "").partition(",")
        lo = int(lo_s or 0)
        hi = None if ("," in tok and not hi_s) else int(hi_s or lo)
        out = list(body) * lo
        if hi is None:
            star = self._helper([])
            self.rules[star[1]] = [body + (star,), ()]
            return out + [star]
        opt = ()
        for _ in range(hi - lo):  # x{0,k}: nested optionals, one rule per level
            opt = (self._helper([body + opt, ()]),)
        return out + list(opt)


class EbnfMachine:
    """The recognizer (Machine's interface; no captures, no semantic checks)."""

    def __init__(self, text: str):
        self.grammar = Grammar(text)
        self.pool = RegexPool(16)
        self._closure: dict = {}
        self.initial()  # left recursion and ambiguity blow-ups fail here, at compile time

    def initial(self) -> tuple:
        return tuple(self._expand((("n", "root"), None)))

    def _expand(self, stack) -> list:
        got = self._closure.get(stack)
        if got is None:
            out: dict = {}
            self._expand_into(stack, out, 0)
            if len(self._closure) >= MAX_CLOSURES:  # (shared by every request of the grammar: bounded)
                self._closure.clear()
            got = self._closure[stack] = list(out)
            if len(got) > MAX_STACKS:
                raise GrammarError(f"ebnf grammar: more than {MAX_STACKS} parses at once")
        return got

    def _expand_into(self, stack, out: dict, depth: int) -> None:
        if stack is None or stack[0][0] == "t":
            out[stack] = None
            return
        sym, rest = stack
        if depth > MAX_DEPTH:  # only leading rules nest here: a chain this long is left recursion
            raise GrammarError(f"Failed to compile ebnf grammar: rule {sym[1]!r} is left-recursive")
        for alt in self.grammar.rules[sym[1]]:
            st = rest
            for s in reversed(alt):
                st = (s, st)
            self._expand_into(st, out, depth + 1)

    def advance(self, state: tuple, b: int, pos: int, ctx=None) -> tuple:
        out: dict = {}
        for st in state:
            for nxt in self._step(st, b):
                out[nxt] = None
        return tuple(out)

    def _step(self, st, b: int) -> list:
        if st is None:
            return []
        top, rest = st
        if top[0] == "u":
            _, need, acc, lo, hi = top
            if not lo <= b <= hi:
                return []
            acc = (acc << 6) | (b & 0x3F)
            if need > 1:
                return [(("u", need - 1, acc, 0x80, 0xBF), rest)] if self._can(rest, acc, need - 1) else []
            return self._match(rest, acc)
        if b < 0x80:
            return self._match(st, b)
        u = utf8_start(b)
        if u is None or not self._can(st, u[1], u[0]):
            return []
        return [(("u",) + u, st)]

    def _can(self, st, acc: int, need: int) -> bool:
        lo = max(acc << 6 * need, _UTF8_FLOOR[need])
        hi = (acc << 6 * need) | ((1 << 6 * need) - 1)
        return st is not None and any(a <= hi and lo <= z for a, z in st[0][1])

    def _match(self, st, cp: int) -> list:
        if st is None or not in_ranges(st[0][1], cp):
            return []
        return self._expand(st[1])

    def accepting(self, state: tuple, pos: int = 0, ctx=None) -> bool:
        return any(st is None for st in state)

    def complete(self, state: tuple) -> bool:
        return bool(state) and all(st is None for st in state)

    def candidates(self, state: tuple):
        out: set = set()
        for st in state:
            if st is None:
                continue
            top = st[0]
            if top[0] == "u":
                out.update(range(top[3], top[4] + 1))
                continue
            for lo, hi in top[1]:
                out.update(range(lo, min(hi, 0x7F) + 1))
                if hi >= 0x80:
                    return None  # non-ASCII characters: let the walk try every lead byte
        return out
