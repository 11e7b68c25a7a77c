"""The subcommands: each a small object with a name, its arguments and a run function."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dspark_flow.cli.args import add_overrides, add_recipe
from dspark_flow.errors import DsparkFlowError, RecipeError


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _recipe_args(p: argparse.ArgumentParser) -> None:
    add_recipe(p)


# -- run ---------------------------------------------------------------------------------------


def _run_args(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)
    p.add_argument("--prompt", required=True, help="the prompt (use - to read stdin)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="override the token budget (default: the recipe's max_tokens rule)",
    )
    p.add_argument("--no-chat", action="store_true", help="send the prompt without chat template")
    p.add_argument("--json", action="store_true", help="print the GenResult as JSON")
    p.add_argument(
        "--max-draft",
        default=None,
        metavar="auto|N",
        help="draft cap shortcut: auto (learnt per round) or a fixed k (a --set draft_cap.X "
        "adds to it)",
    )


CAP_KIND_SETS = ("draft_cap=", "draft_cap.kind=")


def _run(args: argparse.Namespace) -> int:
    from dspark_flow.pipeline import Pipeline

    if args.max_tokens is not None and args.max_tokens < 1:
        raise DsparkFlowError("--max-tokens must be at least 1")
    if args.max_draft is not None:  # a --set of the whole draft_cap section; later --set refine it
        from dspark_flow.strategies.draft_caps.fixed import MAX_K as MAX_DRAFT

        cap = args.max_draft.strip().lower()
        if cap != "auto" and not (cap.isdigit() and 1 <= int(cap) <= MAX_DRAFT):
            raise DsparkFlowError(
                f"--max-draft {args.max_draft}: expected auto or a count from 1 to {MAX_DRAFT}"
            )
        clash = [o for o in args.overrides if o.replace(" ", "").startswith(CAP_KIND_SETS)]
        if clash:  # its section would be validated as one the user never typed
            raise DsparkFlowError(
                f"--max-draft {args.max_draft} and --set {clash[0]} both choose the draft cap; "
                "keep one"
            )
        section = "{kind: auto}" if cap == "auto" else f"{{kind: fixed, k: {int(cap)}}}"
        args.overrides = [f"draft_cap={section}", *args.overrides]
    # From stdin, less the newline that ends `echo`'s and most files' last line: `echo X |`
    # then asks what `--prompt X` asks.
    prompt = sys.stdin.read().removesuffix("\n") if args.prompt == "-" else args.prompt
    if not prompt.strip():  # before the model loads: generating from nothing is a slip
        where = "stdin" if args.prompt == "-" else "--prompt"
        raise DsparkFlowError(f"the prompt is empty ({where} gave no text)")
    from dspark_flow.recipe.schema import TOOL_DEFAULTS

    pipeline = Pipeline.from_yaml(args.recipe, args.overrides, defaults=TOOL_DEFAULTS)
    if args.max_draft is not None and pipeline.recipe.drafter.kind == "none":
        print("note: --max-draft does nothing with drafter none (plain decoding)", file=sys.stderr)
    if args.max_tokens is None and all(rule.token_budget is None for rule in pipeline.stops):
        # `stop: []` or end rules only: valid, but a run that looks hung without a word
        print(
            "note: no stop rule sets a token budget: the output runs until an end rule fires "
            "or the context is full (--max-tokens N caps it)",
            file=sys.stderr,
        )
    pipeline.warm_up()
    shown = False

    def show(piece: str) -> None:
        nonlocal shown
        shown = True
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        result = pipeline.generate(
            prompt,
            max_new_tokens=args.max_tokens,
            chat=False if args.no_chat else None,
            on_text=None if args.json else show,
        )
    except KeyboardInterrupt:
        if shown:  # end the streamed line: "interrupted" would stick to the text on a terminal
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    if args.json:
        from dspark_flow.cli.main import print_json

        print_json(result.to_dict())
    else:
        sys.stdout.write("\n")
        print(f"[{result.summary()}]", file=sys.stderr)
    return 0


# -- validate / schema / list ------------------------------------------------------------------


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipes", nargs="+", help="recipe YAML files")
    add_overrides(p)


def _validate(args: argparse.Namespace) -> int:
    from dspark_flow.recipe.load import load_recipe
    from dspark_flow.recipe.schema import TOOL_DEFAULTS

    problems: list[str] = []
    for path in args.recipes:
        try:
            load_recipe(path, args.overrides, TOOL_DEFAULTS)  # what `run` and `serve` build
            print(f"ok {path}")
        except RecipeError as exc:
            problems.extend(exc.problems)
    if problems:
        raise RecipeError(problems)
    return 0


def _schema_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", "-o", default=None, help="write to this file instead of stdout")
    p.add_argument(
        "--markdown",
        action="store_true",
        help="a readable page of every recipe field, training recipe field and command-line "
        "flag instead (docs/reference.md, with installed plugin kinds)",
    )


def _schema(args: argparse.Namespace) -> int:
    if args.markdown:
        from dspark_flow.recipe.reference import reference_markdown

        text = reference_markdown(builtin_only=False).rstrip("\n")
    else:
        from dspark_flow.recipe.jsonschema import recipe_json_schema

        text = json.dumps(recipe_json_schema(), indent=2)
    if args.output:
        try:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            raise DsparkFlowError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    else:
        print(text)
    return 0


def _list_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("slot", nargs="?", default=None, help="only this slot")


def _list(args: argparse.Namespace) -> int:
    from dspark_flow import registry
    from dspark_flow.strategy import SLOTS

    slots = [args.slot] if args.slot else list(SLOTS)
    infos = [i for s in slots for i in registry.installed(s)]
    # A kind claimed twice is unusable until one claim goes: listing the first claim alone
    # would show a plugin in a built-in's place.
    claimed_by = {
        (slot, kind): " and ".join(c.source for c in claims)
        for slot, kind, claims in registry.conflicts()
    }
    width = max((len(f"{i.slot}.{i.kind}") for i in infos), default=10)
    for info in infos:
        who = claimed_by.get((info.slot, info.kind))
        source = f"CONFLICT: claimed by {who}" if who else info.source
        print(f"{info.slot + '.' + info.kind:<{width}}  {source}")
    for (slot, kind), who in claimed_by.items():
        print(f"warning: {slot}.{kind} is claimed by {who}; uninstall one", file=sys.stderr)
    for name in registry.malformed():
        print(
            f"warning: entry point {name} in {registry.GROUP} is not named <slot>.<kind> "
            f"(slots: {', '.join(SLOTS)}); ignored",
            file=sys.stderr,
        )
    return 0


# -- models ------------------------------------------------------------------------------------


def _models_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["pull", "path"],
        help="pull: fetch and convert; path: print its folder (fetched and converted first, "
        "with progress on stderr, when absent)",
    )
    p.add_argument("name", nargs="?", default="smollm2-135m", help="built-in model name")


def _models(args: argparse.Namespace) -> int:
    from dspark_flow.models.embedded import BUILTIN_MODELS, built_dir, ensure_builtin

    name = args.name.removeprefix("builtin:")
    # `path` of a model not built yet builds it (minutes): said on stderr, stdout stays the path
    absent = name in BUILTIN_MODELS and built_dir(name) is None
    if args.action == "path" and absent:
        print(
            f"builtin:{name} is not converted here yet: fetching and converting it", file=sys.stderr
        )
    path = ensure_builtin(name, progress=args.action == "pull" or absent)
    print(path)
    return 0


# -- bench -------------------------------------------------------------------------------------


def _bench_args(p: argparse.ArgumentParser) -> None:
    from dspark_flow.cli.bench import add_arguments

    add_arguments(p)


def _bench(args: argparse.Namespace) -> int:
    from dspark_flow.cli.bench import run

    return run(args)


# -- serve -------------------------------------------------------------------------------------


def _serve_args(p: argparse.ArgumentParser) -> None:
    from dspark_flow.cli.serve import add_arguments

    add_arguments(p)


def _serve(args: argparse.Namespace) -> int:
    from dspark_flow.cli.serve import run

    return run(args)


# -- train -------------------------------------------------------------------------------------


def _train_args(p: argparse.ArgumentParser) -> None:
    from dspark_flow.cli.train import add_arguments

    add_arguments(p)


def _train(args: argparse.Namespace) -> int:
    from dspark_flow.cli.train import run

    return run(args)


# -- calibrate ---------------------------------------------------------------------------------


def _calibrate_args(p: argparse.ArgumentParser) -> None:
    from dspark_flow.cli.calibrate import add_arguments

    add_arguments(p)


def _calibrate(args: argparse.Namespace) -> int:
    from dspark_flow.cli.calibrate import run

    return run(args)


COMMANDS: list[Command] = [
    Command("run", "generate from a prompt with a recipe", _run_args, _run),
    Command("validate", "check recipes without loading models", _validate_args, _validate),
    Command(
        "schema",
        "print the JSON Schema of recipes, or with --markdown a readable reference (all "
        "installed kinds)",
        _schema_args,
        _schema,
    ),
    Command("list", "list installed strategies per slot", _list_args, _list),
    Command("models", "fetch and convert built-in models", _models_args, _models),
    Command("bench", "compare recipes with greedy and mlx-lm baselines", _bench_args, _bench),
    Command("serve", "serve a recipe over OpenAI/Anthropic-compatible HTTP", _serve_args, _serve),
    Command("calibrate", "measure and cache draft cost curves", _calibrate_args, _calibrate),
    Command("train", "train a DSpark/DFlash drafter for a target", _train_args, _train),
]
