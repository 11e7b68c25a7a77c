"""verifier `reference`: the target's own forward pass in plain MLX (the twin every kernel is
checked against), optionally with its decoder layers compiled for verify-sized forwards."""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from dspark_flow.kernels.qmm_small_m import MAX_ROWS
from dspark_flow.models.compiled_layers import CompiledLayers, compiled_scope
from dspark_flow.models.fused_projections import FusedProjections
from dspark_flow.strategies.verifiers.layer_options import LayerOptions
from dspark_flow.strategy import BuildContext, Verifier


class ReferenceConfig(LayerOptions):
    kind: Literal["reference"] = "reference"


class ReferenceVerifier(Verifier):
    Config = ReferenceConfig
    config: ReferenceConfig

    def __init__(self, config: ReferenceConfig | None = None):
        super().__init__(config)
        self.compiled: CompiledLayers | None = None
        self._model_id: int | None = None

    def warm_up(self, ctx: BuildContext) -> None:
        if not self.config.compile_layers or self._model_id == id(ctx.model):
            return
        if self.compiled is not None:  # warmed for another model before
            self.compiled.restore()
        fused = FusedProjections.install(ctx.model) if self.config.fusing else None
        self.compiled = CompiledLayers(MAX_ROWS, fused)
        self.compiled.install(ctx.model)
        self._model_id = id(ctx.model)

    def forward(self, model: nn.Module, tokens: list[int] | mx.array, cache: list[Any]) -> mx.array:
        ids = mx.array(tokens, dtype=mx.uint32)[None]
        with compiled_scope(self.compiled):
            return model(ids, cache=cache)[0]
