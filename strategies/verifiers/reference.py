"""verifier `reference`: the target's own forward pass in plain MLX (the library's default,
and what the `kernels` verifier's output is compared with), optionally with its decoder layers
compiled for verify-sized forwards.

On CUDA (option `attention: auto`) the target's half-precision attention for several queries
runs as plain MLX matmuls (`dspark_flow/models/attention.py`): there MLX hands it to cuDNN, which
plans every new key length, and a verify's keys grow every round."""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import Field

from dspark_flow.kernels.qmm_small_m import MAX_ROWS
from dspark_flow.models.attention import (
    HALF_PRECISION,
    AttentionChoice,
    AttentionHook,
    attention_hook,
    matmul_chosen,
    matmul_verify_attention,
    unwrap_attention,
    wrap_attention,
)
from dspark_flow.models.compiled_layers import CompiledLayers, compiled_scope
from dspark_flow.models.fused_projections import FusedProjections
from dspark_flow.strategies.verifiers.layer_options import LayerOptions
from dspark_flow.strategy import BuildContext, Verifier


class ReferenceConfig(LayerOptions):
    kind: Literal["reference"] = "reference"
    attention: AttentionChoice = Field(
        "auto",
        description="the target's attention for 2 or more queries (verifies, short prefills): "
        "fused = MLX's scaled_dot_product_attention, matmul = two matmuls and a softmax in "
        "float32 (no per-shape plan; up to 16,384 keys); auto = matmul for float16/bfloat16 "
        "attention on CUDA, "
        "where MLX's fused attention goes through cuDNN, which plans every new key length "
        "(37-75 ms a call on an H200), fused elsewhere",
    )

    def attention_route(self) -> AttentionHook | None:
        """What the verifier's forward routes the attention through (None: MLX's own)."""
        if not matmul_chosen(self.attention):
            return None
        if self.attention == "matmul":
            return matmul_verify_attention
        return partial(matmul_verify_attention, dtypes=HALF_PRECISION)  # auto: cuDNN's dtypes


class ReferenceVerifier(Verifier):
    Config = ReferenceConfig
    config: ReferenceConfig

    def __init__(self, config: ReferenceConfig | None = None):
        super().__init__(config)
        self.compiled: CompiledLayers | None = None
        self._model_id: int | None = None
        self._hook = self.config.attention_route()
        self._finalizer: weakref.finalize | None = None

    def warm_up(self, ctx: BuildContext) -> None:
        if self._model_id == id(ctx.model):
            return
        self.restore()  # warmed for another model before
        if self._hook is not None:
            wrap_attention(ctx.model, id(self))
            if self._finalizer is None:
                # one-call APIs never restore their pipeline: drop the claim when collected
                self._finalizer = weakref.finalize(self, unwrap_attention, id(self))
        if self.config.compile_layers:
            fused = FusedProjections.install(ctx.model) if self.config.fusing else None
            self.compiled = CompiledLayers(MAX_ROWS, fused)
            self.compiled.install(ctx.model)
        self._model_id = id(ctx.model)

    def restore(self) -> None:
        """Give the model its own layers and attention function back."""
        if self.compiled is not None:
            self.compiled.restore()
            self.compiled = None
        unwrap_attention(id(self))
        self._model_id = None

    def forward(self, model: nn.Module, tokens: list[int] | mx.array, cache: list[Any]) -> mx.array:
        ids = mx.array(tokens, dtype=mx.uint32)[None]
        # the hook only for the model this verifier wrapped: another's wrapper may be in place
        hook = self._hook if self._model_id == id(model) else None
        with compiled_scope(self.compiled), attention_hook(hook):
            return model(ids, cache=cache)[0]
