"""cache `kv`: mlx-lm's per-layer KV cache, rolled back by trimming the rejected tail."""

from __future__ import annotations

from typing import Any, Literal

import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from dspark_flow.errors import ConfigError
from dspark_flow.strategy import BuildContext, CacheStrategy, StrategyConfig


class KVCacheConfig(StrategyConfig):
    kind: Literal["kv"] = "kv"


class KVCacheStrategy(CacheStrategy):
    Config = KVCacheConfig

    def warm_up(self, ctx: BuildContext) -> None:
        # Speculation rolls back rejected tokens; a cache that cannot be trimmed (rotating window,
        # recurrent state) would silently keep them, so refuse instead of producing wrong output.
        drafting = ctx.drafter is not None and ctx.drafter.max_draft != 0
        if drafting and not can_trim_prompt_cache(make_prompt_cache(ctx.model)):
            raise ConfigError(
                "this target's cache cannot be rolled back (rotating or recurrent layers), "
                "so speculative drafting would be wrong; use drafter 'none'"
            )

    def new(self, model: nn.Module, prompt_ids: list[int]) -> tuple[list[Any], int]:
        return make_prompt_cache(model), 0

    def trim(self, cache: list[Any], n: int) -> None:
        if n > 0:
            trim_prompt_cache(cache, n)
