"""Load a recipe from YAML, apply `--set` overrides, validate, and report every problem at once.

Each problem is one line, `file:line:col dotted.path: message`, with the position taken from the
YAML node the problem is about (pydantic's `loc` walked through `yaml.compose`'s node tree).
"""

from __future__ import annotations

import copy
import os
import re
import reprlib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from dspark_flow import registry
from dspark_flow.errors import RecipeError, RegistryError
from dspark_flow.recipe.schema import SLOT_DEFAULTS, Recipe, RecipeShape

Loc = tuple[str | int, ...]
MAPPING_SLOTS = ("drafter", "verifier", "sampler", "draft_cap", "cache")
M = TypeVar("M", bound=BaseModel)


class _Located:
    """Maps a dotted location in the data to a `line:col` in the YAML text."""

    def __init__(self, source: str, root: yaml.Node | None, overridden: dict[Loc, str]):
        self.source = source
        self.root = root
        self.overridden = overridden

    def where(self, loc: Loc, at_key: bool = False) -> str:
        """Position of the value at `loc` (of its key with `at_key`, for unknown fields)."""
        for prefix_len in range(len(loc), 0, -1):
            if loc[:prefix_len] in self.overridden:
                return f"--set {self.overridden[loc[:prefix_len]]}"
        node, in_file = self.root, True
        for i, part in enumerate(loc):
            child = _child(node, part, at_key=at_key and i == len(loc) - 1)
            if child is None:
                in_file = False
                break
            node = child
        # A section an override created (`--set nope.x=1` makes `nope`) is not in the file.
        below = [text for at, text in self.overridden.items() if loc and at[: len(loc)] == loc]
        if below and not in_file:
            return f"--set {below[0]}"
        if node is None:
            return self.source
        mark = node.start_mark
        return f"{self.source}:{mark.line + 1}:{mark.column + 1}"

    def problem(self, loc: Loc, message: str, at_key: bool = False) -> str:
        path = ".".join(str(p) for p in loc) or "(recipe)"
        return f"{self.where(loc, at_key)} {path}: {message}"


def _child(node: yaml.Node | None, part: str | int, at_key: bool = False) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        found = None
        for key, value in node.value:
            if key.value == part:  # the last of duplicate keys wins, as in the loaded data
                found = key if at_key else value
        if found is not None:
            return found
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return node.value[part]
    return None


def _duplicate_keys(
    node: yaml.Node | None, loc: Loc = (), visited: set[int] | None = None
) -> list[tuple[Loc, str]]:
    """PyYAML keeps the last of two equal keys silently; a recipe should not. Each node is
    walked once: an alias (`*x`) reuses its anchor's node, and walking it again per use would
    loop on `a: &x [*x]` or grow exponentially with aliases of aliases."""
    visited = set() if visited is None else visited
    if id(node) in visited:
        return []
    visited.add(id(node))
    found: list[tuple[Loc, str]] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            if key.value in seen:
                found.append(((*loc, key.value), "duplicate key"))
            seen.add(key.value)
            found.extend(_duplicate_keys(value, (*loc, key.value), visited))
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            found.extend(_duplicate_keys(value, (*loc, i), visited))
    return found


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """`draft_cap.k=4` -> (["draft_cap", "k"], 4); the value is read as a YAML scalar."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {text}: expected KEY.PATH=VALUE")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:  # one line: PyYAML's message spans several with a caret
        problem = getattr(exc, "problem", None) or type(exc).__name__
        mark = getattr(exc, "problem_mark", None)
        at = f" at column {mark.column + 1}" if mark is not None else ""
        raise RecipeError(f"--set {text}: value is not valid YAML ({problem}{at})") from None
    parts = key.strip().split(".")
    if any(not p.strip() for p in parts):
        raise RecipeError(f"--set {text}: empty part in the key path (expected KEY.PATH=VALUE)")
    path: list[str | int] = [int(p) if p.isdigit() else p for p in parts]
    return path, value


def apply_overrides(
    data: dict[str, Any], overrides: list[str], filled: frozenset[str] = frozenset()
) -> dict[Loc, str]:
    """Apply `--set` overrides in place; return which locations they touched. `filled`: slots
    the caller filled with its defaults; setting such a slot's kind to another starts it afresh
    (the default's other settings may not exist for the kind the user names)."""
    touched: dict[Loc, str] = {}
    if isinstance(overrides, str):  # one override given bare (Python callers)
        overrides = [overrides]
    if not isinstance(overrides, list | tuple) or not all(isinstance(o, str) for o in overrides):
        raise RecipeError(f"overrides: expected 'path=value' strings, got {_brief_repr(overrides)}")
    # A default-filled slot whose kind the overrides change (the last `SLOT.kind=` wins) starts
    # afresh before any override applies: the default's settings may not exist for that kind,
    # while the user's own `--set`s for the slot, whatever their order, all stay.
    final_kinds = {}
    for text in overrides:
        path, value = parse_override(text)
        if len(path) == 2 and path[1] == "kind" and str(path[0]) in filled:
            final_kinds[str(path[0])] = value
    for slot_name, kind in final_kinds.items():
        if isinstance(data.get(slot_name), dict) and data[slot_name].get("kind") != kind:
            data[slot_name] = {}
    for text in overrides:
        path, value = parse_override(text)
        node: Any = data
        for i, part in enumerate(path[:-1]):
            nxt = path[i + 1]
            if isinstance(node, list):
                if not isinstance(part, int) or part >= len(node):
                    raise RecipeError(
                        f"--set {text}: no item {part} in {'.'.join(map(str, path[:i]))}"
                    )
                node = node[part]
                continue
            if not isinstance(node, dict):
                raise RecipeError(f"--set {text}: {'.'.join(map(str, path[:i]))} is not a mapping")
            if part not in node or node[part] is None:
                node[part] = (
                    copy.deepcopy(SLOT_DEFAULTS[part])
                    if part in SLOT_DEFAULTS and i == 0
                    else ([] if isinstance(nxt, int) else {})
                )
            node = node[part]
        last = path[-1]
        settable = isinstance(node, dict) or (
            isinstance(node, list) and isinstance(last, int) and last < len(node)
        )
        if not settable:
            raise RecipeError(f"--set {text}: cannot set {'.'.join(map(str, path))}")
        node[last] = value
        touched[tuple(path)] = text
    return touched


# A check across fields (a model validator) is reported at the model's own location; one that
# starts its message with the dotted path of the field it is about ("train.seq_len: ...") is
# located at that field instead.
_NAMED_FIELD = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+): (.+)", re.DOTALL)


def _pydantic_problems(exc: ValidationError, where: _Located, prefix: Loc) -> list[str]:
    out = []
    for err in exc.errors():
        loc = (*prefix, *err["loc"])
        if err["type"] == "extra_forbidden":
            out.append(where.problem(loc, "unknown field", at_key=True))
            continue
        message = str(err["msg"]).removeprefix("Value error, ")
        if (named := _NAMED_FIELD.fullmatch(message)) is not None:
            loc, message = (*loc, *named.group(1).split(".")), named.group(2)
        out.append(where.problem(loc, message))
    return out


_BRIEF = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxdict = 2, 4, 4
_BRIEF.maxstring = _BRIEF.maxother = 60


def _brief_repr(value: Any) -> str:
    """A value in a message, cut short: a YAML alias of aliases is a list of 10^9 items whose
    full repr would take minutes and gigabytes."""
    return _BRIEF.repr(value)


def _validate_slot(slot: str, section: Any, loc: Loc, where: _Located, problems: list[str]) -> Any:
    if not isinstance(section, dict):
        problems.append(
            where.problem(loc, f"expected a mapping with a 'kind', got {_brief_repr(section)}")
        )
        return None
    kind = section.get("kind")
    if kind is not None and not isinstance(kind, str):
        problems.append(
            where.problem((*loc, "kind"), f"expected a kind's name, got {_brief_repr(kind)}")
        )
        return None
    if not isinstance(kind, str):
        problems.append(where.problem((*loc, "kind"), registry.missing_kind_message(slot)))
        return None
    try:
        cls = registry.load_kind(slot, kind)
    except RegistryError as exc:
        problems.append(where.problem((*loc, "kind"), str(exc)))
        return None
    try:
        return cls.Config.model_validate(section)
    except ValidationError as exc:
        problems.extend(_pydantic_problems(exc, where, loc))
        return None


def validate_model(
    model: type[M],
    data: Any,
    source: str,
    root: yaml.Node | None = None,
    overridden: dict[Loc, str] | None = None,
    what: str = "a recipe",
) -> M:
    """`data` validated as one pydantic model (a training recipe), every problem located, and
    duplicate keys refused as `validate` refuses them in an inference recipe."""
    where = _Located(source, root, overridden or {})
    problems = [where.problem(loc, msg, at_key=True) for loc, msg in _duplicate_keys(root)]
    if not isinstance(data, dict):
        raise RecipeError(where.problem((), f"{what} is a mapping, got {type(data).__name__}"))
    try:
        result = model.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(problems + _pydantic_problems(exc, where, ())) from None
    if problems:
        raise RecipeError(problems)
    return result


def validate(
    data: Any,
    source: str = "<recipe>",
    root: yaml.Node | None = None,
    overridden: dict[Loc, str] | None = None,
) -> Recipe:
    where = _Located(source, root, overridden or {})
    problems = [where.problem(loc, msg, at_key=True) for loc, msg in _duplicate_keys(root)]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(where.problem((), f"a recipe is a mapping, got {type(data).__name__}"))
    if {"data", "train"} <= data.keys():
        raise RecipeError(
            f"{source}: this is a training recipe (it has data and train sections): "
            f"check it with `dspark-flow train {source} --check`"
        )
    try:
        shape = RecipeShape.model_validate(data)
    except ValidationError as exc:
        # Every problem at once: the slot sections the outer shape did not fault are still
        # checked against their kinds' configs.
        problems += _pydantic_problems(exc, where, ())
        faulted = {tuple(err["loc"][:2]) for err in exc.errors()}
        faulted |= {loc[:1] for loc in faulted}
        for slot in MAPPING_SLOTS:
            if slot in data and (slot,) not in faulted:
                _validate_slot(slot, data[slot], (slot,), where, problems)
        if isinstance(data.get("stop"), list):
            for i, s in enumerate(data["stop"]):
                if ("stop", i) not in faulted and isinstance(s, dict):
                    _validate_slot("stop", s, ("stop", i), where, problems)
        raise RecipeError(problems) from None

    sections: dict[str, Any] = {}
    for slot in MAPPING_SLOTS:
        sections[slot] = _validate_slot(slot, getattr(shape, slot), (slot,), where, problems)
    sections["stop"] = [
        _validate_slot("stop", s, ("stop", i), where, problems) for i, s in enumerate(shape.stop)
    ]
    if problems:
        raise RecipeError(problems)
    return Recipe(
        version=shape.version,
        name=shape.name,
        description=shape.description,
        target=shape.target,
        prompt=shape.prompt,
        **sections,
    )


def load_recipe(
    path: str | Path,
    overrides: list[str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Recipe:
    """Read, override and validate a recipe file; raise `RecipeError` listing every problem.
    `defaults`: sections for slots the file leaves out (e.g. TOOL_DEFAULTS); `--set` overrides
    refine them, and one that names the slot's kind replaces the section."""
    return loads_recipe(read_recipe_text(path), str(path), overrides, defaults)


def read_recipe_text(path: str | Path, what: str = "recipe") -> str:
    """The file's text; a missing or unreadable file is one RecipeError line."""
    if not isinstance(path, str | os.PathLike):
        raise RecipeError(f"{what}: expected a file path, got {type(path).__name__}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{path}: {what} file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read {what} ({exc})") from None


def parse_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """(data, node tree for error positions); malformed YAML is one positioned RecipeError."""
    try:
        return yaml.safe_load(text), yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        pos = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{source}{pos} malformed YAML: {reason}") from None
    except RecursionError:
        raise RecipeError(f"{source}: malformed YAML: nested too deeply") from None


def loads_recipe(
    text: str,
    source: str = "<recipe>",
    overrides: list[str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Recipe:
    data, root = parse_yaml(text, source)
    if data is None:  # an empty or all-comment file is a mistake far more often than a choice
        raise RecipeError(f"{source}: the recipe is empty (write {{}} to take every default)")
    overridden: dict[Loc, str] = {}
    if defaults is not None and not (
        isinstance(defaults, dict) and all(isinstance(v, dict | list) for v in defaults.values())
    ):
        raise RecipeError(
            f"defaults: expected recipe sections by slot, got {_brief_repr(defaults)}"
        )
    if isinstance(data, dict):
        filled = frozenset(  # mapping sections only: a list slot (stop) is the user's whole
            slot
            for slot, section in (defaults or {}).items()
            if slot not in data and isinstance(section, dict)
        )
        for slot in filled:
            data[slot] = copy.deepcopy(defaults[slot])  # type: ignore[index]
        overridden = apply_overrides(data, overrides or [], filled)
    return validate(data, source=source, root=root, overridden=overridden)
