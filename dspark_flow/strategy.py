"""The contracts between the decode loop and the strategies that fill its six slots.

Each strategy is a class with a pydantic `Config` (its recipe section, `extra="forbid"`, with a
`kind` literal), a cheap `__init__(config)` that only stores settings, and a heavy `warm_up(ctx)`
that loads weights or allocates buffers. The decode loop in `dspark_flow.engine.decode` only
talks to these base classes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from dspark_flow.arrays import int_list
from dspark_flow.errors import DsparkFlowError, StrategyError
from dspark_flow.recipe.section import Section

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

SLOTS: tuple[str, ...] = ("drafter", "verifier", "sampler", "draft_cap", "cache", "stop")


class StrategyConfig(Section):
    """Base of every strategy's recipe section."""

    kind: str


@dataclass
class BuildContext:
    """What a strategy may look at while it warms up."""

    model: nn.Module
    tokenizer: Any
    recipe: Any
    sampler: Sampler | None = None  # set (warmed) for the verifier and later slots
    drafter: Drafter | None = None  # likewise
    verifier: Verifier | None = None  # set (warmed) for the cache, draft cap and stops


class Strategy:
    slot: ClassVar[str]
    Config: ClassVar[type[StrategyConfig]] = StrategyConfig

    def __init__(self, config: StrategyConfig | None = None):
        self.config = config if config is not None else self.Config()  # type: ignore[call-arg]

    def warm_up(self, ctx: BuildContext) -> None:
        """Load weights, check compatibility with the other slots. Called once before use."""


S = TypeVar("S", bound=Strategy)


@contextmanager
def _naming(slot: str, kind: str, step: str) -> Iterator[None]:
    """An unexpected exception from a strategy's own code (a plugin's bug, a file it cannot
    read) is reported with the strategy's name and source instead of as an internal error;
    errors meant for the user pass through as they are."""
    try:
        yield
    except (DsparkFlowError, ModuleNotFoundError, MemoryError):
        raise  # the CLI names a missing package itself; memory is nobody's bug
    except Exception as exc:
        from dspark_flow.registry import source_of  # the registry imports this module

        raise StrategyError(
            f"{slot} '{kind}'{source_of(slot, kind)} failed in {step}: {type(exc).__name__}: {exc}"
        ) from exc


def construct(cls: type[S], config: StrategyConfig) -> S:
    with _naming(cls.slot, config.kind, "__init__"):
        return cls(config)


def warm(strategy: S, ctx: BuildContext) -> S:
    """`strategy.warm_up(ctx)`, naming the strategy if its code fails unexpectedly."""
    kind = str(getattr(getattr(strategy, "config", None), "kind", type(strategy).__name__))
    with _naming(getattr(strategy, "slot", "strategy"), kind, "warm_up"):
        strategy.warm_up(ctx)
    return strategy


# -- drafter -----------------------------------------------------------------------------------


@dataclass
class Draft:
    """Up to k proposed tokens, with the distributions they were drawn from when known.

    `probs` (k, vocab) is None for drafters that have no distribution (lookup): the sampler
    then treats each proposal as drawn from a one-hot distribution.
    """

    tokens: list[int] = field(default_factory=list)
    probs: mx.array | None = None
    # Token ids still on the device (greedy block drafters, for samplers that resolve them):
    # the loop builds the verify forward on them while the drafter computes, and the sampler's
    # one host sync fills `tokens`. None once on the host.
    pending: mx.array | None = None

    @property
    def count(self) -> int:
        """How many tokens are proposed (known before `pending` is evaluated)."""
        return len(self.tokens) if self.pending is None else int(self.pending.shape[0])

    def resolve(self, values: list[int] | None = None) -> Draft:
        """Bring pending ids to the host (from `values`, fetched with others, or a sync)."""
        if self.pending is not None:
            ids = int_list(self.pending) if values is None else values
            self.tokens = [int(t) for t in ids]
            self.pending = None
        return self

    def ids(self, last: int) -> list[int] | mx.array:
        """[last, *draft] as the verify forward takes it: a list, or lazily on the device."""
        if self.pending is None:
            return [last, *self.tokens]
        import mlx.core as mx  # this module imports mlx for types only

        return mx.concatenate([mx.array([last], dtype=mx.uint32), self.pending.astype(mx.uint32)])


def accepted_prefix(draft: Sequence[int], truth: Sequence[int]) -> int:
    """How many leading tokens of `draft` equal `truth`'s: what a greedy verify accepts (and
    replays count, and a cache keeps of a history it was fed)."""
    n = 0
    for proposed, chosen in zip(draft, truth, strict=False):
        if proposed != chosen:
            break
        n += 1
    return n


# Where a round's draft comes from. A drafter that also copies runs from the context (block
# drafters' `prompt_lookup`) names the source before the cap picks k: the two differ in
# acceptance and in cost (a copy skips the drafter's pass), so a cap can plan each apart
# (`plan_sources_apart`) and replays charge each what it costs.
DRAFTER_SOURCE = "drafter"
COPY_SOURCE = "copy"


class Drafter(Strategy):
    slot = "drafter"

    # True where propose() sizes each draft from evidence a draft cap cannot see (lookup: how
    # far back the match reaches, so long drafts only where a copy run is likely): `auto` then
    # decides only whether to draft and lets the drafter fill up to the limit.
    sizes_own_drafts: ClassVar[bool] = False

    @property
    def max_draft(self) -> int | None:
        """Most tokens one round can propose (the block size); None when unbounded."""
        return None

    def begin(self, prompt_ids: list[int], sampler: Sampler) -> None:
        """A new generation starts from these prompt tokens, sampling with `sampler`."""

    def source(self, history: list[int]) -> str:
        """Where the next proposal after `history` would come from (`DRAFTER_SOURCE` unless the
        drafter can also copy); the loop asks before the cap picks k."""
        return DRAFTER_SOURCE

    def propose(self, history: list[int], k: int) -> Draft:
        """Propose up to k tokens that follow `history` (prompt + committed tokens)."""
        raise NotImplementedError

    def observe(self, proposed: int, accepted: int) -> None:
        """How the last round went (for adaptive drafters)."""

    def after_forward(self, committed: int) -> None:
        """A target forward just ran; its first `committed` rows are now committed context.

        Called after every prefill chunk (all its rows) and after every round's verification
        ([last token] + accepted drafts, i.e. accepted + 1 rows). Drafters that read the target's
        hidden states (taps, `dspark_flow.models.taps`) take them here; the others ignore it.
        """


# -- verifier ----------------------------------------------------------------------------------


class Verifier(Strategy):
    slot = "verifier"

    def forward(self, model: nn.Module, tokens: list[int] | mx.array, cache: list[Any]) -> mx.array:
        """Run the target on `tokens` appended to `cache`; return logits (len(tokens), vocab).
        `tokens` is a list of ids, or a lazy uint32 array where the draft is still being
        computed (`mx.array(tokens, dtype=mx.uint32)` takes both without a sync)."""
        raise NotImplementedError

    @property
    def exact_rows(self) -> int | None:
        """The most rows a forward may hold and still compute every row bit for bit as a
        one-row forward does, or None where the verifier promises nothing of the kind. The loop
        drafts at most this many minus one, so that no verify leaves the exact routes."""
        return None


# -- sampler -----------------------------------------------------------------------------------


class Sampler(Strategy):
    slot = "sampler"

    @property
    def greedy(self) -> bool:
        return True

    def begin(self) -> None:
        """A new generation starts (reset the random stream to the seed)."""

    def probs(self, logits: mx.array) -> mx.array:
        """The distribution tokens are drawn from, after temperature and truncation."""
        raise NotImplementedError

    def sample(self, logits: mx.array) -> mx.array:
        """Draw one token per row of `logits` (lazy, no host sync)."""
        raise NotImplementedError

    def sample_from(self, probs: mx.array) -> mx.array:
        """Draw one token from a distribution `probs()` already made (drafters that keep their
        q draw through this). Samplers with a seeded random stream draw from it instead."""
        import mlx.core as mx  # this module loads without MLX (recipes validate without it)

        return mx.random.categorical(mx.log(probs))

    # True where verify() takes a draft whose ids are still `pending` and resolves them in its
    # sync; drafters hand pending drafts only to such samplers.
    resolves_pending: ClassVar[bool] = False

    def verify(self, logits: mx.array, draft: Draft) -> tuple[int, int]:
        """Accept a prefix of `draft` against target `logits` (k+1 rows).

        Returns (number accepted, the target's next token). One host sync at most.
        """
        raise NotImplementedError


# -- draft cap ---------------------------------------------------------------------------------


class DraftCap(Strategy):
    slot = "draft_cap"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Caps written before rounds named their source define choose(drafter_max) and
        # observe(proposed, accepted, seconds): adapt them here rather than fail mid-generation.
        for name in ("choose", "observe"):
            method = cls.__dict__.get(name)
            if method is not None and not _takes_source(method):
                setattr(cls, name, _without_source(method))

    @property
    def reads_source(self) -> bool:
        """Whether `choose` uses the round's source. When not, `choose` gets `DRAFTER_SOURCE`
        and the loop asks the drafter (a copy search) only for rounds that draft, whose
        `observe` still gets the real source."""
        return True

    def begin(self, prompt_ids: list[int]) -> None:
        """A generation starts after these prompt tokens (the loop calls it after the
        drafter's begin)."""

    def choose(self, drafter_max: int | None, source: str = DRAFTER_SOURCE) -> int:
        """How many tokens to draft this round, whose draft comes from `source`."""
        raise NotImplementedError

    def observe(
        self, proposed: int, accepted: int, seconds: float, source: str = DRAFTER_SOURCE
    ) -> None:
        """Feedback after each round."""

    def next_is_plain(self) -> bool:
        """Asked during a round that drafts nothing, before its feedback: whether the next
        round will draft nothing too, whatever this one shows. When True the loop launches the
        next round's forward early (overlapping host and device) and that round drafts nothing
        even if `choose` then asks for more, so say True only when sure."""
        return False


def _takes_source(method: Any) -> bool:
    params = inspect.signature(method).parameters.values()
    return any(p.name == "source" or p.kind is p.VAR_POSITIONAL for p in params)


def _without_source(method: Any) -> Any:
    """`method` called with the arguments it declares, the round's source dropped."""
    positional = len(inspect.signature(method).parameters) - 1  # less self

    @functools.wraps(method)
    def call(self: Any, *args: Any, source: str = DRAFTER_SOURCE) -> Any:
        return method(self, *args[:positional])

    return call


# -- cache -------------------------------------------------------------------------------------


class CacheStrategy(Strategy):
    slot = "cache"

    def new(self, model: nn.Module, prompt_ids: list[int]) -> tuple[list[Any], int]:
        """A cache for a generation; returns it with how many prompt tokens it already holds."""
        raise NotImplementedError

    def trim(self, cache: list[Any], n: int) -> None:
        """Drop the last n entries (the rejected draft tail)."""
        raise NotImplementedError

    def finish(self, cache: list[Any], token_ids: list[int]) -> None:
        """The generation is over; the cache's first `len(token_ids)` entries hold `token_ids`
        (it may hold more: stop rules can cut committed tokens after the forward that made them)."""


# -- stop --------------------------------------------------------------------------------------


class StopRule(Strategy):
    slot = "stop"

    def check_tokens(self, generated: list[int], start: int) -> int | None:
        """Index in `generated` (at or after `start`) where output ends, or None.

        The token at the returned index and everything after it is dropped.
        """
        return None

    @property
    def finish_reason(self) -> str:
        return "stop"

    @property
    def token_budget(self) -> int | None:
        """Most tokens this rule lets a generation make (lets the loop stop drafting early)."""
        return None

    def check_text(self, text: str, start: int) -> int | None:
        """Character index where the text ends (the stop string is cut), or None."""
        return None

    def holdback(self, text: str) -> int:
        """How many trailing characters to withhold from streaming (a stop string may start)."""
        return 0
