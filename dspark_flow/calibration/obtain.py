"""Cached curves for a (target, drafter) pair on this machine, measuring them when needed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark_flow.calibration import curves as curves_mod
from dspark_flow.calibration.curves import DEFAULT_DEPTHS, Curves, Forward
from dspark_flow.calibration.store import CurveStore, make_key
from dspark_flow.log import get_logger

log = get_logger()
UNBOUNDED_BLOCK = 16  # k range measured for drafters without a block size (a draft model)


def drafter_block(drafter: Any, max_k: int | None = None) -> int:
    """How many k values to measure: the drafter's block, capped by `max_k`."""
    block = getattr(drafter, "max_draft", None)
    block = UNBOUNDED_BLOCK if block is None else int(block)
    return max(1, min(block, max_k) if max_k else block)


def obtain_curves(
    model: Any,
    drafter: Any,
    *,
    sampler: Any = None,
    tokenizer: Any = None,
    target_ref: str | None = None,
    target_revision: str | None = None,
    block: int | None = None,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    repeats: int = 5,
    warmup: int = 2,
    force: bool = False,
    store: CurveStore | None = None,
    forward: Forward | None = None,
    verifier_kind: str = "reference",  # `controller.verifier_identity`: kind and settings
) -> tuple[Curves, Path | None, bool]:
    """(curves, cache file or None where it could not be written, whether they were measured
    now)."""
    store = store or CurveStore()
    block = block or drafter_block(drafter)
    if sampler is None:  # drafters ask it whether to draw or take the argmax: greedy is cheapest
        from dspark_flow.strategies.samplers.greedy import GreedySampler

        sampler = GreedySampler()
    settings = {
        "block": block,
        "depths": sorted({int(d) for d in depths}),
        "repeats": repeats,
        "warmup": warmup,
        "verifier": verifier_kind,
        "verify_lengths": "fresh-centred" if curves_mod.verify_at_fresh_lengths() else "repeated",
        "sampler": sampler_identity(sampler),
    }
    key = make_key(
        model, drafter, target_ref=target_ref, target_revision=target_revision, settings=settings
    )

    def run() -> Curves:
        log.info("calibrating draft costs", block=block, depths=settings["depths"])
        return curves_mod.measure(
            model,
            drafter,
            sampler,
            block=block,
            depths=depths,
            repeats=repeats,
            warmup=warmup,
            history=curves_mod.sample_history(tokenizer),
            forward=forward,
        )

    found, measured, path = store.get(key, run, force=force)
    return found, path, measured


def sampler_identity(sampler: Any) -> Any:
    """What of the sampler changes a drafter's cost: drawing (and truncating: top-p sorts the
    vocabulary) against taking the argmax. The seed changes no cost."""
    if sampler.greedy:
        return "greedy"
    config = getattr(sampler, "config", None)
    if config is None:
        return type(sampler).__name__
    return config.model_dump(mode="json", exclude={"seed", "temperature"})
