"""Server settings and the recipe -> pipeline step (prefix cache by default)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dspark_flow.pipeline import Pipeline
from dspark_flow.recipe.load import loads_recipe, parse_override, parse_yaml, read_recipe_text
from dspark_flow.recipe.schema import TOOL_DEFAULTS, Recipe
from dspark_flow.server import DEFAULT_MAX_QUEUE

MiB = 2**20
DEFAULT_MAX_BODY_BYTES = 4 * MiB


@dataclass
class ServerConfig:
    model_id: str  # what /v1/models lists and responses name
    aliases: set[str] = field(default_factory=set)  # other names a request may use
    target: str = ""
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queue: int | None = DEFAULT_MAX_QUEUE  # requests that may wait (None: no limit)

    def accepts(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases

    @classmethod
    def for_recipe(cls, recipe: Recipe, **kwargs: object) -> ServerConfig:
        target = recipe.target.model
        model_id = recipe.name or target
        return cls(model_id=model_id, aliases={target}, target=target, **kwargs)  # type: ignore[arg-type]


def server_overrides(
    overrides: list[str],
    cache_bytes: int | None,
    max_active_bytes: int | None,
    recipe_cache: object = None,
) -> list[str]:
    """The user's `--set`s, preceded by the prefix cache unless they chose a cache themselves.
    A recipe whose own cache is already `prefix` keeps its settings (`recipe_cache`: the file's
    cache section); the size flags, where given, refine them."""
    touches_cache = any(str(parse_override(o)[0][0]) == "cache" for o in overrides)
    if touches_cache:
        return list(overrides)
    sizes = {"max_bytes": cache_bytes, "max_active_bytes": max_active_bytes}
    if isinstance(recipe_cache, dict) and recipe_cache.get("kind") == "prefix":
        return [f"cache.{k}={v}" for k, v in sizes.items() if v is not None] + list(overrides)
    section = ["kind: prefix"] + [f"{k}: {v}" for k, v in sizes.items() if v is not None]
    return [f"cache={{{', '.join(section)}}}", *overrides]


def build_pipeline(
    recipe_path: str | Path,
    overrides: list[str] | None = None,
    *,
    cache_bytes: int | None = None,
    max_active_bytes: int | None = None,
    target: object = None,
) -> Pipeline:
    # One read of the file: the cache section looked at here is the one validated below.
    text = read_recipe_text(recipe_path)
    data, _ = parse_yaml(text, str(recipe_path))
    recipe_cache = data.get("cache") if isinstance(data, dict) else None
    recipe = loads_recipe(
        text,
        str(recipe_path),
        server_overrides(overrides or [], cache_bytes, max_active_bytes, recipe_cache),
        TOOL_DEFAULTS,
    )
    return Pipeline(recipe, target=target)  # type: ignore[arg-type]
