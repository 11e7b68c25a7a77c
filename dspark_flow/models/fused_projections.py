"""Fused projections: each attention's q/k/v as one quantized matmul, each MLP's gate/up as one.

Why: a verify-sized forward of a small target on a GPU is bound by the number of operations,
not by arithmetic (docs/benchmarks.md §4: a one-token forward of the embedded target costs
~4.8 ms on the H200, a few hundred kernels of microseconds each). Stacking the weights of
projections that read the same input turns seven matmuls a layer into four. Each output column
of a quantized matmul is computed from its own weight row alone, so the fused outputs are the
separate ones, concatenated: bit for bit on this repo's CPU (tests/test_fused_projections.py),
the same tokens in every H200 A/B (a GPU kernel that picks its tiling by the output width could
round otherwise; the kernels verifier probes each stack's own shape for its invariant routes).
Only quantized layers are stacked (see `_stackable`).

The fused modules live beside the model, not in its module tree: parameter names, the
calibration key's fingerprint and every path that does not ask for them (mlx-lm's own
generation, long prefills, a drafter) stay as they were. The compiled layers
(`compiled_layers.py`) call them on the verify path. To keep memory flat, the separate
projections' arrays become views of the fused ones (same values, no copy).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from dspark_flow.models.taps import find_layers

# MLP classes whose forward is down_proj(swiglu(gate_proj(x), up_proj(x))), with `swiglu` from
# the class's own module: the fused forward reproduces exactly that.
SWIGLU_MLPS = {
    ("mlx_lm.models.llama", "MLP"),
    ("mlx_lm.models.qwen2", "MLP"),
    ("mlx_lm.models.qwen3", "MLP"),
}
_ARRAYS = ("weight", "scales", "biases", "bias")
# Stacks by id(model), with a weak reference to tell a model from a later one at the same id.
_INSTALLED: dict[int, tuple[weakref.ref[nn.Module], FusedProjections]] = {}


@dataclass(frozen=True)
class Fused:
    module: nn.Module  # the stacked projection
    splits: tuple[int, ...]  # output columns where each part after the first begins


@dataclass(frozen=True)
class _Entry:
    owner: nn.Module  # the attention or MLP
    names: tuple[str, ...]  # its projections' attribute names
    parts: list[nn.Module]  # those projections, when stacked
    views: list[mx.array]  # the weight view each part was given (replaced: stack afresh)
    fused: Fused


def _own_class(module: nn.Module) -> type:
    """The module's class before a verifier compiled it (a user's subclass stays itself)."""
    from dspark_flow.models.compiled_layers import base_class  # it imports this module

    return base_class(type(module))


def _stackable(parts: list[nn.Module]) -> bool:
    """Affine-quantized layers of the same bits, group size and input width, all or none
    biased. Dense layers stay apart: a dense matmul may block its sums by the output width
    (on this repo's CPU a stacked float32 matmul differed from the separate ones in the last
    bit at 12 rows), so stacking them would not be the same arithmetic."""
    first = parts[0]
    same = ("bits", "group_size", "mode")
    if not all(
        isinstance(p, nn.QuantizedLinear)
        and getattr(p, "mode", "affine") == "affine"
        and all(getattr(p, a, None) == getattr(first, a, None) for a in same)
        for p in parts
    ):
        return False
    keys = [tuple(k for k in _ARRAYS if k in p) for p in parts]
    dtypes = {tuple(p[k].dtype for k in keys[0] if k in p) for p in parts}  # no promotion
    if len(dtypes) != 1:
        return False
    widths = {p["weight"].shape[1] for p in parts}
    return len(set(keys)) == 1 and len(widths) == 1 and all(p["weight"].ndim == 2 for p in parts)


def stack_linears(parts: list[nn.Module]) -> Fused | None:
    """One linear layer computing `parts` side by side (None where they cannot be stacked);
    afterwards each part's arrays are views of the stacked ones."""
    if not _stackable(parts):
        return None
    first = parts[0]
    fused = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
    nn.Module.__init__(fused)
    fused.group_size, fused.bits = first.group_size, first.bits
    fused.mode = getattr(first, "mode", "affine")
    keys = [k for k in _ARRAYS if k in first]
    for key in keys:
        fused[key] = mx.concatenate([p[key] for p in parts], axis=0)
    fused.freeze()
    mx.eval(fused.parameters())
    splits, start = [], 0
    for i, part in enumerate(parts):
        rows = part["weight"].shape[0]
        if i:
            splits.append(start)
        for key in keys:
            part[key] = fused[key][start : start + rows]
        start += rows
    mx.eval([p.parameters() for p in parts])
    return Fused(fused, tuple(splits))


def mlp_fusable(mlp: nn.Module) -> bool:
    base = _own_class(mlp)
    return (
        (base.__module__, base.__name__) in SWIGLU_MLPS
        and hasattr(sys.modules[base.__module__], "swiglu")
        and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
    )


def swiglu_of(mlp: nn.Module) -> Callable[[mx.array, mx.array], mx.array]:
    """The `swiglu` the MLP's own module calls (mlx-lm's compiled function)."""
    return sys.modules[_own_class(mlp).__module__].swiglu


class FusedProjections:
    """The stacked q/k/v and gate/up projections of one target's decoder layers."""

    def __init__(self) -> None:
        self._by_module: dict[int, Fused] = {}  # by id of the attention or MLP module
        self._entries: list[_Entry] = []  # one per stack, in layer order

    @classmethod
    def install(cls, model: nn.Module) -> FusedProjections:
        """Stack the projections of every decoder layer whose attention the compiled layers
        run (`attention_supported`: only that path calls the stack) and whose MLP is a known
        swiglu MLP; layers of other shapes are left alone. A model stacked before (pipelines
        sharing a target) gets the same stacks back, unless a part's weights were replaced
        since (loaded again, merged): then it is stacked afresh."""
        from dspark_flow.models.compiled_layers import attention_supported  # it imports us

        known = _INSTALLED.get(id(model))
        if known is not None and known[0]() is model and known[1]._current():
            return known[1]
        stacks = cls()
        for layer in find_layers(model):
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is not None and attention_supported(attn):
                stacks._add(attn, ("q_proj", "k_proj", "v_proj"))
            if mlp is not None and mlp_fusable(mlp):
                stacks._add(mlp, ("gate_proj", "up_proj"))
        _INSTALLED[id(model)] = (weakref.ref(model), stacks)
        weakref.finalize(model, _INSTALLED.pop, id(model), None)  # the stacks go with the model
        return stacks

    def _current(self) -> bool:
        """Every owner still holds its parts, and every part the view of its stack that
        `stack_linears` gave it."""
        return all(
            getattr(e.owner, name) is part and part["weight"] is view
            for e in self._entries
            for name, part, view in zip(e.names, e.parts, e.views, strict=True)
        )

    def _add(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        parts = [getattr(owner, n) for n in names]
        fused = stack_linears(parts)
        if fused is not None:
            self._by_module[id(owner)] = fused
            self._entries.append(_Entry(owner, names, parts, [p["weight"] for p in parts], fused))

    def of(self, owner: nn.Module) -> Fused | None:
        """The stacked projection of an attention or MLP module, if it has one."""
        return self._by_module.get(id(owner))

    @property
    def stacks(self) -> list[tuple[nn.Module, list[nn.Module]]]:
        """(stacked projection, the projections it computes): a verifier routing matmuls routes
        the stacks, and learns a stack's input from its parts (the stock forward calls only
        the parts)."""
        return [(e.fused.module, e.parts) for e in self._entries]

    def __len__(self) -> int:
        return len(self._by_module)
