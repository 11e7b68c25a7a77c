"""draft_cap `full_block`: draft as many tokens as the drafter's block holds."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dspark_flow.strategy import DRAFTER_SOURCE, DraftCap, StrategyConfig


class FullBlockConfig(StrategyConfig):
    kind: Literal["full_block"] = "full_block"
    unbounded_k: int = Field(
        16, ge=1, description="k for drafters without a block size (e.g. a draft model)"
    )


class FullBlockCap(DraftCap):
    Config = FullBlockConfig
    config: FullBlockConfig

    reads_source = False  # the same k whatever the source

    def choose(self, drafter_max: int | None, source: str = DRAFTER_SOURCE) -> int:
        return self.config.unbounded_k if drafter_max is None else drafter_max
