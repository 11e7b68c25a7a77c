"""Compiled verify layers: fewer host-side operations per small forward.

Why: for a small target on a GPU, building a forward's graph in Python (~900 MLX operations for
the embedded model, 3-4 ms on this repo's CPU host) is a large part of a one-token forward
(docs/benchmarks.md §4, "Host time per forward"). `mx.compile` traces a function once per input
shape and afterwards replays the trace in C++. Here each decoder layer's MLP (its own `__call__`,
any architecture) and the stateless parts of its attention (projections, head split, rotary
embedding; then head merge and output projection: the llama family's layout) are compiled, per
module, for forwards of at most `max_rows` tokens. The KV-cache update and the attention call
stay in Python: their shapes change every step, and the kernels verifier's attention wrapper
must still see them.

The layers are rerouted by swapping the attention's and the MLP's classes to subclasses (the
module tree, parameter names and `isinstance` checks stay as they were, and feature taps on the
decoder layers keep working). The compiled path is taken only inside `CompiledLayers.scope()`,
which a verifier enters around its own forward; anything else running the same model (mlx-lm's
own generation, a drafter, a prefill longer than `max_rows`) gets the stock path. A trace bakes
in what the layers did when it was made (the kernels verifier's routes included), so the
kernels verifier compiles only after its routes are settled, and a new warm-up restores the
layers and compiles afresh.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from dspark_flow.models.attention import ATTENTION_FN
from dspark_flow.models.fused_projections import Fused, FusedProjections, swiglu_of
from dspark_flow.models.taps import find_layers

_ACTIVE: contextvars.ContextVar[CompiledLayers | None] = contextvars.ContextVar(
    "dspark_flow_compiled_layers", default=None
)
_BASE = "_dsf_compiled_base"  # class attribute: the class a compiled subclass was made from
_CLASSES: dict[type, type] = {}
COMPILE_LAYERS_HELP = (
    "compile each decoder layer's MLP and the stateless parts of its attention (mx.compile) "
    "for forwards of up to 16 tokens: fewer host-side operations per verify forward, the same "
    "values (dspark_flow/models/compiled_layers.py)"
)


def compiled_scope(compiled: CompiledLayers | None) -> contextlib.AbstractContextManager[None]:
    """`compiled.scope()`, or nothing where a verifier compiled no layers."""
    return compiled.scope() if compiled is not None else contextlib.nullcontext()


def attention_supported(attn: nn.Module) -> bool:
    """The llama-family attention: q/k/v/o projections, head counts, a plain rotary embedding
    (what `_attention_pre` reproduces), and a model module exposing the attention function."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads", "scale", "rope")
    if not all(hasattr(attn, n) for n in names) or type(attn.rope) is not nn.RoPE:
        return False
    if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):  # qwen3-style: not reproduced here
        return False
    return callable(getattr(sys.modules.get(base_class(type(attn)).__module__), ATTENTION_FN, None))


def _mlp_supported(mlp: nn.Module) -> bool:
    # Compiled as it is: its own __call__ must be a pure function of its input.
    return all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))


def base_class(cls: type) -> type:
    """The class a compiled subclass was made from (the class itself otherwise)."""
    return cls.__dict__.get(_BASE, cls)


def _attention_pre(
    attn: Any, x: mx.array, offset: mx.array, qkv: Fused | None = None
) -> tuple[mx.array, ...]:
    """The llama attention up to the cache update (mlx-lm's order of operations); with `qkv`,
    the three projections as one stacked matmul."""
    batch, rows, _ = x.shape
    if qkv is not None:
        q, k, v = mx.split(qkv.module(x), list(qkv.splits), axis=-1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = q.reshape(batch, rows, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = k.reshape(batch, rows, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = v.reshape(batch, rows, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v


def _attention_post(attn: Any, out: mx.array) -> mx.array:
    batch, _, rows, _ = out.shape
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, rows, -1))


def _fused_mlp(mlp: Any, x: mx.array, gate_up: Fused) -> mx.array:
    """A swiglu MLP's forward with gate and up as one stacked matmul."""
    gate, up = mx.split(gate_up.module(x), list(gate_up.splits), axis=-1)
    return mlp.down_proj(swiglu_of(mlp)(gate, up))


def _compiled_attention_call(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> Any:
    scope = _ACTIVE.get()
    base = base_class(type(self))
    if scope is None or x.ndim != 3 or x.shape[1] > scope.max_rows or not hasattr(cache, "offset"):
        return base.__call__(self, x, mask, cache)  # no cache (or one without an offset): stock
    pre, post = scope.attention_fns(self)
    queries, keys, values = pre(x, mx.array(cache.offset, dtype=mx.int32))
    keys, values = cache.update_and_fetch(keys, values)
    # Looked up per call: a verifier may have wrapped the module's function (models/attention.py).
    attend = getattr(sys.modules[base.__module__], ATTENTION_FN)
    out = attend(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
    return post(out)


def _compiled_mlp_call(self: Any, x: mx.array) -> Any:
    scope = _ACTIVE.get()
    base = base_class(type(self))
    if scope is None or x.ndim != 3 or x.shape[1] > scope.max_rows:
        return base.__call__(self, x)
    return scope.mlp_fn(self)(x)


def _compiled_class(cls: type, call: Callable[..., Any]) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Compiled{cls.__name__}", (cls,), {"__call__": call, _BASE: cls})
    return _CLASSES[cls]


class CompiledLayers:
    """The compiled attention and MLP of one target's decoder layers, for forwards of at most
    `max_rows` tokens. `install(model)` swaps the classes; `scope()` turns the compiled path on
    for the calls inside it; `restore()` puts the classes back."""

    def __init__(self, max_rows: int, fused: FusedProjections | None = None):
        self.max_rows = max_rows
        self.fused = fused  # stacked q/k/v and gate/up projections to call, where given
        self._fns: dict[tuple[int, str], Any] = {}
        self._swapped: list[tuple[nn.Module, type]] = []
        self.attention_layers = 0
        self.mlp_layers = 0

    def install(self, model: nn.Module) -> int:
        """Swap the classes of every supported attention and MLP (another verifier on the same
        model may have swapped them already); returns how many modules take the compiled path."""
        for layer in find_layers(model):
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is not None and attention_supported(attn):
                self._swap(attn, _compiled_attention_call)
                self.attention_layers += 1
            if mlp is not None and _mlp_supported(mlp):
                self._swap(mlp, _compiled_mlp_call)
                self.mlp_layers += 1
        return self.attention_layers + self.mlp_layers

    def _swap(self, module: nn.Module, call: Callable[..., Any]) -> None:
        if _BASE not in type(module).__dict__:
            self._swapped.append((module, type(module)))
            module.__class__ = _compiled_class(type(module), call)

    def restore(self) -> None:
        for module, cls in self._swapped:
            module.__class__ = cls
        self._swapped.clear()
        self.reset()
        self.attention_layers = self.mlp_layers = 0

    def reset(self) -> None:
        """Drop every trace: the next call in scope traces again."""
        self._fns.clear()

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def attention_fns(self, attn: nn.Module) -> tuple[Any, Any]:
        key = (id(attn), "attention")
        fns = self._fns.get(key)
        if fns is None:
            qkv = self.fused.of(attn) if self.fused is not None else None
            fns = self._fns[key] = (
                mx.compile(lambda x, offset: _attention_pre(attn, x, offset, qkv)),
                mx.compile(lambda out: _attention_post(attn, out)),
            )
        return fns

    def mlp_fn(self, mlp: nn.Module) -> Any:
        key = (id(mlp), "mlp")
        fn = self._fns.get(key)
        if fn is None:
            gate_up = self.fused.of(mlp) if self.fused is not None else None
            if gate_up is not None:
                fn = mx.compile(functools.partial(_fused_mlp, mlp, gate_up=gate_up))
            else:
                fn = mx.compile(functools.partial(base_class(type(mlp)).__call__, mlp))
            self._fns[key] = fn
        return fn
