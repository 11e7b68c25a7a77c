"""Options both verifiers take for the target's decoder layers on verify-sized forwards."""

from __future__ import annotations

from pydantic import Field, model_validator

from dspark_flow.models.compiled_layers import COMPILE_LAYERS_HELP
from dspark_flow.strategy import StrategyConfig

FUSE_PROJECTIONS_HELP = (
    "with compile_layers: each attention's q/k/v and each swiglu MLP's gate/up run as one "
    "stacked matmul on the compiled path (seven matmuls a layer become four; the same values, "
    "the separate projections become views of the stacked weights: no extra memory; "
    "dspark_flow/models/fused_projections.py)"
)


class LayerOptions(StrategyConfig):
    compile_layers: bool = Field(False, description=COMPILE_LAYERS_HELP)
    fuse_projections: bool = Field(False, description=FUSE_PROJECTIONS_HELP)

    @model_validator(mode="after")
    def _fusion_runs_compiled(self) -> LayerOptions:
        if self.fuse_projections and not self.compile_layers:
            raise ValueError(
                "fuse_projections needs compile_layers: true (the stacked projections run on "
                "the compiled path)"
            )
        return self
