"""What `auto` learns from each round: how often drafted positions are accepted and how many
tokens the drafter proposes when allowed k (from (proposed, accepted)), and how much longer or
shorter the round took than the curves charged (`RoundCostOffset`, from its seconds).

The first two use exponentially decaying counts (old evidence fades, memory ~`window` rounds)
and, at a new request, keep what was learnt at a small weight (`carry_weight` rounds), since
prompts differ in how well a drafter does on them.
"""

from __future__ import annotations

import math
from statistics import NormalDist

OPTIMISM = 1.0  # pseudo-rounds in the length estimate that continue past every n


LARGE_COUNTS = 10_000.0  # above this many trials the Beta is normal to well within the noise


def beta_quantile(successes: float, failures: float, level: float) -> float:
    """The `level` quantile of Beta(successes, failures): how high a rate the counts still
    allow. The counts already hold the prior's pseudo-trials, so no further prior is added: with
    next to no successes left (a drafter that has not hit for a window) the quantile is near 0
    even on few trials, where a normal approximation would still allow a high rate."""
    if not (math.isfinite(successes) and math.isfinite(failures)):
        raise ValueError(f"beta_quantile: counts must be finite ({successes}, {failures})")
    if successes <= 0.0:
        return 0.0
    if failures <= 0.0:
        return 1.0
    if successes + failures > LARGE_COUNTS:  # the continued fraction would need too many terms
        mean = successes / (successes + failures)
        sd = math.sqrt(mean * (1.0 - mean) / (successes + failures + 1.0))
        return min(1.0, max(0.0, mean + NormalDist().inv_cdf(level) * sd))
    # Newton's method on the CDF, kept inside a shrinking bracket (bisecting where a step
    # would leave it): a few CDF evaluations, since `auto` may need this every round.
    lo, hi = 0.0, 1.0
    x = successes / (successes + failures)
    for _ in range(60):
        cdf, density = _beta_cdf(x, successes, failures)
        if abs(cdf - level) < 1e-10 or hi - lo < 1e-12:
            break
        if cdf < level:
            lo = x
        else:
            hi = x
        step = x - (cdf - level) / density if density > 0.0 else -1.0
        x = step if lo < step < hi else 0.5 * (lo + hi)
    return x


def _beta_cdf(x: float, a: float, b: float) -> tuple[float, float]:
    """Regularised incomplete beta I_x(a, b) and the Beta density at x. I_x by its continued
    fraction (Numerical Recipes 6.4), on the side of x where that converges fast."""
    if not 0.0 < x < 1.0:
        return (0.0 if x <= 0.0 else 1.0), 0.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    density = front / (x * (1.0 - x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(x, a, b) / a, density
    return 1.0 - front * _beta_fraction(1.0 - x, b, a) / b, density


def _beta_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b), by the modified Lentz method."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    out = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1.0) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1.0)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            out *= c * d
        if abs(c * d - 1.0) < 1e-12:
            break
    return out


class _Rate:
    """A success rate from exponentially decaying counts, started from `weight` pseudo-trials
    at `prior` that decay like real evidence (so a drafter that never hits drives it to 0)."""

    def __init__(self, prior: float, weight: float, decay: float):
        self.prior, self.decay = prior, decay
        self.successes = prior * weight
        self.failures = (1.0 - prior) * weight
        self._upper: tuple[float, float, float, float] | None = None  # (s, f, level) -> value

    @property
    def value(self) -> float:
        total = self.successes + self.failures
        return self.successes / total if total > 0 else self.prior

    def upper(self, level: float) -> float:
        """A rate the true one exceeds with probability only 1 - `level`, given the counts."""
        key = (self.successes, self.failures, level)
        if self._upper is None or self._upper[:3] != key:  # unchanged while drafting is off
            self._upper = (*key, beta_quantile(*key))
        return self._upper[3]

    def add(self, successes: float, failures: float) -> None:
        self.successes = self.decay * self.successes + successes
        self.failures = self.decay * self.failures + failures

    def cap_weight(self, weight: float) -> None:
        """Keep the rate but let it weigh at most `weight` trials."""
        total = self.successes + self.failures
        if total > weight > 0:
            self.successes *= weight / total
            self.failures *= weight / total


class AcceptanceEstimator:
    """Acceptance of drafted positions, learnt from each round's (proposed, accepted).

    Model: the first drafted position is accepted with p_first, each later one (given the one
    before was) with p, and the round stops at the first rejection, so `accepted` is a
    truncated geometric count. A round with accepted < proposed shows its accepted positions
    as successes and one failure; a fully accepted round shows successes only (the run was cut
    by the draft length, not by a rejection: counting it as a failure would bias p down). The
    maximum-likelihood rate is successes / (successes + failures) for each of the two.

    Two rates, not one, because drafters like lookup are all-or-nothing: a copy either matches
    from its first token on or not at all, and a single p would average the two into a
    mediocre value that overrates short drafts and underrates long ones. With a geometric
    drafter the two agree. Counts decay by (1 - 1/window) per informative round, so old
    evidence fades; they start as `prior_weight` pseudo-trials at the prior, which fade alike.
    """

    def __init__(self, prior: float = 0.6, prior_weight: float = 2.0, window: float = 16.0):
        decay = 1.0 - 1.0 / max(window, 1.0)
        self.first = _Rate(prior, prior_weight, decay)
        self.next = _Rate(prior, prior_weight, decay)
        self.version = 0  # moves whenever the rates may have: a decision taken on them is stale

    @property
    def p_first(self) -> float:
        return self.first.value

    @property
    def p(self) -> float:
        """Acceptance of a position after an accepted one."""
        return self.next.value

    def new_request(self, carry_weight: float) -> None:
        """A new prompt may suit the drafter better or worse: keep what was learnt as the new
        prior, but worth only `carry_weight` trials, so this request's rounds soon dominate."""
        self.first.cap_weight(carry_weight)
        self.next.cap_weight(carry_weight)
        self.version += 1

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:  # nothing drafted: no evidence about acceptance
            return
        self.version += 1
        accepted = max(0, min(accepted, proposed))
        self.first.add(1.0 if accepted else 0.0, 0.0 if accepted else 1.0)
        if accepted and proposed > 1:  # positions 2..proposed were only reached if the first was
            self.next.add(accepted - 1.0, 1.0 if accepted < proposed else 0.0)


class LengthEstimator:
    """How many tokens the drafter proposes when k allows more: P(L >= n) for its natural
    length L (lookup proposes nothing without a match and stops where the copied run ends;
    a draft model always fills k).

    A round capped at k that proposed n < k observed L = n; one that proposed k only L >= k
    (censored). The survival S(n) = P(L >= n) is the product-limit (Kaplan-Meier) estimate over
    decaying counts, with `OPTIMISM` pseudo-rounds that continue at every n; with no evidence
    S = 1 (the drafter fills whatever k allows).
    """

    def __init__(self, block: int, window: float = 32.0):
        self.block = block
        self.decay = 1.0 - 1.0 / max(window, 1.0)
        self.events = [0.0] * (block + 1)  # events[n]: rounds that proposed exactly n < cap
        self.censored = [0.0] * (block + 1)  # censored[c]: rounds cut at their cap c
        self.version = 0  # moves whenever the counts do

    def update(self, cap: int, proposed: int) -> None:
        if cap <= 0:  # nothing was asked for: nothing learnt
            return
        self.version += 1
        cap, proposed = min(cap, self.block), max(0, min(proposed, cap, self.block))
        self.events = [self.decay * e for e in self.events]
        self.censored = [self.decay * c for c in self.censored]
        if proposed < cap:
            self.events[proposed] += 1.0
        else:
            self.censored[cap] += 1.0

    def new_request(self, carry_weight: float) -> None:
        self.version += 1
        total = sum(self.events) + sum(self.censored)
        if total > carry_weight > 0:
            self.events = [e * carry_weight / total for e in self.events]
            self.censored = [c * carry_weight / total for c in self.censored]

    def survival(self) -> list[float]:
        """S(n) = P(L >= n) for n = 0..block + 1 (S(0) = 1)."""
        out = [1.0]
        at_risk = sum(self.events) + sum(self.censored)
        for n in range(self.block + 1):
            # Rounds censored at c > n are known to have L > n; censored at n say nothing here.
            at_risk -= self.censored[n]
            # One pseudo-round that went on past n: where caps were small and little is known
            # about longer drafts, assume the drafter would continue, so a longer cap gets tried
            # (a pessimistic guess would never be corrected).
            hazard = self.events[n] / (max(at_risk, 0.0) + OPTIMISM)
            out.append(out[-1] * (1.0 - min(1.0, hazard)))
            at_risk -= self.events[n]
        return out


class RoundCostOffset:
    """How many seconds this process's rounds take beyond what the curves charge them: a
    decaying mean of (measured - charged) over the last ~`window` rounds.

    Additive, because what moves between calibration and use is mostly the host's per-round
    work (building the graph, launching kernels, the sync), the same for every row count: on
    the H200 the host's speed moved by 1.5x between calls of one lease, and the cached curves
    charged one row 1.5-2.2x the loop's greedy step (docs/benchmarks.md §3). Each residual is
    clipped to `clip` times the charge, so one round that compiled a new shape or met a
    pause moves the estimate by at most clip / window of a charge. Nothing is reported until
    `min_rounds` rounds are in; a round timed at 0 s (a replay that charges nothing, a caller
    without a clock) is no evidence.
    """

    def __init__(self, window: float = 64.0, clip: float = 2.0, min_rounds: float = 8.0):
        self.decay = 1.0 - 1.0 / max(window, 1.0)
        self.clip = clip
        self.min_rounds = min_rounds
        self.total = 0.0  # decayed sum of residuals
        self.weight = 0.0  # decayed count of rounds
        self.rounds = 0

    def update(self, measured: float, charged: float) -> None:
        if not (charged > 0.0 and math.isfinite(measured) and measured > 0.0):
            return
        bound = self.clip * charged
        residual = max(-bound, min(bound, measured - charged))
        self.total = self.decay * self.total + residual
        self.weight = self.decay * self.weight + 1.0
        self.rounds += 1

    @property
    def offset(self) -> float:
        """Seconds to add to every round's charge (0 until enough rounds are in)."""
        return self.total / self.weight if self.rounds >= self.min_rounds else 0.0


class RoundCostRatios:
    """How much longer or shorter this process's rounds take than the curves charge, as a
    ratio per verified row count, rounds that ran the drafter's pass apart from those that
    only verified (plain steps, copied runs).

    One additive offset (`RoundCostOffset`) moves every round's charge alike, but rounds of
    different row counts and kinds run off the curves by different factors: in the H200's chat
    the loop took 0.72-0.75 of the curves' charge for plain steps, 0.73-0.83 for steady
    drafting rounds and 0.79-1.23 for probes, which take in an off stretch
    (docs/benchmarks.md §3). The cap keeps probes out of these ratios.
    Each (drafted, rows) pair keeps decaying sums of measured and charged seconds; a pair with
    too few rounds borrows the nearest row count's ratio of its kind, else the other kind's,
    else 1. Measured times are clipped to `clip` times the charge,
    so a round that compiled a shape moves its ratio by little. Ratios are read in steps of
    `step`, and `version` moves only when one of those steps does, so plans and the off
    decision built on them stay cached while the ratios hold still.
    """

    def __init__(
        self,
        window: float = 64.0,
        clip: float = 3.0,
        min_rounds: float = 4.0,
        step: float = 0.02,
    ):
        self.decay = 1.0 - 1.0 / max(window, 1.0)
        self.clip, self.min_rounds, self.step = clip, min_rounds, step
        # (drafted, rows) -> [measured seconds, charged seconds] (decaying), rounds seen
        self._sums: dict[tuple[bool, int], list[float]] = {}
        self._known: dict[tuple[bool, int], float] = {}  # pairs with enough rounds, stepped
        self.version = 0
        self._scales: dict[tuple[bool, int], tuple[float, ...]] = {}

    def update(self, rows: int, drafted: bool, measured: float, charged: float) -> None:
        if not (charged > 0.0 and math.isfinite(measured) and measured > 0.0 and rows >= 1):
            return
        key = (drafted, rows)
        sums = self._sums.setdefault(key, [0.0, 0.0, 0.0])
        sums[0] = self.decay * sums[0] + min(measured, self.clip * charged)
        sums[1] = self.decay * sums[1] + charged
        sums[2] += 1.0
        if sums[2] >= self.min_rounds:
            stepped = round(sums[0] / sums[1] / self.step) * self.step
            if self._known.get(key) != stepped:
                self._known[key] = stepped
                self.version += 1
                self._scales.clear()

    def knows(self, rows: int, drafted: bool) -> bool:
        """Whether rounds of this kind and row count have been seen often enough."""
        return (drafted, rows) in self._known

    def ratio(self, rows: int, drafted: bool) -> float:
        """The learnt ratio for a round of `rows` rows (1 when nothing is known yet)."""
        for kind in (drafted, not drafted):
            near = [r for (d, r) in self._known if d == kind]
            if near:
                best = min(near, key=lambda r: (abs(r - rows), r))
                return self._known[(kind, best)]
        return 1.0

    def scales(self, max_drafted: int, drafter_pass: bool) -> tuple[float, ...]:
        """The ratio for a round drafting n = 0..max_drafted tokens (n = 0: a plain step; n >= 1
        ran the drafter's pass when `drafter_pass`, else verified a copied run)."""
        key = (drafter_pass, max_drafted)
        if (found := self._scales.get(key)) is None:
            found = self._scales[key] = tuple(
                self.ratio(n + 1, drafter_pass and n > 0) for n in range(max_drafted + 1)
            )
        return found
