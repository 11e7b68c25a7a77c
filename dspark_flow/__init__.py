"""dspark-flow: lossless speculative decoding for MLX language models.

The public API is imported lazily so that `import dspark_flow` (and `dspark-flow list`) stays
fast and does not load MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Before anything imports mlx.core: let libmlx bind its BLAS calls to OpenBLAS where installed
# (the mlx[cpu] wheel's own reference BLAS makes float32 forwards 2.6-19x slower).
from dspark_flow.models.backend import prefer_openblas as _prefer_openblas  # noqa: E402

_prefer_openblas()

_EXPORTS = {
    "GenResult": "dspark_flow.result",
    "Pipeline": "dspark_flow.pipeline",
    "Recipe": "dspark_flow.recipe.schema",
    "load_recipe": "dspark_flow.recipe.load",
    "load_target": "dspark_flow.api",
    "greedy_generate": "dspark_flow.api",
    "lookup_generate": "dspark_flow.api",
    "draft_model_generate": "dspark_flow.api",
    "calibrate": "dspark_flow.api",
    "load_pair": "dspark_flow.api",
    "load_drafter": "dspark_flow.api",
    "speculative_generate": "dspark_flow.api",
    "load_dflash_pair": "dspark_flow.api",
    "dflash_generate": "dspark_flow.api",
    "DsparkFlowError": "dspark_flow.errors",
    "release_thread_streams": "dspark_flow.models.backend",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from dspark_flow.api import (
        calibrate,
        dflash_generate,
        draft_model_generate,
        greedy_generate,
        load_dflash_pair,
        load_drafter,
        load_pair,
        load_target,
        lookup_generate,
        speculative_generate,
    )
    from dspark_flow.errors import DsparkFlowError
    from dspark_flow.models.backend import release_thread_streams
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.recipe.load import load_recipe
    from dspark_flow.recipe.schema import Recipe
    from dspark_flow.result import GenResult


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dspark_flow' has no attribute {name!r}")
