"""`dspark-flow train RECIPE`: self-distil data, train a DSpark/DFlash drafter, export it in
the published layout and measure its τ per category (see dspark_flow/training)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from dspark_flow.cli.args import add_recipe
from dspark_flow.errors import DsparkFlowError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe(p, example="train.steps=2000")
    p.add_argument(
        "--stage",
        action="append",
        choices=["data", "train", "export", "vocab", "eval"],
        help="run only these stages (repeatable; default: data, train, export, eval; export "
        "writes the newest checkpoint and the draft vocabulary, vocab only the latter)",
    )
    p.add_argument("--fresh", action="store_true", help="discard checkpoints and start at step 0")
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="SECONDS",
        help="pause training at a checkpoint once this long has passed (a rerun resumes; "
        "export and eval wait for the run that finishes)",
    )
    p.add_argument(
        "--data-worker",
        metavar="I/N",
        help="with --stage data: make only share I of N of the answers (one process per GPU; "
        "worker 0 writes the self prompts, the others wait for them)",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="let export replace a drafter another training recipe exported in `output` "
        "(never other files)",
    )
    p.add_argument("--check", action="store_true", help="validate the recipe and stop")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from dspark_flow.training.recipe import check_output, load_train_recipe
    from dspark_flow.training.run import STAGES, check_call, run_training

    recipe = load_train_recipe(args.recipe, args.overrides)
    if args.time_limit is not None and not args.time_limit > 0:
        raise DsparkFlowError(
            f"--time-limit {args.time_limit}: must be a positive number of seconds"
        )
    stages = tuple(args.stage) if args.stage else STAGES
    # A malformed I/N ("" too: an empty share is a slip, not "all of it"), a worker outside
    # the data stage, an eval with no prompts: refused here, --check or not.
    check_call(recipe, stages, args.data_worker)
    if args.check:  # (a run checks the output itself, in run_training, before any work)
        check_output(recipe, args.recipe, args.replace)
        start = recipe.train.init_from
        if start and not Path(start).exists():  # a later stage may check before an earlier runs
            print(
                f"note: train.init_from {start} does not exist yet: train it first (a fresh "
                "run stops there, before making the data)",
                file=sys.stderr,
            )
        elif start and "train" in stages:  # (only training reads it)
            from dspark_flow.training.warm_start import check_init_from

            check_init_from(recipe)
        _check_against_target_on_disk(recipe)
        print(f"{args.recipe}: ok ({recipe.drafter.kind}, block {recipe.drafter.block_size})")
        return 0
    command = "dspark-flow train " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    summary = run_training(
        recipe,
        stages=stages,
        fresh=args.fresh,
        progress=not args.quiet,
        command=command,
        time_limit=args.time_limit,
        data_worker=args.data_worker,
        replace=args.replace,
    )
    train = summary.get("train", {})
    if train.get("paused") and not args.quiet:  # exit 0 with no word read as "trained"
        print(
            f"paused at step {train.get('steps')} of {recipe.train.steps} (--time-limit); run "
            "the same command again to continue (export and eval wait until then)",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(summary, indent=2))
    elif not {"eval", "train", "data", "vocab", "exported_step"} & summary.keys():
        raise DsparkFlowError("nothing was run")
    return 0


def _check_against_target_on_disk(recipe: Any) -> None:
    """The drafter against its target (width, tap layers, heads, mask id), as a run checks it
    before any work, when the target needs no download: the built-in model once converted, or
    a local directory. Built lazily: no weight is read. A hub id is checked when the run loads
    it (said on stderr)."""
    from mlx_lm.utils import load_model

    from dspark_flow.errors import ModelError
    from dspark_flow.models import embedded
    from dspark_flow.models.loading import BUILTIN_PREFIX, _brief
    from dspark_flow.training.recipe import check_against_target

    ref = recipe.target.model
    path: Path | None = None
    if ref.startswith(BUILTIN_PREFIX):
        name = ref[len(BUILTIN_PREFIX) :]
        path = embedded.built_dir(name) if name in embedded.BUILTIN_MODELS else None
    else:
        try:
            local = embedded.expanded_path(ref, "target.model")
        except ModelError:  # ~someone unknown here: the run names it
            local = None
        path = local if local is not None and local.is_dir() else None
    if path is None:
        print(
            f"note: {ref} is not on disk: the drafter is checked against it when a run loads it",
            file=sys.stderr,
        )
        return
    try:
        model, _ = load_model(path, lazy=True)
    except Exception as e:  # the run's loader words each case; here one line is enough
        raise ModelError(f"target {ref}: could not read it ({_brief(e)})") from e
    check_against_target(recipe, model)
