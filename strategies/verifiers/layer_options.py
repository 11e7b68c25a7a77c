"""Options both verifiers take for the target's decoder layers on verify-sized forwards."""

from __future__ import annotations

from pydantic import Field

from dspark_flow.models.compiled_layers import COMPILE_LAYERS_HELP
from dspark_flow.strategy import StrategyConfig

FUSE_PROJECTIONS_HELP = (
    "with compile_layers (no effect without it): each attention's q/k/v and each swiglu "
    "MLP's gate/up run as one stacked matmul on the compiled path (seven matmuls a layer "
    "become four; the same values, "
    "the separate projections become views of the stacked weights: no extra memory; "
    "dspark_flow/models/fused_projections.py)"
)


class LayerOptions(StrategyConfig):
    compile_layers: bool = Field(False, description=COMPILE_LAYERS_HELP)
    # Only the compiled path calls the stacks: without compile_layers it does nothing (not an
    # error: `--set verifier.compile_layers=false` on the CLI's stack must still work).
    fuse_projections: bool = Field(False, description=FUSE_PROJECTIONS_HELP)

    @property
    def fusing(self) -> bool:
        return self.fuse_projections and self.compile_layers
