"""Draft caps that fit the machine: measure what speculation costs here, once, and pick k from it.

* `curves`: measuring the target's verify cost per draft length and the drafter's cost;
* `store`: the on-disk JSON cache under `cache_root()/calibration/` (or
  $DSPARK_FLOW_CALIBRATION_DIR), keyed by model, weight format, drafter, MLX, backend, device;
* `controller`: the expected-tokens-per-second choice and the acceptance estimator;
* `in_loop`: the decode loop's own round times against the curves (benchmarks' check);
* `calibrate()`: the Python entry point, returning an `auto` draft cap ready to use.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

from dspark_flow.calibration.controller import Plan, best_plan, expected_tokens, plan_table
from dspark_flow.calibration.curves import DEFAULT_DEPTHS, Curves
from dspark_flow.calibration.estimators import AcceptanceEstimator, LengthEstimator
from dspark_flow.calibration.obtain import drafter_block, obtain_curves
from dspark_flow.calibration.store import ENV_DIR, CurveStore, calibration_dir, drafter_identity
from dspark_flow.errors import ConfigError

if TYPE_CHECKING:
    from dspark_flow.strategies.draft_caps.auto import AutoCap

Mode = Literal["lookup", "dspark", "dflash", "draft_model"]

__all__ = [
    "ENV_DIR",
    "AcceptanceEstimator",
    "CurveStore",
    "Curves",
    "LengthEstimator",
    "Plan",
    "best_plan",
    "calibrate",
    "calibration_dir",
    "expected_tokens",
    "obtain_curves",
    "plan_table",
]


def _drafter_for(
    mode: str,
    drafter: Any,
    drafter_repo: str | None,
    drafter_revision: str | None,
    target_repo: str | None,
    target_revision: str | None,
    model: Any,
    tokenizer: Any,
    sampler: Any,
) -> Any:
    """A ready drafter from what calibrate() was given."""
    import mlx.nn as nn

    from dspark_flow.strategy import BuildContext, Drafter, construct, warm

    # A block drafter's checkpoint 'auto' is looked up by the target's name.
    recipe = SimpleNamespace(target=SimpleNamespace(model=target_repo, revision=target_revision))
    ctx = BuildContext(model=model, tokenizer=tokenizer, recipe=recipe, sampler=sampler)
    if isinstance(drafter, Drafter):
        # Warmed against this target, as a Pipeline does: one loaded with another instance of
        # it (load_pair's own) would still read features from that one.
        return warm(drafter, ctx)
    if isinstance(drafter, nn.Module):  # an already loaded draft model
        from dspark_flow.strategies.drafters.draft_model import DraftModelConfig, DraftModelDrafter

        return DraftModelDrafter(DraftModelConfig(model="<in memory>"), model=drafter)
    if drafter is not None:
        raise ConfigError(
            f"calibrate(): drafter must be a Drafter or an mlx model, not {type(drafter).__name__}"
        )
    from dspark_flow import registry

    cls = registry.load_kind("drafter", mode)
    section: dict[str, Any] = {"kind": mode}
    field = "checkpoint" if "checkpoint" in cls.Config.model_fields else "model"
    if drafter_repo:
        section[field] = drafter_repo
        if drafter_revision:
            section["revision"] = drafter_revision
    elif field == "model" and mode != "lookup":
        raise ConfigError(f"calibrate(mode={mode!r}) needs drafter= or drafter_repo=")
    built = construct(cls, cls.Config.model_validate(section))
    return warm(built, ctx)


def calibrate(
    target: Any,
    drafter: Any = None,
    mode: Mode = "lookup",
    target_repo: str | None = None,
    drafter_repo: str | None = None,
    force: bool = False,
    *,
    tokenizer: Any = None,
    target_revision: str | None = None,
    drafter_revision: str | None = None,
    acceptance: float = 0.6,
    max_k: int | None = None,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    repeats: int = 5,
    warmup: int = 2,
    cache_dir: str | None = None,
) -> AutoCap:
    """Measure (or load from the cache) the draft cost curves and return an `auto` draft cap.

    `target` is a loaded model or a (model, tokenizer) pair; `drafter` a ready Drafter, a loaded
    draft model, or None to build the `mode` drafter (`drafter_repo` names its checkpoint).
    `target_repo`/`drafter_repo` also key the cache (with a hash of config.json and weight file
    sizes). The result is a DraftCap: pass it as `Pipeline(..., draft_cap=cap)`.
    """
    import mlx.nn as nn
    from pydantic import ValidationError

    from dspark_flow.errors import ConfigError, validation_message
    from dspark_flow.strategies.draft_caps.auto import AutoCap, AutoCapConfig
    from dspark_flow.strategies.samplers.greedy import GreedySampler

    try:  # every setting checked before anything is loaded or measured
        config = AutoCapConfig(
            acceptance=acceptance,
            max_k=max_k,
            depths=depths,
            repeats=repeats,
            warmup=warmup,
            cache_dir=cache_dir,
        )
    except ValidationError as e:
        raise ConfigError(validation_message(e, "calibrate")) from None
    if not isinstance(mode, str):
        raise ConfigError(f"calibrate: mode is a drafter kind's name, got {mode!r}")
    if isinstance(target, tuple | list) and len(target) == 2:
        model, tokenizer = target[0], tokenizer if tokenizer is not None else target[1]
    else:
        model = target
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "calibrate: target is a loaded model or a (model, tokenizer) pair (load_target), "
            f"got {type(model).__name__}"
        )
    sampler = GreedySampler()
    # A ready drafter bound to another instance of the target (load_pair's own) is warmed
    # against this one here, and goes back afterwards, or a Pipeline holding it would read this
    # one's features.
    bound_before = getattr(drafter, "bound_to", None)
    ready = _drafter_for(
        mode,
        drafter,
        drafter_repo,
        drafter_revision,
        target_repo,
        target_revision,
        model,
        tokenizer,
        sampler,
    )
    try:
        curves, path, _ = obtain_curves(
            model,
            ready,
            sampler=sampler,
            tokenizer=tokenizer,
            target_ref=target_repo,
            target_revision=target_revision,
            block=drafter_block(ready, config.max_k),
            depths=config.depths,
            repeats=config.repeats,
            warmup=config.warmup,
            force=force,
            store=CurveStore(cache_dir) if cache_dir else None,
        )
    finally:
        if bound_before is not None and bound_before is not model:
            from dspark_flow.strategy import BuildContext, warm

            back = BuildContext(
                model=bound_before, tokenizer=tokenizer, recipe=None, sampler=sampler
            )
            warm(ready, back)
    cap = AutoCap(config, curves=curves)
    cap.cache_path = path
    cap.calibrated_for = drafter_identity(ready)
    return cap
