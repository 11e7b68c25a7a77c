"""Feature taps: record the hidden states of chosen decoder layers of any mlx-lm target.

Trained drafters (DSpark, DFlash) read the target's hidden states at a few layers. Rather than
re-implement every model's forward to return them, the chosen entries of the target's layer list
get a per-class subclass whose `__call__` records its output (and, for layer id -1, the input to
layer 0, i.e. the embedding output). The module tree, parameter names and `isinstance` checks are
unchanged, so loading, quantizing and the KV cache keep working, and the features come from the
verify forward the decode loop already runs: no extra target pass.

Each tapped layer keeps only the latest forward's output (bounded memory, like the upstream MLX
reference); the drafter takes it right after each forward, through `Drafter.after_forward`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from dspark_flow.errors import ConfigError

EMBEDDING_TAP = -1  # DeepSpec's id for the embedding output (HF hidden_states[0])
_ATTR = "_dspark_flow_tap"
_TAPS_ATTR = "_dspark_flow_taps"
_TAPPED_CLASSES: dict[type, type] = {}


def find_layers(model: nn.Module) -> list[Any]:
    """The target's list of decoder layers, found generically (the longest `layers`/`h`/`blocks`
    list of modules: `model.model.layers` for llama/qwen/gemma, `language_model...` for VLMs)."""
    counts: dict[str, int] = defaultdict(int)
    for path, _module in model.named_modules():
        parent, _, last = path.rpartition(".")
        if last.isdigit() and parent.rpartition(".")[2] in ("layers", "h", "blocks"):
            counts[parent] += 1
    if not counts:
        raise ConfigError(
            f"cannot find the decoder layers of {type(model).__name__}: "
            "no `layers` list of modules in it, so target features cannot be tapped"
        )
    path = max(counts, key=lambda p: (counts[p], -p.count(".")))
    node: Any = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


class _TapPoint:
    """What one tapped layer records, and where (not an mx type, so mlx keeps it off the tree)."""

    def __init__(self, taps: FeatureTaps):
        self.taps = taps
        self.output_id: int | None = None
        self.record_input = False


def _tapped_class(cls: type) -> type:
    """A subclass of `cls` whose call records to the instance's tap point (one per class)."""
    if cls in _TAPPED_CLASSES:
        return _TAPPED_CLASSES[cls]

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        point: _TapPoint | None = self.__dict__.get(_ATTR)
        if point is not None and point.record_input:
            point.taps.latest[EMBEDDING_TAP] = args[0] if args else next(iter(kwargs.values()))
        out = cls.__call__(self, *args, **kwargs)
        if point is not None and point.output_id is not None:
            point.taps.latest[point.output_id] = out[0] if isinstance(out, tuple) else out
        return out

    tapped = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__, "_dsf_base": cls})
    _TAPPED_CLASSES[cls] = tapped
    return tapped


class FeatureTaps:
    """The taps installed on one target; `latest[layer_id]` is that layer's last output."""

    def __init__(self, model: nn.Module):
        self.layers = find_layers(model)
        self.layer_ids: set[int] = set()
        self.latest: dict[int, mx.array] = {}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def add(self, layer_ids: list[int]) -> None:
        n = self.num_layers
        for lid in layer_ids:
            if lid != EMBEDDING_TAP and not 0 <= lid < n:
                raise ConfigError(
                    f"target layer id {lid} is out of range: the target has {n} layers "
                    f"(valid ids: -1 for the embedding output, 0..{n - 1})"
                )
        for lid in sorted(set(layer_ids) - self.layer_ids):
            layer = self.layers[0 if lid == EMBEDDING_TAP else lid]
            if type(layer).__dict__.get("_dsf_base") is None:
                layer.__class__ = _tapped_class(type(layer))
            point = layer.__dict__.get(_ATTR)
            if point is None:
                point = _TapPoint(self)
                object.__setattr__(layer, _ATTR, point)
            if lid == EMBEDDING_TAP:
                point.record_input = True
            else:
                point.output_id = lid
            self.layer_ids.add(lid)

    def take(self, layer_ids: list[int]) -> mx.array | None:
        """Features of the last forward: the tapped states concatenated along the hidden axis,
        shape (1, tokens, len(layer_ids) * hidden); None if no forward ran since the last take."""
        if any(lid not in self.latest for lid in layer_ids):
            return None
        feats = [self.latest[lid] for lid in layer_ids]
        self.latest.clear()  # a later take without a forward in between must not reuse them
        return mx.concatenate(feats, axis=-1) if len(feats) > 1 else feats[0]


def install_taps(model: nn.Module, layer_ids: list[int]) -> FeatureTaps:
    """Tap `layer_ids` of `model` (idempotent; one `FeatureTaps` per model, ids accumulate)."""
    taps: FeatureTaps | None = model.__dict__.get(_TAPS_ATTR)
    if taps is None:
        taps = FeatureTaps(model)
        object.__setattr__(model, _TAPS_ATTR, taps)
    taps.add(layer_ids)
    return taps


def target_hidden_size(model: nn.Module) -> int:
    """Width of the target's residual stream (what each tap records)."""
    args = getattr(model, "args", None)
    for holder in (args, getattr(args, "text_config", None)):
        size = getattr(holder, "hidden_size", None)
        if isinstance(holder, dict):
            size = holder.get("hidden_size")
        if isinstance(size, int):
            return size
    emb = target_embedding(model)
    if isinstance(emb, nn.QuantizedEmbedding):  # packed uint32 columns
        return int(emb.weight.shape[1]) * 32 // emb.bits
    return int(emb.weight.shape[1])


def target_embedding(model: nn.Module) -> nn.Module:
    """The target's input embedding (`embed_tokens`, wherever it lives)."""
    for path, module in model.named_modules():
        if path.rpartition(".")[2] in ("embed_tokens", "wte", "tok_embeddings") and hasattr(
            module, "as_linear"
        ):
            return module
    raise ConfigError(f"cannot find the input embedding of {type(model).__name__}")


def target_lm_head(model: nn.Module) -> Any:
    """A callable hidden -> logits: the target's `lm_head`, else its tied embedding."""
    head = _own_lm_head(model)
    return head if head is not None else target_embedding(model).as_linear


def target_head_module(model: nn.Module) -> nn.Module:
    """The module holding the target's output rows: its `lm_head`, else its tied embedding."""
    head = _own_lm_head(model)
    return head if head is not None else target_embedding(model)


def _own_lm_head(model: nn.Module) -> Any:
    for holder in (model, getattr(model, "language_model", None)):
        head = getattr(holder, "lm_head", None) if holder is not None else None
        if head is not None:
            return head
    return None


def target_vocab_size(model: nn.Module) -> int:
    return int(target_embedding(model).weight.shape[0])
