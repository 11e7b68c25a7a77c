"""The recipe as pure data: pydantic models, `extra="forbid"` everywhere.

Slot sections are validated in two steps (see `dspark_flow.recipe.load`): the outer shape here,
then each section against the `Config` of the kind it names, imported from the registry.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializeAsAny

from dspark_flow.recipe.section import Section
from dspark_flow.strategy import StrategyConfig

WeightFormat = Literal["auto", "native", "float32", "bfloat16", "float16"]

DEFAULT_MODEL = "builtin:smollm2-135m"

# Sections a recipe may leave out, with the kinds they default to.
SLOT_DEFAULTS: dict[str, Any] = {
    "drafter": {"kind": "none"},
    "verifier": {"kind": "reference"},
    "sampler": {"kind": "greedy"},
    "draft_cap": {"kind": "fixed"},
    "cache": {"kind": "kv"},
    "stop": [{"kind": "eos"}, {"kind": "max_tokens"}],
}

# What the command line (run, bench, calibrate) and the server fill in where a recipe leaves a
# slot out; the library keeps SLOT_DEFAULTS. The kernels verifier takes a kernel only where its
# probe on this machine found it correct (and, invariant, keeps every row count on the same
# arithmetic so that speculation reproduces greedy bit for bit); on the CPU, where no kernel
# runs, MLX's own matmuls and attention in chunks of their row-invariant spans.
# `compile_layers` compiles each layer's MLP and the attention's stateless parts for
# verify-sized forwards (same values, fewer host-side operations:
# docs/benchmarks.md §4, "compiled verify layers"); `fuse_projections` stacks each layer's q/k/v
# and gate/up quantized matmuls there (4-bit targets; same values; +3-4% on the H200, §4).
TOOL_DEFAULTS: dict[str, Any] = {
    "verifier": {
        "kind": "kernels",
        "invariant": True,
        "compile_layers": True,
        "fuse_projections": True,
    }
}


class TargetSpec(Section):
    model: str = Field(
        DEFAULT_MODEL, min_length=1, description="builtin:<name>, a hub repo id or a local dir"
    )
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) to pin")
    weights: WeightFormat = Field(
        "auto",
        description="auto picks per backend: float32 on CPU (flat verify cost), native elsewhere",
    )


class PromptSpec(Section):
    chat: bool = Field(True, description="wrap prompts in the target's chat template")
    system: str | None = Field(None, description="system message for chat prompts")


class RecipeShape(Section):
    """Step one: everything but the contents of the slot sections."""

    version: Literal[1] = Field(1, description="recipe format version")
    name: str | None = Field(
        None,
        description="names the recipe's column in bench reports and the model id serve answers with",
    )
    description: str | None = Field(None, description="free text for the reader")
    target: TargetSpec = TargetSpec()
    prompt: PromptSpec = PromptSpec()
    drafter: dict[str, Any] = Field(default_factory=lambda: dict(SLOT_DEFAULTS["drafter"]))
    verifier: dict[str, Any] = Field(default_factory=lambda: dict(SLOT_DEFAULTS["verifier"]))
    sampler: dict[str, Any] = Field(default_factory=lambda: dict(SLOT_DEFAULTS["sampler"]))
    draft_cap: dict[str, Any] = Field(default_factory=lambda: dict(SLOT_DEFAULTS["draft_cap"]))
    cache: dict[str, Any] = Field(default_factory=lambda: dict(SLOT_DEFAULTS["cache"]))
    stop: list[dict[str, Any]] = Field(
        default_factory=lambda: [dict(s) for s in SLOT_DEFAULTS["stop"]]
    )


class Recipe(Section):
    """A validated recipe: the slot sections are the named kinds' own config objects."""

    version: Literal[1] = 1
    name: str | None = None
    description: str | None = None
    target: TargetSpec = TargetSpec()
    prompt: PromptSpec = PromptSpec()
    drafter: SerializeAsAny[StrategyConfig]
    verifier: SerializeAsAny[StrategyConfig]
    sampler: SerializeAsAny[StrategyConfig]
    draft_cap: SerializeAsAny[StrategyConfig]
    cache: SerializeAsAny[StrategyConfig]
    stop: list[SerializeAsAny[StrategyConfig]]

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<recipe>") -> Recipe:
        from dspark_flow.recipe.load import validate

        return validate(data, source=source)

    def to_dict(self) -> dict[str, Any]:
        # Nulls kept: a None that is not the default (a drafter's `quantize: null`, keep the
        # float weights) would come back as the default.
        return self.model_dump(mode="json")
