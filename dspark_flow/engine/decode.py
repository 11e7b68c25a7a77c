"""The one decode loop: draft -> verify -> accept -> roll back -> stop?

Plain decoding is this loop with a drafter that proposes nothing. Each round does one target
forward over [last committed token] + draft, the loop's one host sync (inside the sampler's
verify; a drafter that must see its own tokens syncs in `propose` too), trims the rejected tail
from the cache and checks the stop rules on what was committed.

A plain round (k = 0) whose next round is known to be plain too may overlap the two (by
default on Metal only, `overlaps_plain_rounds`): it launches the next round's forward on its
own token while that token is still lazy, and only then reads it, so the host builds one graph
while the device runs the other (mlx-lm's `generate_step` does the same). The forwards are the
ones the loop would run anyway, in the same order, so the output is unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from dspark_flow.arrays import as_int
from dspark_flow.engine.textstream import TextStream
from dspark_flow.errors import ConfigError, PromptError
from dspark_flow.models.context import config_vocab_size, context_limit
from dspark_flow.result import GenResult
from dspark_flow.strategy import (
    DRAFTER_SOURCE,
    CacheStrategy,
    Draft,
    DraftCap,
    Drafter,
    Sampler,
    StopRule,
    Verifier,
)

PREFILL_CHUNK = 512  # bounds activation memory on long prompts
# Overlap consecutive plain rounds (see the module docstring): True, False, or None for the
# backend's default (`overlaps_plain_rounds`). Benchmarks set it to compare.
OVERLAP_PLAIN_ROUNDS: bool | None = None


def overlaps_plain_rounds() -> bool:
    """Whether plain rounds overlap on this backend by default. Only on Metal, where mlx-lm's
    own greedy loop overlaps this way (not run here: no Apple machine). On CUDA MLX's
    `async_eval` does much of the device work before it returns, and there the overlap made
    greedy 6% slower (H200, 2026-12-03, docs/benchmarks.md §2); on the CPU there is no device
    to overlap with."""
    if OVERLAP_PLAIN_ROUNDS is not None:
        return OVERLAP_PLAIN_ROUNDS
    from dspark_flow.models.backend import backend_name

    return backend_name() == "metal"


@dataclass
class Components:
    """A warmed-up set of strategies, one per slot, around one target."""

    model: nn.Module
    tokenizer: Any
    drafter: Drafter
    verifier: Verifier
    sampler: Sampler
    draft_cap: DraftCap
    cache: CacheStrategy
    stops: list[StopRule]

    def with_request(self, **changes: Any) -> Components:
        return replace(self, **changes)


@dataclass
class TextEvent:
    text: str


@dataclass
class DoneEvent:
    result: GenResult


@dataclass
class PrefillEvent:
    """A long prompt is being read: `done` of its `total` tokens are in the cache. One comes
    after each chunk but the last, so a consumer (the server) can stop the generation there, as
    at any event, instead of waiting out the whole prompt."""

    done: int
    total: int


Event = TextEvent | DoneEvent | PrefillEvent


def _prefill(
    c: Components, prompt_ids: list[int]
) -> Generator[PrefillEvent, None, tuple[list[Any], mx.array, int]]:
    cache, cached = c.cache.new(c.model, prompt_ids)
    if cached >= len(prompt_ids):  # the forward needs at least one new token for its logits
        c.cache.trim(cache, cached - len(prompt_ids) + 1)
        cached = len(prompt_ids) - 1
    forwards = 0
    rest = prompt_ids[cached:]
    # As mlx-lm does: every prompt token but the last goes in with only the cache evaluated, so
    # the output head runs for one row instead of up to PREFILL_CHUNK rows (49,152 logits a row
    # for the embedded model: time to first token on CPUs, ~100 MB of peak memory at 512 rows).
    while len(rest) > 1:
        chunk = rest[: min(PREFILL_CHUNK, len(rest) - 1)]
        c.verifier.forward(c.model, chunk, cache)
        c.drafter.after_forward(len(chunk))
        mx.eval([entry.state for entry in cache])
        rest = rest[len(chunk) :]
        forwards += 1
        yield PrefillEvent(done=len(prompt_ids) - len(rest), total=len(prompt_ids))
    logits = c.verifier.forward(c.model, rest, cache)[-1]
    c.drafter.after_forward(len(rest))
    return cache, logits, forwards + 1


def _check_draft(drafter: Drafter, draft: Any, k: int, vocab: int | None) -> None:
    """A drafter (a plugin's, say) that proposes ids outside the target's embedding would crash
    the verify forward's lookup (a segfault on the CPU): name it instead; likewise more tokens
    than asked for, which would pass the token budget and the verifier's exact rows. Lazy
    drafts come from the built-in block drafters, whose ids are the draft head's own rows."""
    name = type(drafter).__name__
    if not isinstance(draft, Draft):
        raise ConfigError(f"drafter {name}: propose() returned {type(draft).__name__}, not a Draft")
    if len(draft.tokens) > k:
        raise ConfigError(f"drafter {name} proposed {len(draft.tokens)} tokens, asked for {k}")
    if vocab is not None:
        bad = next((t for t in draft.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(
                f"drafter {name} proposed token id {bad}, outside the vocabulary [0, {vocab})"
            )


def _count_until(accept_lengths: list[int], start: int, end: int) -> None:
    """A stop inside the last round (which began at index `start`): it counts the tokens up to
    `end`, where plain decoding, one token at a time, saw the stop; not those it committed past
    it, which plain decoding never makes."""
    if accept_lengths:
        accept_lengths[-1] = min(accept_lengths[-1], max(1, end - start))


def _stop_seen_at(stops: list[StopRule], generated: list[int], start: int) -> int:
    """The fewest tokens of `generated` on which a rule stops, as when tokens come one at a
    time (a rule may drop the token that stopped it, keep it, or stop on a run of tokens)."""
    return next(
        (
            m
            for m in range(start + 1, len(generated) + 1)
            if _first_stop(stops, generated[:m], start)
        ),
        len(generated),
    )


def _first_stop(stops: list[StopRule], generated: list[int], start: int) -> tuple[int, str] | None:
    found: tuple[int, str] | None = None
    for rule in stops:
        at = rule.check_tokens(generated, start)
        if at is not None and (found is None or at < found[0]):
            found = (at, rule.finish_reason)
    return found


def decode(
    c: Components,
    prompt_ids: list[int],
    stream_text: bool = True,
    started: float | None = None,
) -> Iterator[Event]:
    """Generate after `prompt_ids`; yield committed text as it becomes final, then the result
    (and, before them, a PrefillEvent per chunk of a long prompt read).

    With `stream_text=False` no TextEvents come (text is decoded once at the end unless a stop
    string needs it sooner).
    """
    t0 = started if started is not None else time.perf_counter()
    budget, context_end = _output_budget(c, prompt_ids)
    pending: list[str] = []
    stream = TextStream(c.tokenizer, c.stops, pending.append if stream_text else None)
    exact_rows = c.verifier.exact_rows  # a verify past them would not be greedy's arithmetic
    max_draft = c.drafter.max_draft  # what the cap may ask for (None: the cap's own bound)
    if exact_rows is not None and max_draft is not None:
        max_draft = min(max_draft, exact_rows - 1)
    drafting = max_draft != 0 and exact_rows != 1

    c.sampler.begin()
    c.drafter.begin(prompt_ids, c.sampler)
    c.draft_cap.begin(prompt_ids)
    t_prefill = time.perf_counter()
    cache, logits, forwards = yield from _prefill(c, prompt_ids)
    generated = [as_int(c.sampler.sample(logits))]
    t_first = time.perf_counter()

    accept_lengths: list[int] = []
    overlap = overlaps_plain_rounds()
    vocab = config_vocab_size(c.model)
    ahead: mx.array | None = None  # logits of a plain round launched on the last token
    finish = "length"
    stopped_by_text = False
    start = 0
    while True:
        stop = _first_stop(c.stops, generated, start)
        if stop is None and context_end is not None and len(generated) >= context_end:
            stop = (context_end, "length")
        if stop is not None:
            _count_until(accept_lengths, start, _stop_seen_at(c.stops, generated, start))
            del generated[stop[0] :]
            finish = stop[1]
        if stream.active and (keep := stream.update(generated)) is not None:
            del generated[keep:]  # the cache may hold more; finish() is told what counts
            finish, stopped_by_text = "stop", True
            _count_until(accept_lengths, start, keep)
            break
        for piece in pending:
            yield TextEvent(piece)
        pending.clear()
        if stop is not None:
            break

        # One round.
        t_round = time.perf_counter()
        history: list[int] = []  # plain decoding never needs the whole history
        source, k = DRAFTER_SOURCE, 0
        if drafting:
            history = prompt_ids + generated
            source, k = _draft_size(c, max_draft, history)
        if budget is not None:
            k = min(k, budget - len(generated) - 1)  # the target's own token always comes too
        if exact_rows is not None:  # whatever the cap chose
            k = min(k, exact_rows - 1)
        if ahead is not None:  # this round's forward is in flight already: it drafts nothing
            k = 0
        draft = c.drafter.propose(history, k) if k > 0 else Draft()
        if not isinstance(draft, Draft) or (draft.pending is None and draft.tokens):
            _check_draft(c.drafter, draft, k, vocab)
        if draft.pending is not None:  # the drafter computes while the verify graph is built
            mx.async_eval(draft.pending)
        features_taken = ahead is not None  # after_forward ran when that forward was built
        if ahead is not None:
            logits, ahead = ahead, None
        else:
            logits = c.verifier.forward(c.model, draft.ids(generated[-1]), cache)
            forwards += 1
        if (
            k == 0
            and overlap
            and (budget is None or len(generated) + 1 < budget)
            and (not drafting or c.draft_cap.next_is_plain())
        ):
            if drafting and not features_taken:  # before the next forward replaces the taps
                c.drafter.after_forward(1)
                features_taken = True
            token = c.sampler.sample(logits[-1])
            ahead = c.verifier.forward(c.model, token.reshape(1), cache)
            forwards += 1
            if drafting:  # the next round's row, committed when that round reads its token
                c.drafter.after_forward(1)
            mx.async_eval(ahead)
            accepted, next_token = 0, as_int(token)
        else:
            accepted, next_token = c.sampler.verify(logits, draft)  # resolves a pending draft
        if draft.pending is not None:  # a sampler claiming resolves_pending that did not
            raise ConfigError(f"sampler {type(c.sampler).__name__} left the draft's ids pending")
        c.cache.trim(cache, len(draft.tokens) - accepted)
        start = len(generated)
        generated += [*draft.tokens[:accepted], next_token]
        accept_lengths.append(accepted + 1)
        if drafting:
            if not features_taken:
                c.drafter.after_forward(accepted + 1)  # rows of [last token, accepted drafts]
            c.drafter.observe(len(draft.tokens), accepted)
            c.draft_cap.observe(len(draft.tokens), accepted, time.perf_counter() - t_round, source)

    if ahead is not None:  # a stop ended the generation with the next forward in flight
        c.cache.trim(cache, 1)

    text = stream.finish(generated, stopped_by_text)
    for piece in pending:
        yield TextEvent(piece)
    c.cache.finish(cache, prompt_ids + generated[:-1])
    yield DoneEvent(
        _result(text, generated, accept_lengths, forwards, finish, (t0, t_prefill, t_first))
    )


def _result(
    text: str,
    generated: list[int],
    accept_lengths: list[int],
    forwards: int,
    finish: str,
    times: tuple[float, float, float],
) -> GenResult:
    """The figures of a finished generation; `times`: when it started, when the prefill began,
    when the first token was there."""
    t0, t_prefill, t_first = times
    t_end = time.perf_counter()
    n = len(generated)
    decode_time = t_end - t_first
    return GenResult(
        text=text,
        token_ids=generated,
        num_tokens=n,
        num_rounds=len(accept_lengths),
        target_forwards=forwards,
        mean_accept_len=(sum(accept_lengths) / len(accept_lengths)) if accept_lengths else 1.0,
        tokens_per_sec=n / (t_end - t0) if t_end > t0 else 0.0,
        decode_tokens_per_sec=(n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0,
        prefill_seconds=t_first - t_prefill,
        ttft_seconds=t_first - t0,
        finish_reason=finish,  # type: ignore[arg-type]
        accept_lengths=accept_lengths,
    )


def _output_budget(c: Components, prompt_ids: list[int]) -> tuple[int | None, int | None]:
    """(most tokens to generate, or None; the same when it is where the model's context ends).
    Refuses a prompt that is empty or fills the context."""
    if not prompt_ids:
        raise PromptError("the prompt is empty")
    limit = context_limit(c.model)
    if limit is not None and len(prompt_ids) >= limit:  # as the server's context_length_exceeded
        raise PromptError(
            f"the prompt has {len(prompt_ids)} tokens; this model's context holds {limit}"
        )
    budget = min((b for s in c.stops if (b := s.token_budget) is not None), default=None)
    room = limit - len(prompt_ids) if limit is not None else None
    if room is not None and (budget is None or room < budget):
        # Stop where the model's trained context ends (as the server refuses to pass it), not
        # run on past it (with a max_tokens beyond it) or until memory ends (without one).
        return room, room
    return budget, None


def _draft_size(c: Components, max_draft: int | None, history: list[int]) -> tuple[Any, int]:
    """(where this round's draft comes from, how many tokens the cap asks for)."""
    # A cap that does not read the source chooses without it; rounds that draft still learn it
    # for observe(), so only rounds drafting nothing skip the drafter's copy search.
    reads = c.draft_cap.reads_source
    source = c.drafter.source(history) if reads else DRAFTER_SOURCE
    k = c.draft_cap.choose(max_draft, source)
    if k > 0 and not reads:
        source = c.drafter.source(history)
    return source, k
