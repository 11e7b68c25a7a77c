"""What a bench run measures: targets (each loaded once) and the modes run against each.

A mode is one way of generating: a recipe through our decode loop, or a baseline. Every target
gets two baselines - `greedy` (our loop with drafter `none`) and `mlx-lm` (mlx-lm's own
`stream_generate`) - plus `mlx-lm-spec[<recipe>]` (mlx-lm's own speculative decoding) for each
recipe whose drafter is a draft model, with the same draft model and draft length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dspark_flow.kernels.qmm_small_m import MAX_ROWS as MAX_VERIFY_ROWS
from dspark_flow.log import get_logger
from dspark_flow.pipeline import Pipeline
from dspark_flow.recipe.schema import TOOL_DEFAULTS, Recipe

log = get_logger()

ModeKind = Literal["ours", "mlx_lm", "mlx_lm_spec"]
GREEDY = "greedy"
MLX_LM = "mlx-lm"
DEFAULT_MLX_DRAFT = 2  # mlx-lm's own default when a recipe's cap has no fixed k


@dataclass
class Mode:
    name: str
    kind: ModeKind
    pipeline: Pipeline | None = None  # kind "ours"
    draft_model: Any = None  # kind "mlx_lm_spec"
    num_draft_tokens: int = 0
    baseline: bool = False
    greedy: bool = True  # T = 0: its output must equal the greedy baseline's
    prefix_only: bool = False  # text stop rules may end it early: compare as a prefix
    pair: str | None = None  # mlx-lm-spec: the recipe mode it mirrors
    source: str | None = None  # recipe file, for the report


@dataclass
class TargetGroup:
    label: str  # e.g. "builtin:smollm2-135m (float32)"
    model: Any
    tokenizer: Any
    weight_format: str
    # The greedy baseline; it also turns prompt text into ids (the first recipe's prompt settings).
    encoder: Pipeline
    modes: list[Mode] = field(default_factory=list)

    def mode(self, name: str) -> Mode:
        return next(m for m in self.modes if m.name == name)


def greedy_pipeline(recipe: Recipe, target: tuple[Any, Any]) -> Pipeline:
    """The recipe's target, prompt settings and verifier, plain greedy decoding (the budget is
    set later). The same verifier, so that the outputs compared are computed the same way (a
    kernels verifier in invariant mode reproduces only its own greedy output bit for bit);
    mlx-lm's own greedy is the stock-speed baseline."""
    data = {
        "name": GREEDY,
        "target": recipe.target.model_dump(mode="json"),
        "prompt": recipe.prompt.model_dump(mode="json"),
        "verifier": _baseline_verifier(recipe),
        "drafter": {"kind": "none"},
        "sampler": {"kind": "greedy"},
        "stop": [{"kind": "eos"}],
    }
    return Pipeline.from_dict(data, target=target)


def _baseline_verifier(recipe: Recipe) -> dict[str, Any]:
    """The recipe's verifier for the baseline; a kernels verifier routes every verify shape
    (its default would size itself to drafter `none`: one row), since the baseline's pipeline
    also times the verify cost curve for K = 1..16."""
    verifier = recipe.verifier.model_dump(mode="json")
    if verifier.get("kind") == "kernels" and verifier.get("max_rows") is None:
        verifier["max_rows"] = MAX_VERIFY_ROWS
    return verifier


def _draft_length(recipe: Recipe) -> int:
    cap = recipe.draft_cap
    for attr in ("k", "unbounded_k"):  # fixed / full_block; other caps adapt, no single k
        if isinstance(getattr(cap, attr, None), int):
            return int(getattr(cap, attr))
    return DEFAULT_MLX_DRAFT


def _has_text_stops(recipe: Recipe) -> bool:
    return any(s.kind == "strings" for s in recipe.stop)


def recipe_mode(pipeline: Pipeline, name: str, source: str | None = None) -> Mode:
    recipe = pipeline.recipe
    return Mode(
        name=name,
        kind="ours",
        pipeline=pipeline,
        greedy=bool(getattr(pipeline.sampler, "greedy", False)),  # the object, not the recipe
        prefix_only=_has_text_stops(recipe),
        source=source,
    )


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}#{n}", n + 1
    taken.add(candidate)
    return candidate


def add_baselines(group: TargetGroup, mlx_lm: bool) -> None:
    """Put `greedy` (and `mlx-lm`) in front of the group's modes."""
    front = [Mode(GREEDY, "ours", pipeline=group.encoder, baseline=True)]
    if mlx_lm:
        front.append(Mode(MLX_LM, "mlx_lm", baseline=True))
    group.modes[:0] = front


def add_spec_baselines(group: TargetGroup) -> None:
    """mlx-lm's speculative decoding beside each draft-model recipe (after warm-up: the drafter
    has loaded its model by then)."""
    taken = {m.name for m in group.modes}
    for mode in list(group.modes):
        pipe = mode.pipeline
        if mode.kind != "ours" or mode.baseline or pipe is None:
            continue
        if pipe.recipe.drafter.kind != "draft_model":
            continue
        draft = getattr(pipe.drafter, "model", None)
        if draft is None:
            continue
        group.modes.append(
            Mode(
                _unique(f"{MLX_LM}-spec[{mode.name}]", taken),
                "mlx_lm_spec",
                draft_model=draft,
                num_draft_tokens=_draft_length(pipe.recipe),
                baseline=True,
                pair=mode.name,
            )
        )


def plan_recipes(
    recipes: Sequence[str | Path | Pipeline],
    overrides: Sequence[str] = (),
    mlx_lm: bool = True,
) -> list[TargetGroup]:
    """Group recipes by target (loading each distinct target once) and add the baselines.

    Items may be recipe files or ready `Pipeline`s (e.g. with custom strategy objects); a ready
    pipeline's target is taken from it, grouped by identity.
    """
    from dspark_flow.models.backend import choose_weight_format
    from dspark_flow.models.loading import load
    from dspark_flow.recipe.load import load_recipe

    groups: dict[Any, TargetGroup] = {}
    names: dict[Any, set[str]] = {}
    for item in recipes:
        if isinstance(item, Pipeline):
            pipe, source = item.warm_up(), None
            comps = pipe.components
            assert comps is not None
            key: Any = id(comps.model)
            fmt: str = pipe.recipe.target.weights
            label = f"{pipe.recipe.target.model} (in memory)"
            model, tok = comps.model, comps.tokenizer
        else:
            source = str(item)
            recipe = load_recipe(item, list(overrides), TOOL_DEFAULTS)  # as `run` builds it
            spec = recipe.target
            fmt = choose_weight_format(spec.weights)
            key = (spec.model, spec.revision, fmt)
            label = f"{spec.model} ({fmt})"
            if key in groups:
                model, tok = groups[key].model, groups[key].tokenizer
            else:
                model, tok = load(spec.model, fmt, spec.revision)
            pipe = Pipeline(recipe, target=(model, tok))
        if key not in groups:
            encoder = greedy_pipeline(pipe.recipe, (model, tok))
            groups[key] = TargetGroup(label, model, tok, fmt, encoder)
            names[key] = {GREEDY, MLX_LM}
        stem = Path(source).stem if source else "custom"
        name = _unique(pipe.recipe.name or stem, names[key])
        groups[key].modes.append(recipe_mode(pipe, name, source))
    for group in groups.values():
        add_baselines(group, mlx_lm)
        _warn_mixed_drafter_kinds(group)
    return list(groups.values())


TRAINED_DRAFTERS = ("dspark", "dflash")


def _warn_mixed_drafter_kinds(group: TargetGroup) -> None:
    """On the H200 (2026-12-01, docs/benchmarks.md §6), a DSpark and a DFlash recipe in one bench
    of one target measured some runs 3-5x slower than the same recipes in benches of one kind
    (not on the CPU; cause not found): on a GPU, say so and suggest one kind per bench."""
    from dspark_flow.models.backend import backend_name

    kinds = {
        m.pipeline.recipe.drafter.kind
        for m in group.modes
        if m.pipeline is not None and m.pipeline.recipe.drafter.kind in TRAINED_DRAFTERS
    }
    if len(kinds) > 1 and backend_name() != "cpu":
        log.warning(
            "DSpark and DFlash recipes in one bench on a GPU: on an H200 some runs measured "
            "3-5x slower than in benches of one kind; bench one kind at a time",
            target=group.label,
        )
