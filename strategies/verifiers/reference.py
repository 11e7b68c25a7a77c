"""verifier `reference`: the target's own forward pass in plain MLX (the twin every kernel is
checked against)."""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from dspark_flow.strategy import StrategyConfig, Verifier


class ReferenceConfig(StrategyConfig):
    kind: Literal["reference"] = "reference"


class ReferenceVerifier(Verifier):
    Config = ReferenceConfig

    def forward(self, model: nn.Module, tokens: list[int], cache: list[Any]) -> mx.array:
        return model(mx.array(tokens, dtype=mx.uint32)[None], cache=cache)[0]
