"""drafter `draft_model`: classic speculative decoding with a second, smaller mlx-lm model.

The draft model keeps its own KV cache. Instead of rolling it back by hand after each round, it
remembers which tokens it has fed and, before drafting, trims back to the longest prefix shared
with the committed history and feeds the rest: the cache can never drift out of step.
"""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from pydantic import Field

from dspark_flow.arrays import int_list
from dspark_flow.errors import ConfigError
from dspark_flow.models.context import config_vocab_size
from dspark_flow.recipe.schema import WeightFormat
from dspark_flow.strategy import (
    BuildContext,
    Draft,
    Drafter,
    Sampler,
    StrategyConfig,
    accepted_prefix,
)


class DraftModelConfig(StrategyConfig):
    kind: Literal["draft_model"] = "draft_model"
    model: str = Field(..., description="builtin:<name>, hub repo id or local mlx-lm directory")
    revision: str | None = Field(None, description="hub revision of the draft model to pin")
    weights: WeightFormat = Field(
        "auto", description="the draft model's weight format, chosen as the target's is"
    )


class DraftModelDrafter(Drafter):
    Config = DraftModelConfig
    config: DraftModelConfig

    def __init__(self, config: DraftModelConfig | None = None, model: Any = None):
        super().__init__(config)
        self.model: nn.Module | None = model
        self._cache: list[Any] = []
        self._fed: list[int] = []
        self._sampler: Sampler | None = None
        self._width: int | None = None  # the target's logits, which the draft's must match

    def warm_up(self, ctx: BuildContext) -> None:
        if self.model is None:
            from dspark_flow.models.loading import load

            cfg = self.config
            self.model, tokenizer = load(cfg.model, cfg.weights, cfg.revision)
            check_same_tokenizer(ctx.tokenizer, tokenizer, self.config.model)
        # Models of one family share a tokenizer but pad their embeddings differently
        # (Qwen2.5-0.5B 151,936 rows, -7B 152,064).
        self._width = config_vocab_size(ctx.model)
        if not can_trim_prompt_cache(make_prompt_cache(self.loaded)):
            raise ConfigError(f"draft model {self.config.model}: its cache cannot be trimmed")

    @property
    def loaded(self) -> nn.Module:
        if self.model is None:
            raise ConfigError("the draft model is not loaded: call warm_up() first")
        return self.model

    def begin(self, prompt_ids: list[int], sampler: Sampler) -> None:
        self._cache = make_prompt_cache(self.loaded)
        self._fed = []
        self._sampler = sampler
        # Prefill the draft model now, so its prompt cost lands in time-to-first-token (as in
        # mlx-lm) rather than in the first round's drafting time.
        if len(prompt_ids) > 1:
            self._catch_up(prompt_ids[:-1])
            mx.eval([c.state for c in self._cache])

    def _catch_up(self, history: list[int]) -> mx.array:
        """Bring the cache in step with `history`; return logits for the token after it."""
        # always feed at least one token
        common = min(accepted_prefix(self._fed, history), len(history) - 1)
        if len(self._fed) > common:
            trim_prompt_cache(self._cache, len(self._fed) - common)
        logits = self.loaded(mx.array(history[common:], dtype=mx.uint32)[None], cache=self._cache)
        self._fed = list(history)
        return self._fit(logits[0, -1])

    def _fit(self, logits: mx.array) -> mx.array:
        """The draft's logits over the target's ids: padding rows past the target's are never
        drafted, ids past the draft's own get no mass. q is what the draft samples from, so
        speculative sampling stays exact."""
        width, have = self._width, logits.shape[-1]
        if width is None or width == have:
            return logits
        if have > width:
            return logits[..., :width]
        return mx.concatenate([logits, mx.full((width - have,), -mx.inf, logits.dtype)])

    def propose(self, history: list[int], k: int) -> Draft:
        assert self._sampler is not None, "begin() first"
        greedy = self._sampler.greedy
        logits = self._catch_up(history)
        tokens: list[mx.array] = []
        dists: list[mx.array] = []
        for i in range(k):
            if greedy:
                token = mx.argmax(logits, axis=-1)
            else:
                q = self._sampler.probs(logits[None])[0]
                dists.append(q)
                token = self._sampler.sample_from(q)
            tokens.append(token)
            if i + 1 < k:  # the last draft token is fed next round, if accepted
                step = self.loaded(token.reshape(1, 1).astype(mx.uint32), cache=self._cache)
                logits = self._fit(step[0, -1])
        ids = int_list(mx.stack(tokens))
        self._fed += ids[:-1]
        return Draft(tokens=ids, probs=mx.stack(dists) if dists else None)


def check_same_tokenizer(target_tok: Any, draft_tok: Any, name: str) -> None:
    """Speculation compares token ids, so both models must share one vocabulary."""
    target_vocab = target_tok.get_vocab()
    draft_vocab = draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        differ = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
        raise ConfigError(
            f"draft model {name} has a different tokenizer from the target "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differ} entries differ); "
            "a draft model must share the target's vocabulary"
        )
