"""A number's bounds are checked on its text exactly; the checks run on Python integers (the
bounds scaled to integers, Node._scaled) where the bounds and the text allow, and must answer
as the decimal checks do, digit by digit and on complete numbers."""
import random
from decimal import Decimal

from lmprog_runtime.constrained.cfg import nodes
from lmprog_runtime.constrained.cfg.nodes import Node

BOUNDS = ["0", "1", "-1", "10", "100", "300", "299.97", "1.1", "-2.5", "0.001", "1e2", "1.50", "-0", "12345678901234",
          "0.30000000000000004", "2E-3", "99.999", "-100"]
TEXTS = ["", "-", "0", "-0", "1", "12", "3", "30", "299", "299.9", "299.97", "299.970", "300", "300.0", "301", "1.",
         "1.1", "1.10", "1.09", "0.", "0.0", "0.00", "0.001", "0.0009", "-2", "-2.", "-2.5", "-2.51", "-3", "99",
         "100", "1000", "100.00001", "12345678901234", "123456789012345", "-100", "-99.5", "-101", "5", "0.3",
         "0.30000000000000004", "0.300000000000000041", "1e2", "1.5E3", "9"]


def _decimal_prefix_ok(node: Node, text: str) -> bool:
    node._child[nodes._SCALED] = False  # (the decimal path alone)
    try:
        return node.number_prefix_ok(text)
    finally:
        del node._child[nodes._SCALED]


def _decimal_ok(node: Node, text: str) -> bool:
    node._child[nodes._SCALED] = False
    try:
        return node.number_ok(text)
    finally:
        del node._child[nodes._SCALED]


def _nodes(rng: random.Random, n: int):
    for _ in range(n):
        node = Node()
        node.types = frozenset(["integer"] if rng.random() < 0.4 else ["number"])
        lo, hi = rng.choice(BOUNDS + [None]), rng.choice(BOUNDS + [None])
        if lo is not None and hi is not None and Decimal(lo) > Decimal(hi):
            lo, hi = hi, lo
        node.lo = None if lo is None else Decimal(lo)
        node.hi = None if hi is None else Decimal(hi)
        node.lo_excl, node.hi_excl = rng.random() < 0.3, rng.random() < 0.3
        yield node


def test_integer_checks_answer_as_the_decimal_ones():
    rng = random.Random(7)
    checked = 0
    for node in _nodes(rng, 400):
        texts = TEXTS + ["".join(rng.choice("0123456789") for _ in range(rng.randint(1, 5))) for _ in range(10)]
        texts += ["-" + t for t in texts[-5:]] + [t + "." + str(rng.randint(0, 999)) for t in texts[-10:-5]]
        for text in texts:
            if node.lo is None and node.hi is None:
                continue
            want = _decimal_prefix_ok(node, text) if "e" not in text.lower() else None
            if want is not None:
                assert node.number_prefix_ok(text) == want, (node.lo, node.lo_excl, node.hi, node.hi_excl,
                                                              node.integer_only(), text)
            if text and text[-1].isdigit():
                assert node.number_ok(text) == _decimal_ok(node, text), (node.lo, node.hi, text)
            checked += 1
        assert node._scaled() or (node.lo is None and node.hi is None)  # (these bounds all take the integer path)
    assert checked > 5000


def test_bounds_out_of_reach_of_integers_stay_decimal():
    node = Node()
    node.types = frozenset(["number"])
    node.hi = Decimal("1e-60")  # (more places than SCALED_DIGITS: the decimal check)
    assert node._scaled() is False
    assert node.number_prefix_ok("0.") and not node.number_prefix_ok("1")
    assert node.number_ok("0.0") and not node.number_ok("0.1")
