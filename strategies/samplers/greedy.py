"""sampler `greedy`: take the target's argmax; a draft is accepted while it equals it."""

from __future__ import annotations

from typing import Literal

import mlx.core as mx

from dspark_flow.arrays import int_list
from dspark_flow.strategy import Draft, Sampler, StrategyConfig, accepted_prefix


class GreedyConfig(StrategyConfig):
    kind: Literal["greedy"] = "greedy"


def greedy_verify(logits: mx.array, draft: Draft) -> tuple[int, int]:
    """Longest prefix of the draft equal to the target's argmax, plus the argmax after it."""
    argmax = mx.argmax(logits, axis=-1)
    if draft.pending is None:
        choices = int_list(argmax)  # the round's one host sync
    else:  # a pending draft comes to the host in the same sync
        both = int_list(mx.concatenate([argmax.astype(mx.int64), draft.pending.astype(mx.int64)]))
        choices = both[: logits.shape[0]]
        draft.resolve(both[logits.shape[0] :])
    n = accepted_prefix(draft.tokens, choices)
    return n, choices[n]


class GreedySampler(Sampler):
    Config = GreedyConfig
    resolves_pending = True

    def probs(self, logits: mx.array) -> mx.array:
        return mx.softmax(logits.astype(mx.float32), axis=-1)

    def sample(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1)

    def verify(self, logits: mx.array, draft: Draft) -> tuple[int, int]:
        return greedy_verify(logits, draft)
