"""Warm start (`train.init_from`): begin training from a drafter directory in the published
layout (one this command exported, or one published elsewhere with the same shapes).

The source is read the way the product loads a drafter (its stored quantization, per-module
entries and shape checks included), dequantized, and copied into the recipe's drafter. The
recipe may ask for more layers than the source has: the extra layers come after the source's
and keep the trainer's identity start (zero residual branches), so step 0 computes exactly what
the source computes (up to its quantization) and the added capacity is learnt from there.
Frozen tensors (DSpark's embedding, rebuilt from the target) are not taken from the source.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dspark_flow.errors import DsparkFlowError
from dspark_flow.training.data import read_json_object

_LAYER = re.compile(r"^layers\.(\d+)\.")
_LAYOUT_OF_KIND = {"dspark": "deepspec", "dflash": "dflash"}
# Backbone settings that may differ between the source and the recipe's drafter.
_MAY_DIFFER = {"num_layers", "layer_types"}


def weights_digest(path: Path) -> str:
    """sha256 of the directory's weight files (hex), to tell one source from another."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _source_weights(spec: Any) -> dict[str, mx.array]:
    """The source's weights as float32, loaded by the product's own drafter loader."""
    from dspark_flow.models.backend import dequantize_model
    from dspark_flow.models.drafter_loading import DEEPSPEC, load_drafter_weights

    if spec.layout == DEEPSPEC:
        from dspark_flow.strategies.drafters.dspark import DSparkModel

        skeleton: nn.Module = DSparkModel(spec)
    else:
        from dspark_flow.models.drafter_backbone import DrafterBackbone

        skeleton = DrafterBackbone(spec.backbone)
    with mx.stream(mx.cpu):  # a one-off read; no GPU kernel needed
        load_drafter_weights(skeleton, spec, quantize=None, dtype="float32")
        dequantize_model(skeleton, mx.float32)
    return dict(tree_flatten(skeleton.parameters()))


def _check_stated(
    source: Any, kind: str, arch: Any, mask_token_id: int | None, layers: int, where: str
) -> None:
    """What a recipe states of its drafter (kind, block, taps, mask token, depth) against the
    source's spec; `arch` carries block_size and target_layer_ids, a mask token of None is
    not compared."""
    if source.layout != _LAYOUT_OF_KIND[kind]:
        raise DsparkFlowError(f"{where} is a {source.layout} drafter; this recipe trains {kind}")
    pairs = [
        ("block_size", source.block_size, arch.block_size),
        ("target_layer_ids", list(source.target_layer_ids), list(arch.target_layer_ids)),
    ]
    if mask_token_id is not None:
        pairs.append(("mask_token_id", source.mask_token_id, mask_token_id))
    _refuse_differences(pairs, where)
    if source.backbone.num_layers > layers:
        raise DsparkFlowError(
            f"{where} has {source.backbone.num_layers} layers, more than the recipe's "
            f"drafter.num_layers {layers} (layers can be added, not dropped)"
        )


def _check_settings(source: Any, ours: Any, kind: str, mask_token_id: int, where: str) -> None:
    """Everything but the depth must match: settings that change no tensor shape (RoPE base,
    norm epsilon, the heads x head_dim split, causality, taps) would load silently wrong."""
    _check_stated(source, kind, ours, mask_token_id, ours.backbone.num_layers, where)
    a, b = dataclasses.asdict(source.backbone), dataclasses.asdict(ours.backbone)
    pairs = [(k, a[k], b[k]) for k in sorted(b) if k not in _MAY_DIFFER]
    pairs += [(k, source.extra.get(k), v) for k, v in sorted(ours.extra.items())]
    _refuse_differences(pairs, where)


def _refuse_differences(pairs: list[tuple[str, Any, Any]], where: str) -> None:
    """One line naming the first setting (name, source's, recipe's) that differs."""
    for name, have, want in pairs:
        if have != want:
            raise DsparkFlowError(f"{where} has {name} {have}, this recipe's drafter {want}")


def require_init_from(source: str | Path | None) -> None:
    """One-line DsparkFlowError unless `source` (when set) holds a drafter directory."""
    if source is not None and not (Path(source) / "config.json").is_file():
        raise DsparkFlowError(
            f"train.init_from {source}: no drafter (config.json) there (train or fetch that "
            "drafter first, or drop train.init_from to start fresh)"
        )


def check_init_from(recipe: Any) -> None:
    """Before any work (and in `train --check`): the recipe's `train.init_from`, when set, is a
    drafter directory whose weights load and whose settings the recipe states (kind, block,
    taps, mask token, no more layers) match. `start_from` checks the rest (the settings the
    target decides) when training starts."""
    from dspark_flow.models.drafter_loading import read_spec

    source = recipe.train.init_from
    if source is None:
        return
    require_init_from(source)
    spec = read_spec(Path(source))
    arch = recipe.drafter
    where = f"train.init_from {source}"
    _check_stated(spec, arch.kind, arch, arch.mask_token_id, arch.num_layers, where)
    _source_weights(spec)  # a truncated or foreign weights file: now, not after the data


def start_from(
    model: nn.Module, ours: Any, source: Path, kind: str, mask_token_id: int, dtype: mx.Dtype
) -> dict[str, Any]:
    """Load the drafter directory `source` into `model` (built from the spec `ours`); returns
    what the summary records about the source. One-line DsparkFlowError when it cannot fit."""
    from dspark_flow.models.drafter_loading import _IGNORED_TENSORS, read_spec

    source = Path(source)
    where = f"train.init_from {source}"
    require_init_from(source)
    spec = read_spec(source)
    _check_settings(spec, ours, kind, mask_token_id, where)
    layers = spec.backbone.num_layers
    tensors = _source_weights(spec)
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
        "added_layers": ours.backbone.num_layers - layers,
    }
    # A drafter this command trained says how it was made (best effort, as every record here).
    summary = read_json_object(source / "train_summary.json")
    train = summary.get("train")
    if not isinstance(train, dict):
        train = {}
    if isinstance(train.get("steps"), int):
        record["steps"] = train["steps"]
        record["recipe"] = summary.get("recipe")
    if train.get("init_from"):
        record["init_from"] = train["init_from"]  # the lineage, recursively
    return record
