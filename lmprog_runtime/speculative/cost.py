"""What a draft costs and what it is worth, from measured step times (the rule by which
speculation turns itself down).

Measured: the wall time of every scheduler step whose requests all decode or verify (no
prefill chunk in it), per batch-size bucket B:
  - plain steps (no drafts): P(B), the time of a decode step, an EMA, beside an EMA of the
    batch sizes it was measured at (a bucket past 8 holds several sizes: 9..16 share one);
  - verify steps with D draft tokens in all: y = t - P(B), the extra time, fitted online
    as y = s + m * D (weighted least squares over recent steps, EMA weights): `m` is the
    seconds one more draft token adds to the step, `s` the fixed cost of verifying at all
    (the per-request verify, the drafts' grammar masks, a draft tree's gathered attention).

Worth: an accepted draft token saves one plain decode step's share of a token,
c = P(B) / B seconds, B the mean batch size P(B) was measured at: dividing by the step's own
batch size instead overstated c wherever a bucket's steps were mostly larger than this one
(a draining batch of 16 at 10: P measured around 13-16), and with it the drafts' worth. A
verify step at batch b within a bucket is fitted against P(B) b / B, the plain step scaled
to its size. A request whose drafts are accepted position after position with
probability a (its `Acceptance`) gains a^j expected tokens from its j-th draft token, so
its draft length is the largest k with a^k * c >= m (`draft_length`): 0 where even the
first draft does not pay. A step verifies only when the gain of all its drafts together,
c * sum_i sum_j a_i^j, exceeds s + m * D (`worth_it`); otherwise it runs as a plain decode.

Until a bucket has both kinds of measurement (its own, or interpolated between measured
buckets on both sides) the model abstains (None) and the caller falls back to its default
budget; without a plain step time the caller runs plain steps to measure one. At batch 1
on any device m << c, so drafts stay long; at large batch on a CPU m approaches c and only
well-accepted drafts remain.
"""

from __future__ import annotations

from typing import Dict

DECAY = 0.9           # EMA weight of the past per measurement
MIN_PLAIN = 4.0       # plain steps (EMA weight) a bucket needs before the model speaks
MIN_VERIFY = 6.0      # verify steps (EMA weight) likewise
# Acceptance prior: a = (successes + 0.25) / (successes + failures + 0.5); 1/2 with no data.
# With ACCEPT_DECAY the failures of a request that never accepts reach 1 / (1 - 0.8) = 5, so
# its a bottoms out at 0.25 / 5.5 = 0.045 (with a prior of 0.5 + 0.5: 0.083, which at batch 1,
# where a 1-token verify costs a few % of a step, kept such requests verifying forever).
PRIOR_SUCCESS = 0.25
PRIOR_FAILURE = 0.25
ACCEPT_DECAY = 0.8    # per verify, for a request's acceptance counts


def bucket(batch: int) -> int:
    """Batch sizes 1..8 exactly, then powers of two (16, 32, ...)."""
    if batch <= 8:
        return batch
    return 1 << (batch - 1).bit_length()


class _Fit:
    """EMA-weighted sums for y = s + m * x."""

    __slots__ = ("w", "x", "y", "xx", "xy")

    def __init__(self):
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = DECAY
        self.w, self.x, self.y = d * self.w + 1, d * self.x + x, d * self.y + y
        self.xx, self.xy = d * self.xx + x * x, d * self.xy + x * y

    def solve(self):
        """(s, m), both >= 0; with too little spread in x to tell them apart, all of y is
        the fixed cost s (a forward's cost grows little with a few more tokens: the premise
        of speculative decoding; the spread comes as draft lengths change)."""
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var > 0.25:
            m = max(0.0, (self.xy / self.w - mx * my) / var)
            s = max(0.0, my - m * mx)
            return s, m
        return max(0.0, my), 0.0


class StepCost:
    """Per bucket: P (plain), and the (s, m) fit of verify steps. A bucket not measured
    itself but lying between two that are gets their linear interpolation in the batch
    size (a decode step's time grows smoothly with it), so a draining batch (16 → 8 → ...
    → 1) does not measure every size on the way."""

    def __init__(self):
        self.plain: Dict[int, list] = {}  # bucket -> [EMA weight, EMA of step seconds, EMA of batch sizes]
        self.fits: Dict[int, _Fit] = {}

    def observe(self, batch: int, drafts: int, seconds: float) -> None:
        """One step of `batch` decoding / verifying requests with `drafts` draft tokens in all."""
        b = bucket(batch)
        if drafts == 0:
            w, t, n = self.plain.get(b, (0.0, 0.0, 0.0))
            self.plain[b] = [DECAY * w + 1, (DECAY * w * t + seconds) / (DECAY * w + 1),
                             (DECAY * w * n + batch) / (DECAY * w + 1)]
            return
        base = self._plain(b)
        if base is not None:
            self.fits.setdefault(b, _Fit()).add(drafts, seconds - base[0] * batch / base[1])

    def plain_known(self, batch: int) -> bool:
        """A plain decode step time for this batch size: measured (MIN_PLAIN steps) or
        interpolated between measured ones."""
        return self._plain(bucket(batch)) is not None

    def model(self, batch: int):
        """(c, s, m) for this batch size: seconds per plain-decoded token, fixed verify
        cost, seconds per draft token; None until both kinds of step were measured (or
        can be interpolated)."""
        b = bucket(batch)
        base = self._plain(b)
        sm = self._verify(b)
        if base is None or sm is None:
            return None
        return base[0] / base[1], sm[0], sm[1]

    def _plain(self, b: int):
        """(P(b) in seconds, the mean batch size it was measured at), or None."""
        return _between(b, {x: (t, n) for x, (w, t, n) in self.plain.items() if w >= MIN_PLAIN})

    def _verify(self, b: int):
        """(s, m) at b, or None."""
        return _between(b, {x: f.solve() for x, f in self.fits.items() if f.w >= MIN_VERIFY})


def _between(b: int, known: Dict[int, tuple]):
    """known[b]; else the linear interpolation (in the batch size) of the values at the
    nearest buckets below and above b; None without both."""
    if b in known:
        return known[b]
    lo = max((x for x in known if x < b), default=None)
    hi = min((x for x in known if x > b), default=None)
    if lo is None or hi is None:
        return None
    f = (b - lo) / (hi - lo)
    return tuple(a + f * (z - a) for a, z in zip(known[lo], known[hi]))


class Acceptance:
    """A request's chance that a draft position is accepted given the previous one was:
    successes = accepted drafts, failures = verifies that stopped before the draft's end."""

    __slots__ = ("ok", "miss")

    def __init__(self, ok: float = 0.0, miss: float = 0.0):
        self.ok, self.miss = ok, miss

    def seed(self, weight: float = 2.0) -> "Acceptance":
        """A new request's start: this (global) estimate, with at most `weight` verifies' say."""
        n = self.ok + self.miss
        f = min(1.0, weight / n) if n else 0.0
        return Acceptance(self.ok * f, self.miss * f)

    def update(self, reach: int, accepted: int) -> None:
        self.ok = ACCEPT_DECAY * self.ok + accepted
        self.miss = ACCEPT_DECAY * self.miss + (1.0 if accepted < reach else 0.0)

    @property
    def rate(self) -> float:
        return (self.ok + PRIOR_SUCCESS) / (self.ok + self.miss + PRIOR_SUCCESS + PRIOR_FAILURE)


def draft_length(a: float, c: float, m: float, limit: int) -> int:
    """Largest k <= limit with a^k * c >= m (0: no draft pays)."""
    k, gain = 0, 1.0
    while k < limit:
        gain *= a
        if gain * c < m:
            break
        k += 1
    return k


def expected_gain(a: float, k: int) -> float:
    """Expected accepted drafts of a k-token chain: a + a^2 + ... + a^k."""
    return sum(a ** j for j in range(1, k + 1))


def worth_it(model, plans, sunk: bool = False) -> bool:
    """`plans`: (acceptance rate, draft length, draft tokens incl. tree alternatives) per
    request that drafts: does the step's expected gain exceed its verify cost? `sunk`: the
    step verifies (forced text) anyway, so the fixed cost s is paid whatever the drafts."""
    c, s, m = model
    gain = c * sum(expected_gain(a, k) for a, k, _ in plans)
    return gain > (0.0 if sunk else s) + m * sum(n for _, _, n in plans)
