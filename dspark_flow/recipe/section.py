"""The base of every recipe section (strategy configs, the recipe's own sections, training
recipes): what YAML lets through but a user never means is an error, not a silent coercion."""

from __future__ import annotations

from typing import Any, ClassVar, get_args

from pydantic import BaseModel, ConfigDict, model_validator


def _numbers_only(annotation: Any) -> bool:
    """An int or float field (optional or not) that takes no bool."""
    options = get_args(annotation) or (annotation,)
    return bool not in options and any(t in (int, float) for t in options)


class Section(BaseModel):
    # Unknown keys are typos; .inf and .nan are YAML floats that no setting wants.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
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
                if name in cls.BOOLEAN_WORDS or field is None or not isinstance(value, bool):
                    continue
                if _numbers_only(field.annotation):
                    raise ValueError(f"{name}: expected a number, got {str(value).lower()}")
        return data
