"""Server settings and the recipe -> pipeline step (prefix cache by default)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dspark_flow.pipeline import Pipeline
from dspark_flow.recipe.load import load_recipe, parse_override
from dspark_flow.recipe.schema import TOOL_DEFAULTS, Recipe

MiB = 2**20
DEFAULT_MAX_BODY_BYTES = 4 * MiB


@dataclass
class ServerConfig:
    model_id: str  # what /v1/models lists and responses name
    aliases: set[str] = field(default_factory=set)  # other names a request may use
    target: str = ""
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def accepts(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases

    @classmethod
    def for_recipe(cls, recipe: Recipe, **kwargs: object) -> ServerConfig:
        target = recipe.target.model
        model_id = recipe.name or target
        return cls(model_id=model_id, aliases={target}, target=target, **kwargs)  # type: ignore[arg-type]


def server_overrides(
    overrides: list[str], cache_bytes: int | None, max_active_bytes: int | None
) -> list[str]:
    """The user's `--set`s, preceded by the prefix cache unless they chose a cache themselves."""
    touches_cache = any(str(parse_override(o)[0][0]) == "cache" for o in overrides)
    if touches_cache:
        return list(overrides)
    section = ["kind: prefix"]
    if cache_bytes is not None:
        section.append(f"max_bytes: {cache_bytes}")
    if max_active_bytes is not None:
        section.append(f"max_active_bytes: {max_active_bytes}")
    return [f"cache={{{', '.join(section)}}}", *overrides]


def build_pipeline(
    recipe_path: str | Path,
    overrides: list[str] | None = None,
    *,
    cache_bytes: int | None = None,
    max_active_bytes: int | None = None,
    target: object = None,
) -> Pipeline:
    recipe = load_recipe(
        recipe_path,
        server_overrides(overrides or [], cache_bytes, max_active_bytes),
        TOOL_DEFAULTS,
    )
    return Pipeline(recipe, target=target)  # type: ignore[arg-type]
