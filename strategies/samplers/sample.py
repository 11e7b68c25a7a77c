"""sampler `sample`: temperature / top-k / top-p / min-p sampling with exact speculative sampling.

A draft token d drawn from q is accepted with probability min(1, p(d)/q(d)); at the first rejection
the token is drawn from the normalised residual max(0, p - q). The committed tokens are then an
exact sample from the target's (processed) distribution p. A drafter with no distribution counts
as one-hot: accept with probability p(d), else sample from p with d removed.
"""

from __future__ import annotations

import random
from typing import Literal

import mlx.core as mx
from pydantic import Field

from dspark_flow.arrays import as_int, int_list
from dspark_flow.strategies.samplers.greedy import greedy_verify
from dspark_flow.strategy import Draft, Sampler, StrategyConfig


class SampleConfig(StrategyConfig):
    kind: Literal["sample"] = "sample"
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass to keep")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0: all)")
    min_p: float = Field(0.0, ge=0.0, lt=1.0, description="drop tokens below min_p x the top one")
    seed: int | None = Field(None, ge=0, lt=2**64, description="same seed, same output")


FLOAT32_TINY = 1.1754944e-38


def processed_probs(
    logits: mx.array, temperature: float, top_p: float, top_k: int, min_p: float
) -> mx.array:
    """Rows of `logits` -> the distribution tokens are drawn from."""
    logits = logits.astype(mx.float32)
    # Shifted to a maximum of 0 and divided by at least float32's smallest normal: a temperature
    # that rounds to 0 in float32 then sends the other logits to -inf instead of making NaNs.
    logits = (logits - mx.max(logits, axis=-1, keepdims=True)) / max(temperature, FLOAT32_TINY)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = mx.sort(logits, axis=-1)[..., vocab - top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if min_p > 0.0:
        floor = min_p * mx.max(probs, axis=-1, keepdims=True)
        probs = mx.where(probs < floor, 0.0, probs)
    if top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass ranked above each token
        # The token that crosses top_p stays, and so does the first (top_p may round to 0).
        keep_sorted = (before < top_p) | (mx.arange(vocab) == 0)
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
    return probs / mx.sum(probs, axis=-1, keepdims=True)


class SpeculativeSampler(Sampler):
    Config = SampleConfig
    resolves_pending = True
    config: SampleConfig

    def __init__(self, config: SampleConfig | None = None):
        super().__init__(config)
        self._key = mx.random.key(0)

    @property
    def greedy(self) -> bool:
        return self.config.temperature == 0.0

    def begin(self) -> None:
        seed = self.config.seed if self.config.seed is not None else random.getrandbits(63)
        self._key = mx.random.key(seed)

    def _next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def probs(self, logits: mx.array) -> mx.array:
        c = self.config
        if self.greedy:
            return mx.softmax(logits.astype(mx.float32), axis=-1)
        return processed_probs(logits, c.temperature, c.top_p, c.top_k, c.min_p)

    def sample(self, logits: mx.array) -> mx.array:
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return mx.random.categorical(mx.log(self.probs(logits)), key=self._next_key())

    def sample_from(self, probs: mx.array) -> mx.array:
        """Draw from an already processed distribution (for drafters that keep q)."""
        return mx.random.categorical(mx.log(probs), key=self._next_key())

    def verify(self, logits: mx.array, draft: Draft) -> tuple[int, int]:
        if self.greedy:
            return greedy_verify(logits, draft)
        draft.resolve()  # drafters leave ids pending only when greedy; a sync otherwise
        k = len(draft.tokens)
        p = self.probs(logits)
        if k == 0:
            return 0, as_int(self.sample_from(p[0]))
        rows = mx.arange(k)
        proposed = mx.array(draft.tokens)
        p_draft = p[rows, proposed]
        if draft.probs is None:
            q_draft = mx.ones_like(p_draft)
            residual = mx.where(mx.arange(p.shape[-1])[None] == proposed[:, None], 0.0, p[:k])
        else:
            q_draft = draft.probs[rows, proposed]
            residual = mx.maximum(p[:k] - draft.probs, 0.0)
        mass = mx.sum(residual, axis=-1, keepdims=True)
        # Zero residual mass means p == q on that row, where the draft is always accepted.
        residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:k])
        accept = mx.random.uniform(shape=(k,), key=self._next_key()) * q_draft < p_draft
        corrections = mx.random.categorical(mx.log(residual), key=self._next_key())
        bonus = mx.random.categorical(mx.log(p[k]), key=self._next_key())
        packed = int_list(
            mx.concatenate(
                [
                    accept.astype(mx.int32),
                    corrections.astype(mx.int32),
                    bonus.astype(mx.int32)[None],
                ]
            )
        )  # the round's one host sync
        n = 0
        while n < k and packed[n]:
            n += 1
        return n, packed[k + n] if n < k else packed[2 * k]
