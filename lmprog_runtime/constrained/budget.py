"""Compile budget of a constraint: its size before compiling, and the size of the automaton
it would unroll to, so that `a{1000000}` or `{"minLength": 1000000}` is refused in
microseconds instead of taking gigabytes. Time is the third limit (base.py's timer).

The estimate counts NFA positions after counted repetitions are unrolled, which is how
outlines-core (regex-automata) builds its automaton: `x{m,n}` costs n copies of x,
`x{m,}` costs m + 1, alternatives add up. It is a lower bound on the DFA's size."""
from __future__ import annotations

try:  # Python >= 3.11
    import re._constants as _c
    import re._parser as _parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]

from lmprog_runtime.constrained.base import GrammarError

_REPEATS = (_c.MAX_REPEAT, _c.MIN_REPEAT) + ((_c.POSSESSIVE_REPEAT,) if hasattr(_c, "POSSESSIVE_REPEAT") else ())


def check_spec_size(kind: str, spec: str, max_bytes: int) -> None:
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise GrammarError(f"Failed to compile {kind} grammar: the spec is {size} bytes, over the compile "
                           f"budget of {max_bytes} bytes (LMPROG_GRAMMAR_MAX_SPEC_BYTES)")


def check_regex_budget(kind: str, regex: str, max_positions: int) -> None:
    """GrammarError when `regex` unrolls to more than `max_positions` NFA positions."""
    try:
        tree = _parser.parse(regex)
    except Exception as exc:  # noqa: BLE001 - re.error, RecursionError, OverflowError
        if kind != "regex":  # our own translation: outlines-core's dialect, not always Python's
            return
        raise GrammarError(f"Failed to compile {kind} grammar: not a valid regular expression "
                           f"(Python `re` syntax): {exc}") from None
    size = _positions(tree, max_positions)
    if size > max_positions:
        raise GrammarError(f"Failed to compile {kind} grammar: it unrolls to more than {max_positions} "
                           f"automaton positions, over the compile budget (LMPROG_GRAMMAR_MAX_STATES); "
                           "use smaller repetition counts or lengths")


def _positions(items, cap: int) -> int:
    """NFA positions of a parsed (sub)pattern, saturating a little above `cap`."""
    total = 0
    for op, arg in items:
        if op in _REPEATS:
            lo, hi, sub = arg
            copies = hi if hi != _c.MAXREPEAT else lo + 1
            total += _positions(sub, cap) * max(copies, 1)
        elif op == _c.SUBPATTERN:
            total += _positions(arg[-1], cap)
        elif op == _c.BRANCH:
            total += sum(_positions(b, cap) for b in arg[1])
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            total += _positions(arg[1], cap)
        elif op not in (_c.AT,):
            total += 1
        if total > cap:
            return cap + 1
    return total
