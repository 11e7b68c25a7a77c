"""JSON Schema of recipes with every installed kind, for editors (imports all kinds)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, create_model

from dspark_flow import registry
from dspark_flow.errors import RegistryError
from dspark_flow.log import get_logger
from dspark_flow.recipe.schema import PromptSpec, TargetSpec


def _slot_union(slot: str) -> Any:
    configs = []
    for name in registry.kind_names(slot):
        try:
            configs.append(registry.load_kind(slot, name).Config)
        except RegistryError as e:  # one broken plugin must not cost the schema of every kind
            get_logger().warning("kind left out of the schema", slot=slot, kind=name, error=str(e))
    if not configs:
        raise RegistryError(f"no {slot} kind could be imported for the schema")
    if len(configs) == 1:
        return configs[0]
    return Annotated[Union[tuple(configs)], Field(discriminator="kind")]  # noqa: UP007


def recipe_json_schema() -> dict[str, Any]:
    model = create_model(
        "Recipe",
        version=(Literal[1], 1),
        name=(str | None, None),
        description=(str | None, None),
        target=(TargetSpec, TargetSpec()),
        prompt=(PromptSpec, PromptSpec()),
        drafter=(_slot_union("drafter"), None),
        verifier=(_slot_union("verifier"), None),
        sampler=(_slot_union("sampler"), None),
        draft_cap=(_slot_union("draft_cap"), None),
        cache=(_slot_union("cache"), None),
        stop=(list[_slot_union("stop")], None),  # type: ignore[misc]
        __config__=None,
    )
    schema = model.model_json_schema()
    schema["additionalProperties"] = False
    for section in schema.get("$defs", {}).values():  # a slot's section names its kind
        if "kind" in section.get("properties", {}):
            section["required"] = sorted({*section.get("required", []), "kind"})
    return schema
