"""A tiny random-weight llama built with mlx-lm, sharing the embedded model's vocabulary.

Used only where a test needs thousands of generations (statistical tests) or a second model that
disagrees with the target; everything else runs on the real embedded model.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

VOCAB = 49152


def tiny_args(seed: int = 0, hidden: int = 32) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    }


def tiny_model(seed: int = 0, scale: float = 4.0, vocab: int = VOCAB) -> llama.Model:
    """Random weights; `scale` sharpens the output distribution so top tokens differ."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(**{**tiny_args(seed), "vocab_size": vocab}))
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * scale
    mx.eval(model.parameters())
    return model


def save_tiny(model: llama.Model, directory: Path, tokenizer_dir: Path) -> Path:
    """Write `model` as an mlx-lm directory with the tokenizer files of `tokenizer_dir`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_args()))
    mx.save_safetensors(
        str(directory / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (directory / f.name).write_bytes(f.read_bytes())
    return directory
