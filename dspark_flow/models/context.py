"""How long a context a loaded model was trained for, as its config says."""

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
