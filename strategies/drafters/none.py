"""drafter `none`: propose nothing, so each round commits the target's own token (plain decoding)."""

from __future__ import annotations

from typing import Literal

from dspark_flow.strategy import Draft, Drafter, StrategyConfig


class NoDrafterConfig(StrategyConfig):
    kind: Literal["none"] = "none"


class NoDrafter(Drafter):
    Config = NoDrafterConfig

    @property
    def max_draft(self) -> int:
        return 0

    def propose(self, history: list[int], k: int) -> Draft:
        return Draft()
