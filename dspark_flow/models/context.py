"""What a loaded model's config says about it: its trained context, its vocabulary."""

from __future__ import annotations

from typing import Any

CONTEXT_FIELDS = ("max_position_embeddings", "max_seq_len", "n_ctx", "context_length")


def context_limit(model: Any) -> int | None:
    """The model's trained context length, when its config says (mlx-lm keeps it in `args`)."""
    args = getattr(model, "args", None)
    for name in CONTEXT_FIELDS:
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def config_vocab_size(model: Any) -> int | None:
    """Rows of the model's embedding as its config gives them (mlx-lm's `args`), else None."""
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(vocab) if vocab is not None else None
