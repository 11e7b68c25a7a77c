"""`dspark-flow calibrate RECIPE`: measure (or show cached) draft cost curves for a recipe's
target and drafter on this machine, print them, and cache them for `calibrated`/`auto`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dspark_flow.cli.args import add_recipe
from dspark_flow.errors import DsparkFlowError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe(p, example="drafter.max_draft=8")
    p.add_argument("--force", action="store_true", help="measure again even if cached")
    p.add_argument(
        "--depths",
        default=None,
        help="comma-separated context depths (default: the draft_cap's, else 64,512,2048)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repeats per point (default: the recipe's draft cap's, else 5)",
    )
    p.add_argument("--json", action="store_true", help="print the curves as JSON")


def _cap_settings(recipe: Any) -> dict[str, Any]:
    """Calibration settings of the recipe's draft cap when it is a calibrating one."""
    from dspark_flow.calibration.controller import CurveCapConfig

    cfg = recipe.draft_cap
    if isinstance(cfg, CurveCapConfig):
        return {
            "depths": cfg.depths,
            "repeats": cfg.repeats,
            "warmup": cfg.warmup,
            "max_k": cfg.max_k,
            "cache_dir": cfg.cache_dir,
            "acceptance": cfg.acceptance,
        }
    return {}


def format_curves(curves: Any, acceptance: float = 0.6) -> str:
    """A table: per k, verify ms at each depth (and its ratio to one token), drafter ms, and the
    expected gain over plain decoding at `acceptance` for the shallowest depth."""
    from dspark_flow.calibration.controller import plan_table

    depths = curves.depths
    head = (
        ["k", "K"]
        + [f"verify@{d} ms (x1)" for d in depths]
        + ["draft ms", f"gain p={acceptance:g} (fit)"]
    )
    table = plan_table(curves, acceptance, depths[0], curves.block)
    rows = []
    for plan in table:
        k = plan.k
        cells = [str(k), str(k + 1)]
        for i in range(len(depths)):
            ms = curves.verify[i][k] * 1e3
            cells.append(f"{ms:8.2f} ({curves.verify[i][k] / curves.verify[i][0]:.2f})")
        cells.append(f"{curves.drafter_cost(k) * 1e3:.3f}")
        cells.append(f"{plan.gain:.2f}")
        rows.append(cells)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from dspark_flow.calibration.controller import verifier_identity
    from dspark_flow.calibration.obtain import drafter_block, obtain_curves
    from dspark_flow.calibration.store import CurveStore
    from dspark_flow.models.context import context_limit
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.recipe.load import load_recipe
    from dspark_flow.recipe.schema import TOOL_DEFAULTS
    from dspark_flow.strategies.draft_caps.fixed import FixedCap

    recipe = load_recipe(args.recipe, args.overrides, TOOL_DEFAULTS)  # what `run` would build
    settings = _cap_settings(recipe)
    depths = settings.get("depths") or [64, 512, 2048]
    if args.depths is not None:  # an empty --depths "" is a slip, not the defaults
        try:
            depths = [int(d) for d in args.depths.split(",") if d.strip()]
            if not depths:
                raise ValueError
        except ValueError:
            raise DsparkFlowError(
                f"--depths {args.depths!r}: expected integers like 64,512"
            ) from None
    repeats = args.repeats if args.repeats is not None else settings.get("repeats") or 5
    if repeats < 1 or not depths or min(depths) < 1:
        raise DsparkFlowError("--repeats and every depth must be at least 1")
    # A plain cap for the warm-up, so a calibrating draft_cap in the recipe does not measure twice.
    pipeline = Pipeline(recipe, draft_cap=FixedCap()).warm_up()
    c = pipeline.components
    assert c is not None
    if c.drafter.max_draft == 0:
        raise DsparkFlowError(
            "the recipe's drafter proposes nothing (kind none): nothing to calibrate"
        )
    curves, path, measured = obtain_curves(
        c.model,
        c.drafter,
        sampler=c.sampler,
        tokenizer=c.tokenizer,
        target_ref=recipe.target.model,
        target_revision=recipe.target.revision,
        block=drafter_block(c.drafter, settings.get("max_k")),
        depths=depths,
        repeats=repeats,
        warmup=settings.get("warmup", 2),
        force=args.force,
        store=CurveStore(settings["cache_dir"]) if settings.get("cache_dir") else None,
        forward=c.verifier.forward,  # the verifier `run` uses, so its curves serve `run`
        verifier_kind=verifier_identity(c.verifier),
    )
    if args.json:
        from dspark_flow.cli.main import print_json

        print_json({"path": str(path) if path else None, "measured": measured, **curves.to_dict()})
        return 0
    if dropped := sorted(set(depths) - set(curves.depths)):
        limit = context_limit(c.model)
        print(
            f"note: depths {', '.join(map(str, dropped))} leave no room for a verify in this "
            f"model's context ({limit} tokens): measured at {', '.join(map(str, curves.depths))}",
            file=sys.stderr,
        )
    print(format_curves(curves, settings.get("acceptance", 0.6)))
    if path is None:  # the store logged why
        print("[measured; not cached: the calibration cache could not be written]")
    else:
        print(f"[{'measured' if measured else 'cached'}: {path}]")
    return 0
