"""stop `eos`: end at the tokenizer's end-of-sequence tokens (the token is not part of the output)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dspark_flow.strategy import BuildContext, StopRule, StrategyConfig


class EosConfig(StrategyConfig):
    kind: Literal["eos"] = "eos"
    extra_token_ids: list[int] = Field(default_factory=list, description="more ids that end output")


class EosStop(StopRule):
    Config = EosConfig
    config: EosConfig

    def warm_up(self, ctx: BuildContext) -> None:
        ids = set(getattr(ctx.tokenizer, "eos_token_ids", None) or [])
        eos = getattr(ctx.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(eos)
        self.ids = ids | set(self.config.extra_token_ids)

    def check_tokens(self, generated: list[int], start: int) -> int | None:
        for i in range(start, len(generated)):
            if generated[i] in self.ids:
                return i
        return None
