"""Every recipe field and command-line flag as one Markdown page (docs/reference.md), written
from the pydantic sections and the argparse parsers themselves, so the page cannot drift from
the code: a test regenerates it and compares.

`python -m dspark_flow.recipe.reference > docs/reference.md` writes the built-in kinds only (the
committed page); `dspark-flow schema --markdown` includes every installed plugin kind.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import types
from collections.abc import Iterator
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from dspark_flow import registry
from dspark_flow.log import get_logger
from dspark_flow.recipe.section import Section
from dspark_flow.strategy import SLOTS

_INTRO = """\
# Reference: recipe fields and command-line flags

Generated from the code by `python -m dspark_flow.recipe.reference > docs/reference.md`
(built-in kinds; `dspark-flow schema --markdown` adds installed plugin kinds). Do not edit by
hand: `tests/test_reference.py` fails when this page and the code disagree. How a recipe flows
through the code: docs/architecture.md. Example recipes: `recipes/`.
"""


# -- types, defaults and bounds as a reader writes them in YAML ----------------------------------


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Annotated:  # list[Annotated[int, Gt(0)]]: the bound is the item's, not shown
        return _type_name(get_args(annotation)[0])
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(annotation) if a is not type(None)]
        text = " \\| ".join(_type_name(a) for a in options)
        return f"{text} \\| null" if len(options) < len(get_args(annotation)) else text
    if origin in (list, tuple):
        items = [a for a in get_args(annotation) if a is not Ellipsis]
        inner = _type_name(items[0]) if items else "any"
        return f"list of {inner}"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return "section"
        if issubclass(annotation, enum.Enum):
            return " \\| ".join(json.dumps(m.value) for m in annotation)
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation).replace("typing.", "")


def _bounds(field: FieldInfo) -> str:
    marks = (
        (annotated_types.Ge, "ge", "≥"),
        (annotated_types.Gt, "gt", ">"),
        (annotated_types.Le, "le", "≤"),
        (annotated_types.Lt, "lt", "<"),
    )
    parts = []
    for meta in field.metadata:
        for kind, attr, mark in marks:
            if isinstance(meta, kind):
                parts.append(f"{mark} {getattr(meta, attr)}")
    return ", ".join(parts)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        # (pydantic 2.10 added factories that read the other fields; earlier ones have no flag)
        if getattr(field, "default_factory_takes_validated_data", False):
            return "computed from the other fields"
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section below)"
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{json.dumps(value, default=str)}`"  # (a plugin's default may be a Path or so)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _sections_in(annotation: Any, path: str) -> Iterator[tuple[str, type[Section]]]:
    """(path, section class) for each section a field at `path` can hold, `path[]` inside a
    list (nested tables follow the one they sit in)."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        yield path, annotation
    inner = f"{path}[]" if get_origin(annotation) in (list, tuple) else path
    for arg in get_args(annotation):
        yield from _sections_in(arg, inner)


def _fields_table(model: type[BaseModel], prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    shown = [name for name in model.model_fields if name not in skip]
    if not shown:
        return ["No settings besides `kind`."]
    rows = ["| field | type | default | what it does |", "|---|---|---|---|"]
    nested: list[tuple[str, type[Section]]] = []  # (path, section)
    for name in shown:
        field = model.model_fields[name]
        kind = _type_name(field.annotation)
        bounds = _bounds(field)
        if bounds:
            kind = f"{kind} ({bounds})"
        about = _cell(field.description or "")
        rows.append(f"| `{prefix}{name}` | {kind} | {_default(field)} | {about} |")
        nested.extend(_sections_in(field.annotation, f"{prefix}{name}"))
    lines = rows
    seen: set[type[Section]] = set()
    for path, section in nested:
        if section in seen:
            continue
        seen.add(section)
        lines += ["", f"`{path}` as a section:", ""]
        lines += _fields_table(section, f"{path}.")
    return lines


def _first_paragraph(text: str | None) -> str:
    return " ".join((text or "").strip().split("\n\n")[0].split())


# -- the page -------------------------------------------------------------------------------------


def _flow(section: dict[str, Any]) -> str:
    """A recipe section as YAML's one-line form: `{kind: kernels, invariant: true}`."""

    def value(v: Any) -> str:
        return v if isinstance(v, str) and v.isidentifier() else json.dumps(v)

    return "{" + ", ".join(f"{k}: {value(v)}" for k, v in section.items()) + "}"


def _kind_part(slot: str, info: registry.KindInfo) -> list[str]:
    cls = registry.load_claim(info)
    about = _first_paragraph(cls.__doc__) or _first_paragraph(sys.modules[cls.__module__].__doc__)
    source = "" if registry.is_builtin(info) else f" (from {info.source})"
    lines = [f"#### `{slot}: {{kind: {info.kind}}}`{source}", ""]
    if about:
        lines += [about, ""]
    prefix = f"{slot}[]." if slot == "stop" else f"{slot}."
    return [*lines, *_fields_table(cls.Config, prefix, skip=("kind",)), ""]


def _recipe_part(builtin_only: bool) -> list[str]:
    from dspark_flow.recipe.schema import (
        SLOT_DEFAULTS,
        TOOL_DEFAULTS,
        PromptSpec,
        RecipeShape,
        TargetSpec,
    )

    tool = "; ".join(f"`{slot}: {_flow(section)}`" for slot, section in TOOL_DEFAULTS.items())
    lines = [
        "## Recipes (`dspark-flow run`, `validate`, `bench`, `serve`, `calibrate`)",
        "",
        "A slot left out takes the default kind named under it. The command line (`run`,",
        f"`validate`, `bench`, `calibrate`) and `serve` fill in {tool} instead, where a recipe",
        "names none.",
        "",
        "### Top level",
        "",
        *_fields_table(RecipeShape, "", skip=(*SLOT_DEFAULTS, "target", "prompt")),
        "",
        "### `target`",
        "",
        *_fields_table(TargetSpec, "target."),
        "",
        "### `prompt`",
        "",
        *_fields_table(PromptSpec, "prompt."),
    ]
    for slot in SLOTS:
        default = SLOT_DEFAULTS[slot]
        kinds = (
            ", ".join(f"`{d['kind']}`" for d in default)
            if isinstance(default, list)
            else f"`{default['kind']}`"
        )
        shape = "a list of rules, each with its `kind`" if slot == "stop" else "one `kind`"
        lines += ["", f"### `{slot}`", "", f"{shape.capitalize()}; default: {kinds}.", ""]
        for info in registry.claims(slot):
            if builtin_only and not registry.is_builtin(info):
                continue
            try:
                lines += _kind_part(slot, info)
            except Exception as e:  # one broken plugin must not cost the page of every kind
                get_logger().warning(
                    "kind left out of the reference", slot=slot, kind=info.kind, error=str(e)
                )
    return lines


def _training_part() -> list[str]:
    from dspark_flow.training.recipe import TrainRecipe

    return [
        "## Training recipes (`dspark-flow train`)",
        "",
        "Examples: `recipes/train/`; how training works: docs/training.md.",
        "",
        *_fields_table(TrainRecipe, ""),
        "",
    ]


def _flag_help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        text = text % dict(vars(action), prog=prog)
    return _cell(text)


def _cli_part() -> list[str]:
    from dspark_flow.cli.main import build_parser

    parser = build_parser()
    lines = ["## Command line", "", "`dspark-flow --version` prints the version.", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        lines += [f"### `dspark-flow {name}`", "", _cell(command.description or ""), ""]
        lines += ["| argument | default | what it does |", "|---|---|---|"]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest.upper()}`"
            if action.choices and not isinstance(action, argparse._SubParsersAction):
                names += " (" + ", ".join(str(c) for c in action.choices) + ")"
            default = action.default
            unset = default is None or default is False or default == argparse.SUPPRESS
            shown = "" if unset or not action.option_strings else f"`{default}`"
            lines.append(f"| {names} | {shown} | {_flag_help(action, command.prog)} |")
        lines.append("")
    return lines


def reference_markdown(builtin_only: bool = True) -> str:
    text = "\n".join([_INTRO, *_recipe_part(builtin_only), *_training_part(), *_cli_part()])
    while "\n\n\n" in text:  # sections end and begin with a blank line each
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_markdown(builtin_only=True))
