"""Choosing k from measured curves and an acceptance estimate.

With per-position acceptance p, a round that drafts k tokens commits on average
E(p, k) = 1 + p + p^2 + ... + p^k tokens (the accepted prefix plus the target's own token) and
costs verify(K = k + 1, depth) + drafter(k) seconds; plain decoding commits 1 token per
verify(1, depth). The best k maximises E / cost; its ratio to plain decoding is the gain.
`auto` refines this with what it learns per round (`estimators.py`): the first position's
acceptance apart from the later ones', and how many tokens the drafter actually proposes when
allowed k (a lookup drafter often proposes fewer, or none), so a cap costs only what is drafted;
and how much longer its rounds take than the curves charge (the host's speed moves).

`CurveCap` is the DraftCap both `calibrated` (fixed prior p) and `auto` (p learnt per round,
speculation off when the gain drops below 1 even at an optimistic reading of the evidence,
periodic probes to come back) are built on. With `plan_sources_apart`, each source of drafts
(the drafter's own pass, or a run copied from the context: `Drafter.source`) is planned apart: a
copy skips the drafter's pass, so it is charged only its verify, and its acceptance is learnt on
its own, so copies' hits do not keep a losing drafter on, and the drafter's misses do not switch
copies off. Off by default: on held-out prompts it did not pay (docs/benchmarks.md §3).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, PositiveInt

from dspark_flow.calibration.curves import DEFAULT_DEPTHS, Curves
from dspark_flow.calibration.estimators import (
    AcceptanceEstimator,
    LengthEstimator,
    RoundCostOffset,
    RoundCostRatios,
)
from dspark_flow.errors import ConfigError
from dspark_flow.log import get_logger
from dspark_flow.strategy import (
    COPY_SOURCE,
    DRAFTER_SOURCE,
    BuildContext,
    DraftCap,
    StrategyConfig,
    Verifier,
    construct,
    warm,
)

log = get_logger()

# A larger k must beat the best smaller one by this fraction: measured curves carry ~1% noise,
# and a shorter draft wastes less when the acceptance estimate is optimistic.
TOLERANCE = 0.005
FALLBACK_K = 4  # used only if choose() runs before warm_up() supplied curves
DEPTH_STEP = 16  # context depths this close share a cached plan
# A learnt round-cost offset moves in steps of this fraction of one row's verify (so plans stay
# cached), and never brings a charge below COST_FLOOR of what the curves say.
OFFSET_STEP = 0.02
COST_FLOOR = 0.25
# With costs learnt by row count, a plain step's own ratio is only seen in rounds that draft
# nothing: until it is known, one round in this many drafts nothing to time one, and once known,
# one in PLAIN_RESAMPLE_EVERY so that it follows the host (a forced step costs under 1%).
PLAIN_SAMPLE_EVERY = 16
PLAIN_RESAMPLE_EVERY = 128


def expected_tokens(p: float, k: int, p_first: float | None = None) -> float:
    """Tokens one round commits on average: 1 + p + p^2 + ... + p^k when each drafted position
    is accepted with p; with `p_first`, the first position is accepted with p_first and each
    later one (given the previous) with p: 1 + p_first * (1 + p + ... + p^(k-1))."""
    if k <= 0:
        return 1.0
    first = p if p_first is None else p_first
    rest = float(k) if p >= 1.0 else (1.0 - p**k) / (1.0 - p)
    return 1.0 + first * rest


@dataclass(frozen=True)
class Plan:
    k: int
    tokens: float  # expected committed tokens per round
    seconds: float  # expected round time
    gain: float  # tokens/second relative to plain decoding at the same depth

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def plan_table(
    curves: Curves,
    p: float,
    depth: float,
    max_k: int,
    p_first: float | None = None,
    survival: list[float] | None = None,
    offset: float = 0.0,
    drafter_pass: bool = True,
    scales: tuple[float, ...] | None = None,
) -> list[Plan]:
    """One Plan per k = 0..max_k (k = 0 is plain decoding).

    `survival[n]` = P(the drafter proposes >= n tokens when allowed more): with it, a cap of k
    drafts min(L, k) tokens for the drafter's natural length L, and the plan averages tokens
    and time over L. Without it the drafter always fills k. `offset`: seconds added to every
    round (what `auto` learnt the rounds take beyond the curves; `RoundCostOffset`).
    `drafter_pass=False` charges no drafter cost (copied drafts). `scales[n]`: what a round
    drafting n tokens takes over what the curves charge it (`RoundCostRatios`); the whole
    round's charge is scaled, the difference landing on its verify.
    """
    max_k = max(0, max_k)
    verify = curves.verify_costs(max_k + 1, depth)  # verify[n]: n drafted tokens
    if offset:
        verify = [max(v + offset, COST_FLOOR * v) for v in verify]
    if scales is not None:
        drafting = [curves.drafter_cost(n) if drafter_pass else 0.0 for n in range(max_k + 1)]
        verify = [
            max(COST_FLOOR * v, scales[min(n, len(scales) - 1)] * (v + d) - d)
            for n, (v, d) in enumerate(zip(verify, drafting, strict=True))
        ]
    tokens_at = [expected_tokens(p, n, p_first) for n in range(max_k + 1)]
    plain = verify[0]
    out: list[Plan] = []
    short_tokens = short_seconds = 0.0  # sum over L < k of P(L) * (tokens, seconds)
    for k in range(max_k + 1):
        tail = 1.0 if survival is None else survival[min(k, len(survival) - 1)]  # P(L >= k)
        tokens = short_tokens + tail * tokens_at[k]
        seconds = short_seconds + tail * verify[k] + (curves.drafter_cost(k) if drafter_pass else 0)
        gain = (tokens / seconds) * plain if seconds > 0 else float("inf")
        out.append(Plan(k=k, tokens=tokens, seconds=seconds, gain=gain))
        if survival is not None:
            exactly = tail - survival[min(k + 1, len(survival) - 1)]  # P(L = k)
            short_tokens += exactly * tokens_at[k]
            short_seconds += exactly * verify[k]
    return out


def best_plan(
    curves: Curves,
    p: float,
    depth: float,
    max_k: int,
    p_first: float | None = None,
    survival: list[float] | None = None,
    keep: int | None = None,
    margin: float = 0.0,
    keep_floor: float = 0.0,
    offset: float = 0.0,
    drafter_pass: bool = True,
    scales: tuple[float, ...] | None = None,
) -> Plan:
    """The k >= 1 (when max_k >= 1) with the highest expected tokens per second; or `keep`
    (the previous round's k), where that is expected within `margin` of the best and its gain
    is at least `keep_floor` (so keeping a k never turns drafting off where the best pays)."""
    table = plan_table(curves, p, depth, max_k, p_first, survival, offset, drafter_pass, scales)
    best = table[1] if len(table) > 1 else table[0]
    for plan in table[2:]:
        if plan.gain > best.gain * (1.0 + TOLERANCE):
            best = plan
    kept = table[keep] if keep is not None and 1 <= keep < len(table) else None
    if kept is not None and margin > 0 and kept.gain >= max(best.gain * (1 - margin), keep_floor):
        return kept
    return best


# -- the draft cap -----------------------------------------------------------------------------


@dataclass
class SourceState:
    """What a cap learns about one source of drafts, and where its on/off logic stands."""

    estimator: AcceptanceEstimator
    lengths: LengthEstimator | None = None  # made once the block is known
    off_rounds: int = 0
    single_rounds: int = 0  # rounds planned at one token since the last two-token probe
    planned_k: int = 0  # the last k chosen from the plan (not a probe): what a margin keeps
    last_k: int = 0
    # While off, rounds bring no evidence, so the decision holds until something it depends on
    # moves (`CurveCap._situation`): the situation it was taken in, and its rounds between probes.
    off_key: tuple[Any, ...] | None = None
    off_every: int | None = None
    probing: bool = False  # the last round was a probe drafted while off


class CurveCapConfig(StrategyConfig):
    acceptance: float = Field(0.6, gt=0, lt=1, description="prior per-position acceptance p")
    max_k: int | None = Field(
        None, ge=1, description="most tokens per round (default: the drafter's block, else 16)"
    )
    depths: list[PositiveInt] = Field(
        default_factory=lambda: list(DEFAULT_DEPTHS),
        min_length=1,
        description="context depths at which the verify cost is measured",
    )
    repeats: int = Field(5, ge=1, description="timed repeats per point (the median is kept)")
    warmup: int = Field(2, ge=0, description="untimed passes before measuring")
    force: bool = Field(False, description="measure again even if cached curves exist")
    cache_dir: str | None = Field(
        None, description="where curves are cached (default $DSPARK_FLOW_CALIBRATION_DIR or cache)"
    )
    plan_sources_apart: bool = Field(
        False,
        description="plan rounds that copy a run from the context (drafter option "
        "prompt_lookup) apart from the drafter's own: a copy is charged no drafter pass and its "
        "acceptance is learnt on its own. Off by default: over held-out prompts it came within "
        "1.4% of one plan for every round in noise-free replays, and behind it in three "
        "measured H200 runs (docs/benchmarks.md §3)",
    )


class AdaptiveCapConfig(CurveCapConfig):
    window: float = Field(32.0, ge=1, description="rounds of memory of the acceptance estimate")
    carry_weight: float = Field(
        4.0,
        gt=0,
        description="at a new request, what was learnt weighs at most this many rounds",
    )
    prior_weight: float = Field(2.0, gt=0, description="pseudo-positions behind the prior p")
    min_gain: float = Field(
        1.0, gt=0, description="draft only when expected speed over plain decoding exceeds this"
    )
    probe_every: int = Field(
        4,
        ge=1,
        description="probe at most once every this many rounds: while off, a short draft; "
        "while drafting one token, a draft of two",
    )
    off_confidence: float = Field(
        0.9,
        ge=0.5,
        lt=1,
        description="switch drafting off only when at least this sure that it does not pay "
        "(this quantile of the Beta posteriors of the first and later positions' acceptance)",
    )
    switch_margin: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="keep the previous round's k unless another is expected to be faster by "
        "more than this fraction (for backends where a change of verify shape costs more than "
        "the curves show; 0: always the best)",
    )
    probe_k: int = Field(2, ge=1, description="draft length of a probe round")
    learn_round_cost: bool = Field(
        True,
        description="add to every round's cost what the rounds measured in this process take "
        "beyond the curves (the host's speed moves between calibration and use)",
    )
    round_cost_by_rows: bool = Field(
        False,
        description="with learn_round_cost: learn what rounds take over the curves' charge as "
        "a ratio per verified row count, rounds that run the drafter apart from plain steps "
        "(and from copies with plan_sources_apart), instead of one offset added to every round",
    )
    follow_drafter_sizes: bool = Field(
        True,
        description="with a drafter that sizes its own drafts (lookup), decide only whether to "
        "draft and let it draft up to the limit: its draft length already follows its evidence",
    )
    probe_cost: float = Field(
        0.02,
        gt=0,
        description="probes may slow decoding by at most this fraction of their rounds' time, "
        "at the current acceptance estimate (so they are rarer where they cost more)",
    )


def _same_drafter(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two `drafter_identity` records name one drafter however its checkpoint was named
    (`auto` and the name it resolves to); the files' own identity, where both record it, must
    agree."""

    def named_apart(identity: dict[str, Any]) -> dict[str, Any]:
        config = identity.get("config", {})
        config = {k: v for k, v in config.items() if k not in ("checkpoint", "revision")}
        return {**{k: v for k, v in identity.items() if k != "checkpoint"}, "config": config}

    files_agree = (
        "checkpoint" not in a or "checkpoint" not in b or a["checkpoint"] == b["checkpoint"]
    )
    return files_agree and named_apart(a) == named_apart(b)


class CurveCap(DraftCap):
    """Picks k from curves; `adaptive` subclasses learn p and may switch drafting off."""

    adaptive: ClassVar[bool] = False
    Config = CurveCapConfig
    config: CurveCapConfig

    def __init__(self, config: CurveCapConfig | None = None, curves: Curves | None = None):
        super().__init__(config)
        self.curves = curves
        self.cache_path: Any = None
        # `drafter_identity` of the drafter given curves were measured with (calibrate() sets
        # it), so that warm_up can say when the cap is used with another drafter.
        self.calibrated_for: dict[str, Any] | None = None
        self.depth = 0  # tokens in the context (prompt + committed) of the current generation
        self.chosen: Counter[int] = Counter()  # k per round, for reports
        self._plans: dict[tuple[Any, ...], Plan] = {}
        # Set from the drafter at warm_up (or by a replay): whether it sizes its own drafts.
        self.drafter_sizes_drafts = False
        self.round_cost = RoundCostOffset(window=2 * getattr(self.config, "window", 32.0))
        self.round_costs = RoundCostRatios(window=2 * getattr(self.config, "window", 32.0))
        self.rounds_since_plain = 0  # rounds since one that verified a single row
        self.sources: dict[str, SourceState] = {}
        self._source = DRAFTER_SOURCE  # the source of the round being planned or observed
        self.state(DRAFTER_SOURCE)

    def state(self, source: str) -> SourceState:
        """What was learnt about `source` (made at the prior on first use)."""
        if (found := self.sources.get(source)) is None:
            cfg = self.config
            found = self.sources[source] = SourceState(
                AcceptanceEstimator(
                    prior=cfg.acceptance,
                    prior_weight=getattr(cfg, "prior_weight", 2.0),
                    window=getattr(cfg, "window", 32.0),
                )
            )
        return found

    @property
    def current(self) -> SourceState:
        return self.state(self._source)

    @property
    def estimator(self) -> AcceptanceEstimator:
        """The acceptance learnt for the current source (the drafter's unless a copy's round
        is being planned)."""
        return self.current.estimator

    # -- warm-up -----------------------------------------------------------------------------

    def warm_up(self, ctx: BuildContext) -> None:
        drafter = ctx.drafter
        if drafter is not None:
            self.drafter_sizes_drafts = bool(getattr(drafter, "sizes_own_drafts", False))
        if self.curves is not None and drafter is not None and self.calibrated_for is not None:
            self._check_calibrated_for(drafter, self.calibrated_for)
        if self.curves is not None or drafter is None or drafter.max_draft == 0:
            return
        from dspark_flow.calibration.obtain import drafter_block, obtain_curves
        from dspark_flow.calibration.store import CurveStore

        cfg = self.config
        target = getattr(ctx.recipe, "target", None)
        forward, verifier_kind = _recipe_verifier(ctx)
        self.curves, self.cache_path, measured = obtain_curves(
            ctx.model,
            drafter,
            sampler=ctx.sampler,
            tokenizer=ctx.tokenizer,
            target_ref=getattr(target, "model", None),
            target_revision=getattr(target, "revision", None),
            block=drafter_block(drafter, cfg.max_k),
            depths=cfg.depths,
            repeats=cfg.repeats,
            warmup=cfg.warmup,
            force=cfg.force,
            store=CurveStore(cfg.cache_dir) if cfg.cache_dir else None,
            forward=forward,
            verifier_kind=verifier_kind,
        )
        self._plans.clear()
        where = str(self.cache_path) if self.cache_path else "not cached"
        log.info("draft cost curves", path=where, measured=measured)

    def _check_calibrated_for(self, drafter: Any, measured_with: dict[str, Any]) -> None:
        """Another drafter's curves still decode losslessly, but price its rounds wrongly."""
        from dspark_flow.calibration.store import drafter_identity

        if not _same_drafter(drafter_identity(drafter), measured_with):
            log.warning(
                "draft cap calibrated for another drafter; its cost curves may not fit this one "
                "(calibrate() with this drafter)",
                calibrated_for=measured_with.get("kind"),
                drafter=getattr(drafter.config, "kind", type(drafter).__name__),
            )

    # -- the contract ------------------------------------------------------------------------

    def begin(self, prompt_ids: list[int]) -> None:
        """A generation starts after these prompt tokens. The acceptance estimate carries over
        (a drafter's hit rate says more than the prior) but with little weight: prompts differ."""
        self.depth = len(prompt_ids)
        carry = getattr(self.config, "carry_weight", 4.0)
        for state in self.sources.values():
            state.off_rounds = state.single_rounds = 0
            if self.adaptive:
                state.estimator.new_request(carry)
                if state.lengths is not None:
                    state.lengths.new_request(carry)

    def limit(self, drafter_max: int | None) -> int:
        bounds = [b for b in (drafter_max, self.config.max_k) if b is not None]
        if self.curves is not None:
            bounds.append(self.curves.block)
        return max(0, min(bounds, default=FALLBACK_K))

    def acceptance(self) -> tuple[float, float]:
        """(p_first, p): learnt when adaptive, else the configured prior for both."""
        if self.adaptive:
            return self.estimator.p_first, self.estimator.p
        return self.config.acceptance, self.config.acceptance

    @property
    def lengths(self) -> LengthEstimator | None:
        """What `auto` learnt about how many tokens the current source proposes (None
        otherwise)."""
        state = self.current
        if state.lengths is None and self.adaptive and self.curves is not None:
            state.lengths = LengthEstimator(
                self.curves.block, getattr(self.config, "window", 32.0) * 2
            )
        return state.lengths

    @property
    def drafter_pass(self) -> bool:
        """Whether the current source's rounds run the drafter (a copy does not)."""
        return self._source != COPY_SOURCE

    @property
    def sizes_drafts(self) -> bool:
        """Whether the current source sizes its own drafts: copies stop where the copied run
        does (lookup's rule), the drafter's pass as `Drafter.sizes_own_drafts` says."""
        return self._source == COPY_SOURCE or self.drafter_sizes_drafts

    def plan(self, drafter_max: int | None = None, optimistic: bool = False) -> Plan | None:
        if self.curves is None:
            return None
        p_first, p = self.acceptance()
        if optimistic:  # both rates as high as the evidence still plausibly allows
            level = getattr(self.config, "off_confidence", 0.9)
            p_first, p = self.estimator.first.upper(level), self.estimator.next.upper(level)
        limit = self.limit(drafter_max)
        margin = getattr(self.config, "switch_margin", 0.0)
        planned = self.current.planned_k
        keep = planned if margin > 0 and planned > 0 else None
        floor = getattr(self.config, "min_gain", 1.0)
        offset, drafter_pass = self.cost_offset(), self.drafter_pass
        scales = self.cost_scales(limit)
        survival = lengths.survival() if (lengths := self.lengths) is not None else None
        args = (self.curves, p, self.depth, limit, p_first, survival, keep, margin, floor, offset)
        if survival is not None:  # the drafter's lengths move every round: nothing to reuse
            return best_plan(*args, drafter_pass=drafter_pass, scales=scales)
        # Rounds repeat the same situation often; the table costs ~k interpolations.
        key = (
            round(p_first, 3),
            round(p, 3),
            self.depth // DEPTH_STEP,
            limit,
            keep,
            offset,
            drafter_pass,
            scales,
        )
        if (found := self._plans.get(key)) is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            found = self._plans[key] = best_plan(*args, drafter_pass=drafter_pass, scales=scales)
        return found

    @property
    def _costs_by_rows(self) -> bool:
        cfg = self.config
        return (
            self.adaptive
            and getattr(cfg, "learn_round_cost", False)
            and getattr(cfg, "round_cost_by_rows", False)
        )

    def cost_scales(self, limit: int) -> tuple[float, ...] | None:
        """What rounds drafting 0..limit tokens take over the curves' charge, as learnt
        (`auto` with `round_cost_by_rows`; else None)."""
        if not self._costs_by_rows:
            return None
        return self.round_costs.scales(limit, self.drafter_pass)

    def cost_offset(self) -> float:
        """Seconds every round takes beyond the curves, as learnt (`auto` with
        `learn_round_cost`, unless by row count; else 0), in steps of OFFSET_STEP of one row's
        verify."""
        if not (self.adaptive and getattr(self.config, "learn_round_cost", False)):
            return 0.0
        if self._costs_by_rows:
            return 0.0
        if self.curves is None or (offset := self.round_cost.offset) == 0.0:
            return 0.0
        # One step at every depth, so a plan cached for a depth bucket stays valid in it.
        step = OFFSET_STEP * self.curves.verify_cost(1, 0)
        return round(offset / step) * step if step > 0 else 0.0

    @property
    def reads_source(self) -> bool:
        """Only rounds planned apart by source need it; otherwise every round is the
        drafter's."""
        return self.config.plan_sources_apart

    def _round_from(self, source: str) -> None:
        """Plan and learn this round as `source`'s (every round as the drafter's, without
        `plan_sources_apart`)."""
        self._source = source if self.config.plan_sources_apart else DRAFTER_SOURCE

    def choose(self, drafter_max: int | None, source: str = DRAFTER_SOURCE) -> int:
        self._round_from(source)
        state = self.current
        k = state.last_k = self._choose(drafter_max)
        self.chosen[k] += 1
        return k

    def _choose(self, drafter_max: int | None) -> int:
        limit = self.limit(drafter_max)
        state = self.current
        state.probing = False
        situation = None
        if self.adaptive and state.off_key is not None:
            situation = self._situation(limit)
            if situation == state.off_key:  # off, and nothing the decision rests on has moved
                return self._off_round(state, limit)
        plan = self.plan(drafter_max)
        if plan is None:
            log.warning("draft cap used before warm_up(); drafting a fixed k", k=FALLBACK_K)
            return min(FALLBACK_K, limit)
        if not self.adaptive or limit == 0:
            return plan.k
        cfg = self.config
        min_gain = getattr(cfg, "min_gain", 1.0)
        state.off_key = None
        if plan.gain >= min_gain or self._unsure_it_loses(drafter_max, min_gain):
            if self._costs_by_rows and self._time_a_plain_step():
                return 0
            state.off_rounds = 0
            state.planned_k = plan.k  # the probe of two below does not count as a choice
            if self.sizes_drafts and getattr(cfg, "follow_drafter_sizes", True):
                # The plan's k assumes one acceptance rate for every draft; such a drafter
                # drafts long only where its evidence is strong (lookup's edit prompts, replayed
                # over 14 prompt orders: 0.84 -> 1.08 of the best fixed k in the worst one,
                # docs/benchmarks.md §3).
                state.single_rounds = 0
                return limit
            if plan.k != 1 or limit < 2:
                state.single_rounds = 0
                return plan.k
            # Drafting one token never shows whether a second would have been accepted, so the
            # later positions' estimate would stay wherever earlier prompts left it: now and
            # then draft two, as rarely as its expected cost requires.
            state.single_rounds += 1
            if state.single_rounds >= self._rounds_between(1, 2):
                state.single_rounds = 0
                return 2
            return 1
        # Plain decoding is expected to be faster; still draft a little now and then, since the
        # estimate only moves on rounds that draft.
        state.single_rounds = state.planned_k = 0
        state.off_every = self._probe_every(limit)
        # Planning moves nothing the situation holds: one taken above still stands.
        state.off_key = situation if situation is not None else self._situation(limit)
        return self._off_round(state, limit)

    def next_is_plain(self) -> bool:
        """Off, and the next off round is no probe. (The decision is retaken only when its
        situation moves: at a depth step or a new learnt offset, every few hundred rounds; a
        round that then plans a draft drafts nothing once.)"""
        state = self.current
        if not self.adaptive or state.off_key is None or self.config.plan_sources_apart:
            return False
        return state.off_every is None or state.off_rounds + 1 < state.off_every

    def _time_a_plain_step(self) -> bool:
        """Whether this round should draft nothing so that a plain step gets timed: drafting
        rounds alone would leave its ratio to the curves unknown, and the plan would then
        assume the drafting rounds' ratio for it (no premium learnt)."""
        known = self.round_costs.knows(1, drafted=False)
        return self.rounds_since_plain >= (PLAIN_RESAMPLE_EVERY if known else PLAIN_SAMPLE_EVERY)

    def _off_round(self, state: SourceState, limit: int) -> int:
        """A round while off: 0, or a probe once every `state.off_every` rounds (never if
        None)."""
        state.off_rounds += 1
        every = state.off_every
        if every is not None and state.off_rounds >= every:
            state.off_rounds = 0
            state.probing = True
            return min(getattr(self.config, "probe_k", 2), limit)
        return 0

    def _situation(self, limit: int) -> tuple[Any, ...]:
        """What the off decision and its probe spacing depend on that can change between
        rounds. An off round moves none of the estimates, so the next one meets the same
        situation unless the context crossed a depth step (DEPTH_STEP tokens, as plans are
        cached) or the learnt round cost moved: the decision is then reused, not replanned at
        the new depth. Replanning an off round took 0.15 ms in a 2-core CPU's loop, reusing it
        0.03 ms (2 µs timed alone; docs/benchmarks.md §3)."""
        lengths = self.lengths
        return (
            self._source,
            self.estimator.version,
            None if lengths is None else lengths.version,
            self.depth // DEPTH_STEP,
            limit,
            self.cost_offset(),
            self.round_costs.version if self._costs_by_rows else None,
        )

    def _unsure_it_loses(self, drafter_max: int | None, min_gain: float) -> bool:
        """The estimate says plain decoding is faster, but does the evidence say so firmly?

        Switching off is the costly mistake: while off only sparse probes bring evidence, so a
        drafter that was unlucky for a few rounds (the first rounds of a prompt, a run of
        misses) stays off for long, whereas drafting on through a run of misses costs only the
        difference to break-even. So drafting stays on while the acceptance could still
        plausibly (the `off_confidence` quantile of each rate's Beta posterior) be high enough
        to pay. Both rates: the later positions' one learns only from rounds whose first draft
        was accepted, so where a prompt starts with misses it is mostly what the previous prompt
        left (on the H200's DFlash chat replay, the first rate alone switched drafting off where
        it paid 18%). The counts decay and include the prior and what a previous request left,
        so a drafter that has missed for a window, in this request or the last, is off at once;
        where a draft costs little, proof that it never pays takes longer, but also costs less.
        """
        optimistic = self.plan(drafter_max, optimistic=True)
        return optimistic is not None and optimistic.gain >= min_gain

    def _probe_every(self, limit: int) -> int | None:
        """Rounds between probes while off; None when no k could pay even if every draft were
        accepted (then probing learns nothing useful)."""
        assert self.curves is not None
        perfect = best_plan(
            self.curves,
            1.0,
            self.depth,
            limit,
            offset=self.cost_offset(),
            drafter_pass=self.drafter_pass,
            scales=self.cost_scales(limit),
        )
        if perfect.gain <= getattr(self.config, "min_gain", 1.0) * (1.0 + TOLERANCE):
            return None  # even drafts that are always accepted would at best break even
        return self._rounds_between(0, min(getattr(self.config, "probe_k", 2), limit))

    def _rounds_between(self, k: int, probe: int) -> int:
        """How often a round may draft `probe` tokens where the plan says `k`: at least every
        `probe_every` rounds, and rarely enough that the expected loss stays under `probe_cost`
        of the rounds' time. The loss is taken at the current estimate: just below break-even a
        probe costs little and runs often, so `auto` comes back quickly; where drafts are never
        accepted it costs a verify of probe + 1 rows for one token and runs rarely. A drafter
        that seldom proposes anything (lookup without a match) makes most probes cheap."""
        assert self.curves is not None
        cfg = self.config
        lengths = self.lengths
        p_first, p = self.acceptance()
        table = plan_table(
            self.curves,
            p,
            self.depth,
            probe,
            p_first,
            survival=lengths.survival() if lengths else None,
            offset=self.cost_offset(),
            drafter_pass=self.drafter_pass,
            scales=self.cost_scales(probe),
        )
        base, trial = table[k], table[probe]
        # In the time of a probe round the planned k would commit trial.seconds * base.rate
        # tokens; the shortfall, in planned rounds, is the loss.
        loss = max(0.0, (trial.seconds * base.rate - trial.tokens) / base.tokens)
        return max(
            getattr(cfg, "probe_every", 4), math.ceil(loss / getattr(cfg, "probe_cost", 0.02))
        )

    def observe(
        self, proposed: int, accepted: int, seconds: float, source: str = DRAFTER_SOURCE
    ) -> None:
        self._round_from(source)
        if self.adaptive and self.curves is not None:  # measured against what the curves charge
            charged = self.curves.round_cost(proposed, self.depth, self.drafter_pass)
            if self._costs_by_rows:  # the one offset is then never read: learn only the ratios
                drafted = proposed > 0 and self.drafter_pass
                # A probe takes in the off stretch before it (H200 chat: 0.79-1.94 of its charge
                # against 0.73-0.83 for steady rounds); learnt with them it would overprice
                # drafting and keep `auto` off.
                if not self.current.probing:
                    self.round_costs.update(proposed + 1, drafted, seconds, charged)
                self.rounds_since_plain = 0 if proposed == 0 else self.rounds_since_plain + 1
            else:
                self.round_cost.update(seconds, charged)
        self.depth += accepted + 1
        if self.adaptive:
            self.estimator.update(proposed, accepted)
            if (lengths := self.lengths) is not None:
                lengths.update(self.current.last_k, proposed)


def verifier_identity(verifier: Any) -> str:
    """What the curves' key records of the verifier: its kind and settings (a kernel verifier
    in invariant mode, or compiled layers, cost what they cost, not what the plain forward
    does); "reference" for the plain forward."""
    return config_identity(getattr(verifier, "config", None))


def config_identity(config: Any) -> str:
    """`verifier_identity` from a verifier's config (None: the plain forward). A reference
    verifier is the plain forward only when nothing reroutes it: compiled layers, or attention
    through matmuls (`attention: auto` on CUDA), cost what they cost and are timed as such."""
    from dspark_flow.models.attention import matmul_chosen

    if config is None or (
        config.kind == "reference"
        and not getattr(config, "compile_layers", False)
        and not matmul_chosen(getattr(config, "attention", "fused"))
    ):
        return "reference"
    settings = config.model_dump(mode="json", exclude={"reprobe"})  # re-probing costs nothing
    return json.dumps(settings, sort_keys=True)


def _recipe_verifier(ctx: BuildContext) -> tuple[Any, str]:
    """The forward to time and its identity: the pipeline's own (warmed) verifier, else one
    built from the recipe, else the plain forward."""
    verifier = ctx.verifier
    if verifier is None:
        config = getattr(ctx.recipe, "verifier", None)
        if config is None or config_identity(config) == "reference":
            return None, "reference"
        from dspark_flow import registry

        built = warm(construct(registry.load_kind("verifier", config.kind), config), ctx)
        if not isinstance(built, Verifier):
            raise ConfigError(f"verifier {config.kind}: not a Verifier ({type(built).__name__})")
        verifier = built
    if verifier_identity(verifier) == "reference":
        return None, "reference"
    return verifier.forward, verifier_identity(verifier)
