"""Arguments several subcommands share, defined once so they read the same everywhere."""

from __future__ import annotations

import argparse


def add_overrides(
    p: argparse.ArgumentParser, example: str = "draft_cap.k=4", note: str = ""
) -> None:
    """`--set KEY.PATH=VALUE` (repeatable), collected into `args.overrides`."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help=f"override a recipe field, e.g. --set {example} (repeatable){note}",
    )


def add_recipe(p: argparse.ArgumentParser, example: str = "draft_cap.k=4", note: str = "") -> None:
    """A positional recipe file plus its `--set` overrides."""
    p.add_argument("recipe", help="recipe YAML file")
    add_overrides(p, example, note)
