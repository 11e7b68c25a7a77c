"""Requests -> prompt token ids, and the per-request sampler and budget.

Encoding happens on the request's own thread (not the generation worker), so a bad prompt is
answered at once even while another request is generating.
"""

from __future__ import annotations

import logging
from typing import Any

from dspark_flow.server.common import ApiError
from dspark_flow.server.engine import Engine

# An over-long prompt gets its own 400 below (`check_budget`); transformers' warning about the
# same prompt, printed while encoding it, would only put a misleading line in the server's log.
logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)


# Below this, logits / T overflows float32 and the distribution is a point mass anyway.
MIN_TEMPERATURE = 1e-4


def encode_chat(
    engine: Engine,
    messages: list[dict[str, str]],
    *,
    continue_last: bool = False,
) -> list[int]:
    """Messages through the target's chat template. With `continue_last` a final assistant
    message is a prefix the answer continues (Anthropic's prefill) instead of a closed turn."""
    tok = engine.tokenizer
    if not getattr(tok, "has_chat_template", False):
        raise ApiError(400, "this model has no chat template; use /v1/completions with a prompt")
    system = engine.pipeline.recipe.prompt.system
    if system and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    prefill = ""
    if continue_last and messages and messages[-1]["role"] == "assistant":
        prefill = messages[-1]["content"]
        messages = messages[:-1]
    if not messages:  # an assistant prefill alone: the template's own words say less
        raise ApiError(
            400, "the conversation needs a message before the assistant's", param="messages"
        )
    try:
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
    except Exception as exc:  # templates raise on role orders they do not support
        raise ApiError(400, f"the chat template rejected these messages: {exc}") from None
    if prefill:
        ids += list(tok.encode(prefill, add_special_tokens=False))
    return ids


def encode_text(engine: Engine, prompt: str | list[int]) -> list[int]:
    """A raw completion prompt: text (no chat template) or token ids checked against the vocab."""
    if isinstance(prompt, str):  # (its text checked with the request's other fields)
        return list(engine.tokenizer.encode(prompt))
    vocab = engine.pipeline.vocab_size  # the embedding's rows, as the Python API checks
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
    return list(prompt)


def check_budget(engine: Engine, prompt_ids: list[int], max_tokens: int | None) -> int | None:
    """The token budget to run with: the request's (or the recipe's) clipped to what the
    context has left; a prompt that leaves no room is a client error."""
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    ctx = engine.context_length
    if ctx is None:
        return max_tokens
    room = ctx - len(prompt_ids)
    if room < 1:
        raise ApiError(
            400,
            f"the prompt has {len(prompt_ids)} tokens; this model's context holds {ctx}",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        budgets = [b for s in engine.pipeline.stops if (b := s.token_budget) is not None]
        if not budgets or min(budgets) <= room:
            return None  # the recipe's own budget fits
        return room
    return min(max_tokens, room)


def sampler_for(
    engine: Engine,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
) -> dict[str, Any] | None:
    """The request's sampler section: fields it leaves out keep the recipe's values, and a
    request that sets none runs the recipe's sampler unchanged. Temperature ~0 is greedy."""
    given = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
    }
    if all(v is None for v in given.values()):
        return None
    base = engine.pipeline.recipe.sampler.model_dump()
    if base.get("kind") != "sample":
        base = {"temperature": 0.0}
    settings = {
        "temperature": base.get("temperature", 1.0),
        "top_p": base.get("top_p", 1.0),
        "top_k": base.get("top_k", 0),
        "min_p": base.get("min_p", 0.0),
        "seed": base.get("seed"),
    }
    settings.update({k: v for k, v in given.items() if v is not None})
    if settings["temperature"] < MIN_TEMPERATURE:
        return {"kind": "greedy"}
    if settings["seed"] is not None:
        settings["seed"] %= 2**64  # MLX keys take unsigned 64-bit seeds; OpenAI's may be negative
    return {"kind": "sample", **settings}
