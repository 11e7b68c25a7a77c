"""The one-call Python API. Each function is a recipe in disguise: it builds the same `Pipeline`
the CLI runs, around a target the caller already loaded."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dspark_flow.pipeline import Pipeline, Prompt
from dspark_flow.recipe.schema import DEFAULT_MODEL
from dspark_flow.result import GenResult


def load_target(
    model: str | None = None, revision: str | None = None, weights: str = "auto"
) -> tuple[Any, Any]:
    """Load a target: the embedded default when `model` is None, else `builtin:<name>`, a hub
    repo id or a local mlx-lm directory. Returns (model, tokenizer)."""
    from dspark_flow.models.loading import load_model_dir, resolve_model_path

    return load_model_dir(resolve_model_path(model or DEFAULT_MODEL, revision), weights)


def sampler_section(
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
) -> dict[str, Any]:
    """The recipe's sampler section for these settings (greedy at temperature 0)."""
    if temperature == 0.0 and top_p == 1.0 and top_k == 0 and min_p == 0.0:
        return {"kind": "greedy"}
    return {
        "kind": "sample",
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
    }


def run_recipe(
    target: Any,
    tokenizer: Any,
    prompt: Prompt,
    *,
    drafter: dict[str, Any],
    draft_cap: dict[str, Any] | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] | None = None,
    on_text: Callable[[str], None] | None = None,
    chat: bool = True,
    objects: dict[str, Any] | None = None,
) -> GenResult:
    """Build and run the recipe these arguments describe. `objects` passes ready strategy
    objects by slot (e.g. a drafter holding an already loaded model)."""
    recipe: dict[str, Any] = {
        "drafter": drafter,
        "sampler": sampler_section(temperature, top_p, top_k, min_p, seed),
        "prompt": {"chat": chat},
        "stop": [{"kind": "eos"}, {"kind": "max_tokens", "limit": max_new_tokens}],
    }
    if stop:
        recipe["stop"].append({"kind": "strings", "strings": list(stop)})
    if draft_cap is not None:
        recipe["draft_cap"] = draft_cap
    pipeline = Pipeline.from_dict(recipe, target=(target, tokenizer), **(objects or {}))
    return pipeline.generate(prompt, on_text=on_text)


def greedy_generate(target: Any, tokenizer: Any, prompt: Prompt, **kwargs: Any) -> GenResult:
    """Plain decoding (no drafter) - greedy, or sampled when `temperature` > 0."""
    return run_recipe(target, tokenizer, prompt, drafter={"kind": "none"}, **kwargs)


def lookup_generate(
    target: Any,
    tokenizer: Any,
    prompt: Prompt,
    *,
    max_draft_tokens: int = 16,
    min_ngram: int = 2,
    max_ngram: int = 4,
    **kwargs: Any,
) -> GenResult:
    """Speculative decoding with prompt/context n-gram lookup as the drafter."""
    drafter = {
        "kind": "lookup",
        "min_ngram": min_ngram,
        "max_ngram": max_ngram,
        "max_draft": max_draft_tokens,
    }
    return run_recipe(
        target, tokenizer, prompt, drafter=drafter, draft_cap={"kind": "full_block"}, **kwargs
    )


def draft_model_generate(
    target: Any,
    tokenizer: Any,
    draft: Any,
    prompt: Prompt,
    *,
    max_draft_tokens: int = 4,
    **kwargs: Any,
) -> GenResult:
    """Classic speculative decoding with an already loaded draft model sharing the tokenizer."""
    from dspark_flow.strategies.drafters.draft_model import DraftModelConfig, DraftModelDrafter

    drafter = DraftModelDrafter(DraftModelConfig(model="<in memory>"), model=draft)
    return run_recipe(
        target,
        tokenizer,
        prompt,
        drafter={"kind": "draft_model", "model": "<in memory>"},
        draft_cap={"kind": "fixed", "k": max_draft_tokens},
        objects={"drafter": drafter},
        **kwargs,
    )
