"""Attention routed around MLX's fused kernel where it plans every new key length.

On CUDA, `mx.fast.scaled_dot_product_attention` in float16/bfloat16 for several queries goes
to cuDNN, which plans each key length it has not seen (on an H200: a bf16 verify's attention
37-75 ms a call, a drafter's pass 41-64 ms, 2-3 ms once seen; docs/kernels.md, benchmarks §6),
and both a drafter's keys and a verify's keys grow every round. `matmul_attention` computes
the same attention as two matmuls and a softmax, which plan nothing.

The target's attention lives in mlx-lm's model modules, which call their module-level
`scaled_dot_product_attention`. `wrap_attention` replaces that function, once per module, with
one that asks the hook a verifier set for its forward (`attention_hook`); without a hook, or
when the hook declines (returns None), mlx-lm's own function runs.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from dspark_flow.models.backend import backend_name

# The option `attention` of the drafters and of the `reference` verifier
AttentionChoice = Literal["auto", "fused", "matmul"]
# (queries, keys, values, cache, scale, mask, sinks) -> the attention, or None: mlx-lm's own
AttentionHook = Callable[..., "mx.array | None"]

_HOOK: contextvars.ContextVar[AttentionHook | None] = contextvars.ContextVar(
    "dspark_flow_attention_hook", default=None
)
# The function mlx-lm's model modules call for attention (what the wrapper replaces)
ATTENTION_FN = "scaled_dot_product_attention"
# Model modules whose function we wrapped: module name -> (the original function, the owners
# relying on the wrapper); the last owner to unwrap puts the original back.
_WRAPPED: dict[str, tuple[Callable[..., Any], set[int]]] = {}

# Bounds on what `matmul_verify_attention` takes: it materialises the scores (float32, per
# query head) and casts the keys and values to float32 every call, so long prefills and long
# contexts keep the fused kernel.
MATMUL_MAX_SCORES = 1 << 20  # rows x keys
MATMUL_MAX_KEYS = 16384


def matmul_chosen(choice: AttentionChoice) -> bool:
    """Whether option `attention` takes the matmul route on this backend: `matmul` anywhere,
    `auto` on CUDA only (where MLX's fused attention plans each new key length)."""
    return choice == "matmul" or (choice == "auto" and backend_name() == "cuda")


def matmul_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`'s arithmetic for heads-first q (1, H, n, d) and
    k/v (1, H_kv, S, d), query head h reading key head h // (H / H_kv); `mask` is boolean
    (True: attend) or additive, broadcastable to (n, S)."""
    b, heads, n, d = q.shape
    kv_heads = k.shape[1]
    rep = heads // kv_heads
    q = (q * mx.array(scale, q.dtype)).reshape(b, kv_heads, rep * n, d)
    scores = (q @ k.swapaxes(-1, -2)).reshape(b, kv_heads, rep, n, -1)
    if mask is not None and mask.dtype == mx.bool_:
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    elif mask is not None:  # additive
        scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True).reshape(b, kv_heads, rep * n, -1)
    return (weights @ v).reshape(b, heads, n, d)


def causal_mask(rows: int, keys: int) -> mx.array:
    """MLX's "causal" for `rows` queries that are the last `rows` of `keys` positions."""
    return mx.arange(keys)[None] <= mx.arange(keys - rows, keys)[:, None]


# The dtypes MLX's CUDA backend hands to cuDNN's attention, which plans every new key length;
# float32 takes MLX's own kernel, which showed no such cost in decoding (benchmarks §4, 2026-12-02).
HALF_PRECISION = (mx.float16, mx.bfloat16)


def matmul_verify_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any,
    *,
    dtypes: tuple[mx.Dtype, ...] | None = None,
) -> mx.array | None:
    """A hook (`attention_hook`) taking the target's attention for 2 or more queries, causal
    or unmasked, through `matmul_attention` in float32 (the fused kernel's accumulation
    precision); anything else - one query (no per-length plan there), quantized caches, sinks,
    explicit masks, past `MATMUL_MAX_SCORES` or `MATMUL_MAX_KEYS`, a dtype not in `dtypes`
    (None: any) - declines to mlx-lm's own."""
    if sinks is not None or hasattr(cache, "bits") or q.shape[0] != 1:
        return None  # (a quantized cache hands over keys as tuples)
    rows, keys = q.shape[2], k.shape[2]
    if rows < 2 or keys < rows or keys > MATMUL_MAX_KEYS or rows * keys > MATMUL_MAX_SCORES:
        return None
    if dtypes is not None and q.dtype not in dtypes:
        return None
    if mask is None:
        bool_mask = None
    elif isinstance(mask, str) and mask == "causal":
        bool_mask = causal_mask(rows, keys)
    else:
        return None
    f32 = mx.float32
    out = matmul_attention(q.astype(f32), k.astype(f32), v.astype(f32), scale, bool_mask)
    return out.astype(q.dtype)


@contextmanager
def attention_hook(hook: AttentionHook | None) -> Iterator[None]:
    """Route the wrapped modules' attention through `hook` while the block builds its graph
    (evaluation later needs no hook)."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


def _hooked(original: Callable[..., Any]) -> Callable[..., Any]:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        hook = _HOOK.get()
        if hook is not None:
            out = hook(queries, keys, values, cache, scale, mask, sinks)
            if out is not None:
                return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.dspark_flow_original = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def attention_modules(model: nn.Module) -> list[str]:
    """The Python modules of the model's classes that call mlx-lm's attention function."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    return sorted(n for n in names if callable(getattr(sys.modules.get(n), ATTENTION_FN, None)))


def wrap_attention(model: nn.Module, owner: int) -> list[str]:
    """Wrap the attention function of every module `model`'s classes come from, on behalf of
    `owner` (e.g. id(verifier)); returns the module names."""
    names = attention_modules(model)
    for name in names:
        module = sys.modules[name]
        if name not in _WRAPPED:
            original = getattr(module, ATTENTION_FN)
            _WRAPPED[name] = (original, set())
            setattr(module, ATTENTION_FN, _hooked(original))
        _WRAPPED[name][1].add(owner)
    return names


def unwrap_attention(owner: int) -> None:
    """Drop `owner`'s claim on every wrapper; a wrapper nobody claims gives way to the original."""
    for name in [n for n, (_, owners) in _WRAPPED.items() if owner in owners]:
        original, owners = _WRAPPED[name]
        owners.discard(owner)
        if not owners:
            setattr(sys.modules[name], ATTENTION_FN, original)
            del _WRAPPED[name]
