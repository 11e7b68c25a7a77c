"""Quantization scales in the dtype of the activations that meet them.

`mx.quantized_matmul` computes in the promoted type of the activations and the scales, and
casts the scales and biases to it on every call (mlx/ops.cpp): two copy kernels per matmul.
A GGUF model converted natively has float16 scales but float32 norms, so on a GPU every one of
the embedded target's ~210 matmuls per forward pays those copies. Casting the scales once,
where the cast widens them (float16 -> float32), gives bitwise the same results without them.
The tied output head keeps its scales: the same tensor serves the embedding lookup, whose
output dtype is the scales' own. Only affine layers with floating scales change (the mx/nv fp
modes keep their uint8 scales), and only where the one-token forward saw wider activations; a
layer later fed another dtype would compute in the wider one. Cost: float32 scales and biases
make 4-bit group-32 weights ~20% larger in memory (0.75 instead of 0.625 bytes per weight).
"""

from __future__ import annotations

from typing import Any

from dspark_flow.log import get_logger

log = get_logger()


def _recording_class(cls: type, seen: dict[int, Any]) -> type:
    def __call__(self: Any, x: Any) -> Any:
        seen[id(self)] = x.dtype
        return super(recording, self).__call__(x)  # type: ignore[arg-type]  # a class, made below

    recording = type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__})
    return recording


def activation_dtypes(model: Any) -> dict[int, Any]:
    """The dtype of the input each QuantizedLinear of `model` sees in a one-token forward,
    by id of the layer (layers the forward does not call are absent)."""
    import mlx.core as mx
    import mlx.nn as nn

    layers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    seen: dict[int, Any] = {}
    classes: dict[type, type] = {}
    originals = [(m, type(m)) for m in layers]
    try:
        for m, cls in originals:
            m.__class__ = classes.setdefault(cls, _recording_class(cls, seen))
        mx.eval(model(mx.array([[1]], dtype=mx.uint32)))
    finally:
        for m, cls in originals:
            m.__class__ = cls
    return seen


def widen_scales_to_activations(model: Any) -> int:
    """Cast each QuantizedLinear's scales and biases to the dtype of its activations where the
    matmul would promote them to it anyway; returns how many layers changed. A model whose
    forward cannot run on one token id is left as it is."""
    import mlx.core as mx
    import mlx.nn as nn

    try:
        seen = activation_dtypes(model)
    except Exception as e:  # not a plain causal LM (multimodal inputs, ...): keep it as it is
        log.debug("scales left as loaded", reason=f"{type(e).__name__}: {e}")
        return 0
    changed = 0
    for _, m in model.named_modules():
        x_dtype = seen.get(id(m)) if isinstance(m, nn.QuantizedLinear) else None
        if x_dtype is None or m.scales.dtype == x_dtype:
            continue
        if getattr(m, "mode", "affine") != "affine" or not mx.issubdtype(
            m.scales.dtype, mx.floating
        ):
            continue  # fp modes: uint8 scales, which the matmul takes as they are
        if mx.result_type(x_dtype, m.scales.dtype) != x_dtype:
            continue  # the matmul computes in the scales' wider type: nothing to save
        m.scales = m.scales.astype(x_dtype)
        if m.get("biases") is not None:
            m.biases = m.biases.astype(x_dtype)
        changed += 1
    if changed:
        mx.eval(model.parameters())
        log.debug("quantization scales widened to the activations' dtype", layers=changed)
    return changed
