"""stop `max_tokens`: end after `limit` generated tokens (finish_reason "length")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dspark_flow.strategy import StopRule, StrategyConfig


class MaxTokensConfig(StrategyConfig):
    kind: Literal["max_tokens"] = "max_tokens"
    limit: int = Field(256, ge=1, description="most tokens to generate")


class MaxTokensStop(StopRule):
    Config = MaxTokensConfig
    config: MaxTokensConfig

    @property
    def finish_reason(self) -> str:
        return "length"

    @property
    def token_budget(self) -> int:
        return self.config.limit

    def check_tokens(self, generated: list[int], start: int) -> int | None:
        return self.config.limit if len(generated) >= self.config.limit else None
