"""The base of every recipe section (strategy configs, the recipe's own sections, training
recipes): what YAML lets through but a user never means is an error, not a silent coercion."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator


def _is_number(option: Any) -> bool:
    """int, float, or a Literal's number value (Literal[1]: pydantic matches true to it)."""
    return option in (int, float) or (
        isinstance(option, int | float) and not isinstance(option, bool)
    )


def _numbers_only(annotation: Any) -> bool:
    """An int or float field (optional or not; a Literal of numbers too) that takes no bool."""
    options = _options(annotation)
    return bool not in options and any(_is_number(t) for t in options)


def _options(annotation: Any) -> tuple[Any, ...]:
    """An annotation's alternatives, None dropped, Literal values expanded."""
    out: list[Any] = []
    for option in get_args(annotation) if get_origin(annotation) is not Literal else (annotation,):
        if option is type(None):
            continue
        out.extend(get_args(option) if get_origin(option) is Literal else [option])
    return tuple(out) if get_args(annotation) else (annotation,)


def _integers_strictly(annotation: Any) -> bool:
    """A field whose every alternative is an integer (int, a Literal of ints): text there is a
    slip (`limit: "10"`), and so is a bool (`version: true` matched Literal[1]). Float fields
    keep reading text: PyYAML reads `1e-3` (no dot) as text, and pydantic parses it right."""
    options = _options(annotation)
    return bool(options) and all(
        (isinstance(t, int) and not isinstance(t, bool)) or t is int for t in options
    )


def _bool_only(annotation: Any) -> bool:
    """A bool field (optional or not): pydantic reads 1, "yes" and "on" as true there."""
    options = _options(annotation)
    return bool(options) and all(t is bool for t in options)


def _reads_as_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


# What pydantic's lax mode reads as a bool besides true and false themselves.
_BOOL_WORDS = frozenset({"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"})


def _coerced_to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return value in (0, 1)
    return isinstance(value, str) and value.strip().lower() in _BOOL_WORDS


def _number_items(annotation: Any) -> bool:
    """A list (or tuple) of numbers, optional or not: `depths: [64, 512]`."""
    sequence = get_origin(annotation) in (list, tuple)
    for option in (annotation,) if sequence else get_args(annotation):
        if get_origin(option) in (list, tuple):
            items = [a for a in get_args(option) if a is not Ellipsis]
            return bool(items) and all(_numbers_only(a) for a in items)
    return False


def _check_utf8(name: str, value: Any) -> None:
    """Text that cannot be UTF-8 (a lone surrogate from a JSON or YAML escape) would fail far
    from the recipe (the tokenizer's TypeError) or never match (a stop string)."""
    for i, text in enumerate(value if isinstance(value, list) else [value]):
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            at = f"[{i}]" if isinstance(value, list) else ""
            raise ValueError(
                f"{name}{at}: not valid UTF-8 text (a lone surrogate at character {e.start + 1})"
            ) from None


class Section(BaseModel):
    # Unknown keys are typos; .inf and .nan are YAML floats that no setting wants.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_default=True)
    # Number fields whose own validator reads a YAML boolean as a word (`draft_vocab: off`).
    BOOLEAN_WORDS: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        # pydantic reads true as 1 for a number; in a recipe that is a slip (`k: true`). A
        # section-level check: a field validator on "*" would also wrap `kind`, which pydantic
        # forbids on a discriminator.
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if name in cls.BOOLEAN_WORDS or field is None:
                    continue
                _check_utf8(name, value)
                if isinstance(value, bool) and _numbers_only(field.annotation):
                    raise ValueError(f"{name}: expected a number, got {str(value).lower()}")
                # (only what pydantic would coerce: what it refuses it reports at the field)
                if (
                    isinstance(value, str)
                    and _integers_strictly(field.annotation)
                    and _reads_as_int(value)
                ):
                    raise ValueError(f"{name}: expected a number, got the text {value!r}")
                if _bool_only(field.annotation) and _coerced_to_bool(value):
                    raise ValueError(f"{name}: expected true or false, got {value!r}")
                if isinstance(value, (list, tuple)) and _number_items(field.annotation):
                    for i, item in enumerate(value):
                        if isinstance(item, bool):
                            got = str(item).lower()
                            raise ValueError(f"{name}[{i}]: expected a number, got {got}")
        return data
