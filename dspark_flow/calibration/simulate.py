"""Replaying a draft cap on recorded drafts: what it would decode, and how fast, with no noise.

At temperature 0 the committed tokens are the target's greedy output whatever k each round
picks, and a drafter's proposal at a position depends only on the tokens before it. So one
pass that asks the drafter for a full block at *every* position of the greedy output (and then
commits just the target's own token) records everything any cap would see: a round at position
j that drafts k tokens proposes min(k, L[j]) of them and gets min(k, L[j], A[j]) accepted,
where L[j] is the full proposal's length and A[j] how many of its leading tokens match the
output. Charging each replayed round the measured verify and drafter cost gives a cap's decode
time without machine noise, for any cost curves: drafts recorded on this CPU can be replayed
against curves measured on a GPU, which is how `auto` is tuned without spending device time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dspark_flow.calibration.curves import Curves
from dspark_flow.strategy import COPY_SOURCE, DRAFTER_SOURCE, Draft, DraftCap, accepted_prefix


@dataclass
class DraftTrace:
    """One prompt's greedy decode as a drafter sees it. Index j of `proposed`/`accepted` is
    the round whose last committed token is token j - 1 (index 0, the prefill's token, is
    unused): the full proposal's length there and how many of its leading tokens match."""

    prompt_len: int
    num_tokens: int  # the output's length (the prefill's token first, a cut stop token not)
    end: int  # tokens the loop commits before it stops (num_tokens + 1 when a stop token is cut)
    budget: int  # max_new_tokens: the loop never drafts past it
    proposed: list[int]
    accepted: list[int]
    category: str = ""
    # Index j: the source the round's draft comes from (`Drafter.source`); None: the drafter's
    # own pass everywhere (traces recorded before sources were).
    sources: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftTrace:
        return cls(**data)


@dataclass
class Replay:
    seconds: float = 0.0
    tokens: int = 0  # decode tokens (after the prefill's first)
    rounds: int = 0
    chosen: Counter[int] = field(default_factory=Counter)  # k per round
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per round

    def add(self, other: Replay) -> None:
        self.seconds += other.seconds
        self.tokens += other.tokens
        self.rounds += other.rounds
        self.chosen += other.chosen
        self.accept_lengths += other.accept_lengths


def record_trace(pipeline: Any, prompt: str, max_tokens: int, category: str = "") -> DraftTrace:
    """Decode `prompt` greedily with `pipeline` (a warmed-up Pipeline whose drafter drafts),
    asking the drafter for as much as it allows at every position but verifying none of it."""
    drafter, sampler = pipeline.drafter, pipeline.sampler
    if drafter.max_draft == 0:
        raise ValueError("record_trace needs a pipeline whose drafter drafts")
    if not getattr(sampler, "greedy", False):
        raise ValueError("record_trace replays greedy decoding: use a greedy sampler")
    drafts: dict[int, list[int]] = {}
    sources: dict[int, str] = {}
    committed: list[int] = []  # every round's token, a stop token the output drops included
    prompt_len = len(pipeline.encode_prompt(prompt))
    originals = drafter.propose, pipeline.draft_cap.choose, sampler.verify

    def propose(history: list[int], k: int) -> Draft:
        sources[len(history) - prompt_len] = drafter.source(history)
        drafts[len(history) - prompt_len] = list(originals[0](history, k).resolve().tokens)
        return Draft()  # the round verifies only the target's own token

    def verify(logits: Any, draft: Draft) -> tuple[int, int]:
        accepted, token = originals[2](logits, draft)
        committed.append(int(token))
        return accepted, token

    drafter.propose, sampler.verify = propose, verify
    pipeline.draft_cap.choose = lambda drafter_max, source=DRAFTER_SOURCE: drafter_max or 16
    try:
        result = pipeline.generate(prompt, max_new_tokens=max_tokens)
    finally:
        drafter.propose, pipeline.draft_cap.choose, sampler.verify = originals
    out = result.token_ids[:1] + committed
    proposed, accepted = [0] * len(out), [0] * len(out)
    source_at = [DRAFTER_SOURCE] * len(out)
    for j, tokens in drafts.items():
        if 1 <= j < len(out):
            proposed[j] = len(tokens)
            accepted[j] = accepted_prefix(tokens, out[j:])
            source_at[j] = sources[j]
    return DraftTrace(
        prompt_len,
        result.num_tokens,
        len(out),
        max_tokens,
        proposed,
        accepted,
        category,
        source_at,
    )


def replay(cap: DraftCap, trace: DraftTrace, curves: Curves, block: int) -> Replay:
    """Decode `trace` with `cap` choosing k each round (at most `block`); every round is charged
    `curves.round_cost(proposed, depth)`: verify(proposed + 1 rows) + drafter(proposed), the
    drafter's part only where the round's source runs it (not for a copied run)."""
    out = Replay()
    cap.begin([0] * trace.prompt_len)
    j = 1
    while j < trace.end:
        source = trace.sources[j] if trace.sources else DRAFTER_SOURCE
        k = min(cap.choose(block, source), block, trace.budget - j - 1)  # the loop's budget
        depth = trace.prompt_len + j
        proposed = min(max(k, 0), trace.proposed[j])
        accepted = min(proposed, trace.accepted[j])
        seconds = curves.round_cost(proposed, depth, source != COPY_SOURCE)
        out.seconds += seconds
        out.rounds += 1
        out.chosen[max(k, 0)] += 1
        # A round whose drafts run to the trace's end commits no bonus token past it: the loop
        # stops at the end (a stop token or the budget), and counts the round up to there.
        out.accept_lengths.append(min(accepted + 1, trace.end - j))
        cap.observe(proposed, accepted, seconds, source)  # learns the charge as a round time
        j += accepted + 1
    out.tokens = max(0, trace.num_tokens - 1)
    return out
