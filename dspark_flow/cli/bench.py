"""`dspark-flow bench`: recipes against greedy and mlx-lm baselines on the same prompts.

Exit codes: 0 fine, 2 a user error (bad recipe or prompts file, one line on stderr), 3 some
mode's output differed from greedy decoding at T=0 (a losslessness failure, reported loudly).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from dspark_flow.cli.args import add_overrides
from dspark_flow.env import env_flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipes", nargs="*", metavar="RECIPE", help="recipe YAML files to compare")
    p.add_argument(
        "--prompts",
        action="append",
        default=[],
        metavar="FILE",
        help="JSONL ({'turns': [...], 'category': ...}) or text, one prompt a line "
        "(repeatable; default: the 24 shipped prompts)",
    )
    p.add_argument("--trials", type=int, default=3, help="runs per prompt and mode (default 3)")
    p.add_argument(
        "--warmup-trials",
        type=int,
        default=0,
        metavar="N",
        help="whole passes over the prompts and modes before the trials, not recorded (GPUs "
        "compile kernels per new shape on first use; default 0)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=128, help="tokens per generation (default 128)"
    )
    p.add_argument(
        "--limit", type=int, default=None, metavar="N", help="at most N prompts per category"
    )
    p.add_argument(
        "--category",
        dest="categories",
        action="append",
        default=[],
        metavar="NAME",
        help="only prompts of this category (repeatable)",
    )
    p.add_argument(
        "--out", default="out/bench", metavar="DIR", help="output folder (default out/bench)"
    )
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm baselines")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    p.add_argument("--no-verify-cost", action="store_true", help="skip the verify cost curve")
    p.add_argument(
        "--verify-repeats",
        type=int,
        default=5,
        metavar="N",
        help="timed forwards per K (default 5)",
    )
    add_overrides(p, example="target.weights=native", note="; applies to every recipe")
    p.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="measure nothing: re-render bench.md and the figures from a bench.json",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _command(args: argparse.Namespace) -> str:
    """The command line, rebuilt from the parsed arguments (sys.argv is pytest's under tests)."""
    parts = ["dspark-flow", "bench", *args.recipes]
    for f in args.prompts:
        parts += ["--prompts", f]
    for c in args.categories:
        parts += ["--category", c]
    for o in args.overrides:
        parts += ["--set", o]
    parts += ["--trials", str(args.trials), "--max-tokens", str(args.max_tokens)]
    if args.warmup_trials:
        parts += ["--warmup-trials", str(args.warmup_trials)]
    if args.limit is not None:
        parts += ["--limit", str(args.limit)]
    if args.verify_repeats != 5:
        parts += ["--verify-repeats", str(args.verify_repeats)]
    flags = ("no_mlx_lm", "no_plots", "no_verify_cost")
    parts += [f"--{f.replace('_', '-')}" for f in flags if getattr(args, f)]
    return shlex.join([*parts, "--out", args.out])


def _warn_mismatches(mismatches: list[dict]) -> None:
    for m in mismatches:
        print(
            f"warning: OUTPUT MISMATCH: {m['mode']} on {m['prompt_id']} (trial {m['trial'] + 1}) "
            f"differs from greedy at token {m['first_difference']}",
            file=sys.stderr,
        )


def _check_writable(out: Path) -> None:
    """Make the report folder and write a file in it, or say in one line why that fails."""
    import tempfile

    from dspark_flow.errors import DsparkFlowError

    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise DsparkFlowError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None


def run(args: argparse.Namespace) -> int:
    from dspark_flow.errors import DsparkFlowError

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DsparkFlowError(f"--out {out} is a file; name a folder for the report")
    made = not out.exists()
    _check_writable(out)  # before the run: a bench is too long to lose at the last step
    try:
        return _run(args, out)
    except BaseException:
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a bench that failed leaves no empty report folder behind
        raise


def _run(args: argparse.Namespace, out: Path) -> int:
    from dspark_flow.bench.api import MISMATCH_EXIT, BenchInterrupted, bench, write_outputs
    from dspark_flow.bench.runner import BenchConfig
    from dspark_flow.errors import DsparkFlowError

    interrupted = False
    if args.from_json:
        from dspark_flow.bench.report import load_json

        if args.recipes:
            raise DsparkFlowError(
                "--from-json renders a saved run; leave out the recipes (or drop --from-json)"
            )

        data = load_json(args.from_json)
        try:
            outcome = write_outputs(data, out, plots=not args.no_plots, whole_or_nothing=True)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
            # A hand-edited or truncated file: its fields are not what a bench run writes (or a
            # rendering bug: DSPARK_FLOW_DEBUG=1 shows the traceback).
            if env_flag("DSPARK_FLOW_DEBUG"):
                raise
            raise DsparkFlowError(
                f"{args.from_json} is not a bench.json this version can render "
                f"({type(e).__name__}: {e})"
            ) from e
    else:
        if not args.recipes:
            raise DsparkFlowError("name at least one recipe (or --from-json FILE)")
        if args.verify_repeats < 1:
            raise DsparkFlowError("--verify-repeats must be at least 1")
        cfg = BenchConfig(
            trials=args.trials,
            warmup_trials=args.warmup_trials,
            max_tokens=args.max_tokens,
            verify_cost=not args.no_verify_cost,
            verify_repeats=args.verify_repeats,
        )

        def progress(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        try:
            outcome = bench(
                args.recipes,
                args.prompts,
                config=cfg,
                limit=args.limit,
                categories=args.categories,
                overrides=args.overrides,
                mlx_lm=not args.no_mlx_lm,
                out_dir=out,
                plots=not args.no_plots,
                command=_command(args),
                progress=None if args.quiet else progress,
            )
        except BenchInterrupted as stop:  # Ctrl-C: show and keep what was measured
            outcome, interrupted = stop.outcome, True
    from dspark_flow.bench.report import summary_table

    print("\n".join(summary_table(outcome.data["summary"])))
    for note in outcome.notes:
        print(f"note: {note}", file=sys.stderr)
    for path in outcome.files:
        print(f"wrote {path}", file=sys.stderr)
    if outcome.mismatches:
        _warn_mismatches(outcome.mismatches)
        print(
            f"warning: {len(outcome.mismatches)} run(s) did not reproduce greedy output at T=0 "
            "(see the mismatches in bench.json / bench.md)",
            file=sys.stderr,
        )
    if interrupted:
        return 130  # as any Ctrl-C (the report above is partial, and says so)
    return MISMATCH_EXIT if outcome.mismatches else 0
