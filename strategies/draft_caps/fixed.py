"""draft_cap `fixed`: the same k every round (clipped to what the drafter can propose)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dspark_flow.strategy import DRAFTER_SOURCE, DraftCap, StrategyConfig

MAX_K = 1024


class FixedCapConfig(StrategyConfig):
    kind: Literal["fixed"] = "fixed"
    k: int = Field(4, ge=1, le=MAX_K, description=f"tokens to draft per round (at most {MAX_K})")


class FixedCap(DraftCap):
    Config = FixedCapConfig
    config: FixedCapConfig

    reads_source = False  # the same k whatever the source

    def choose(self, drafter_max: int | None, source: str = DRAFTER_SOURCE) -> int:
        return self.config.k if drafter_max is None else min(self.config.k, drafter_max)
