"""Warm start (`train.init_from`): begin training from a drafter directory in the published
layout (one this command exported, or one published elsewhere with the same shapes).

The source's weights are read (quantized matrices dequantized) into the recipe's drafter. The
recipe may ask for more layers than the source has: the extra layers come after the source's
and keep the trainer's identity start (zero residual branches), so step 0 computes exactly what
the source computes (up to its quantization) and the added capacity is learnt from there.
Frozen tensors (DSpark's embedding, rebuilt from the target) are not taken from the source.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dspark_flow.errors import DsparkFlowError
from dspark_flow.training.recipe import TrainRecipe

_LAYER = re.compile(r"^layers\.(\d+)\.")
_LAYOUT_OF_KIND = {"dspark": "deepspec", "dflash": "dflash"}


def _dequantized(tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """Float weights for every `<path>.scales` group (mlx-lm's convention: config
    `quantization` holds the default group/bits and optional per-path entries)."""
    quant = config.get("quantization") or {}
    bases = {n[: -len(".scales")] for n in tensors if n.endswith(".scales")}
    out = {n: v for n, v in tensors.items() if n.rsplit(".", 1)[0] not in bases}
    with mx.stream(mx.cpu):
        for base in bases:
            params = {
                "group_size": int(quant.get("group_size", 64)),
                "bits": int(quant.get("bits", 4)),
            }
            entry = quant.get(base)
            if isinstance(entry, dict):
                params.update({k: int(entry[k]) for k in params if k in entry})
            out[f"{base}.weight"] = mx.dequantize(
                tensors[f"{base}.weight"],
                tensors[f"{base}.scales"],
                tensors.get(f"{base}.biases"),
                **params,
            ).astype(mx.float32)
    return out


def weights_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def start_from(
    model: nn.Module, source: Path, recipe: TrainRecipe, mask_token_id: int, dtype: mx.Dtype
) -> dict[str, Any]:
    """Load `source`'s weights into `model` (built for `recipe`); returns what the summary
    records about the source. One-line DsparkFlowError when the source cannot fit."""
    from dspark_flow.models.drafter_loading import _IGNORED_TENSORS, read_spec, read_tensors

    source = Path(source)
    where = f"train.init_from {source}"
    spec = read_spec(source)
    arch = recipe.drafter
    if spec.layout != _LAYOUT_OF_KIND[arch.kind]:
        raise DsparkFlowError(
            f"{where} is a {spec.layout} drafter; this recipe trains a {arch.kind} drafter"
        )
    for name, have, want in (
        ("block_size", spec.block_size, arch.block_size),
        ("target_layer_ids", spec.target_layer_ids, list(arch.target_layer_ids)),
        ("mask_token_id", spec.mask_token_id, mask_token_id),
    ):
        if have != want:
            raise DsparkFlowError(f"{where} has {name} {have}, this recipe {want}")
    layers = spec.backbone.num_layers
    if layers > arch.num_layers:
        raise DsparkFlowError(
            f"{where} has {layers} layers, more than the recipe's drafter.num_layers "
            f"{arch.num_layers} (layers can be added, not dropped)"
        )
    tensors = _dequantized(read_tensors(source), spec.config)
    params = dict(tree_flatten(model.parameters()))
    trainable = dict(tree_flatten(model.trainable_parameters()))
    taken: list[tuple[str, mx.array]] = []
    for name, value in sorted(tensors.items()):
        if _IGNORED_TENSORS.search(name) or (name in params and name not in trainable):
            continue  # frozen here (rebuilt from the target), or a buffer
        if name not in params:
            raise DsparkFlowError(f"{where} has tensor {name!r}, which this recipe's drafter lacks")
        if tuple(value.shape) != tuple(params[name].shape):
            raise DsparkFlowError(
                f"{where}: tensor {name!r} has shape {tuple(value.shape)}, this recipe's drafter "
                f"{tuple(params[name].shape)}"
            )
        taken.append((name, value.astype(dtype)))
    missing = [
        n
        for n in trainable
        if n not in tensors and not ((m := _LAYER.match(n)) and int(m.group(1)) >= layers)
    ]
    if missing:
        raise DsparkFlowError(f"{where} lacks tensor {missing[0]!r} of this recipe's drafter")
    model.load_weights(taken, strict=False)
    mx.eval(model.parameters())
    record: dict[str, Any] = {
        "path": str(source),
        "weights_sha256": weights_digest(source),
        "layers": layers,
        "added_layers": arch.num_layers - layers,
    }
    try:  # a drafter this command trained says how it was made
        summary = json.loads((source / "train_summary.json").read_text())
        record["steps"] = int(summary["train"]["steps"])
        record["recipe"] = summary.get("recipe")
        if summary.get("train", {}).get("init_from"):
            record["init_from"] = summary["train"]["init_from"]  # the lineage, recursively
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return record
