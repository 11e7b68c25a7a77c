"""The backbone shared by the DSpark and DFlash drafters: a few Qwen3-style decoder layers
(q/k RMS norms, SwiGLU MLP) that draft a whole block in one parallel pass.

Keys and values come from two sources, as in the upstream code (DeepSpec
`deepspec/modeling/dspark/qwen3/modeling.py`, z-lab `dflash/model.py` and `dflash/model_mlx.py`):
the committed context, i.e. `hidden_norm(fc(concat of tapped target hidden states))` projected by
each layer's own k/v projections, and the block itself (the anchor token and mask tokens).
Queries come from the block only. Inside the block attention is bidirectional (unless a
z-lab config asks for causal); the context holds only positions before the anchor.

Context keys/values only ever hold committed rows, so nothing here is rolled back on rejection;
they are kept per layer (RoPE'd at their absolute positions) and extended as rows are committed.
DFlash 2 adds a two-tap grouped dynamic convolution before and after attention and the MLP.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from dspark_flow.models.attention import matmul_attention


@dataclass
class BackboneConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_taps: int  # fc maps num_taps * hidden_size -> hidden_size (drafter width = target width)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # None: causal inside the block iff the layer is sliding (z-lab's rule); DeepSpec: False.
    is_causal: bool | None = False
    conv_kernel_size: int = 0  # DFlash 2 only (0: no convolutions)
    conv_group_size: int = 0

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_type(i) == "sliding_attention" else None

    def causal(self, i: int) -> bool:
        if self.is_causal is None:
            return self.layer_type(i) == "sliding_attention"
        return self.is_causal


class ContextKV:
    """Per-layer keys/values of the committed context, at absolute positions [end - len, end)."""

    def __init__(self, num_layers: int):
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.end = 0  # absolute position after the last committed row held

    def held(self, i: int) -> int:
        k = self.keys[i]
        return 0 if k is None else int(k.shape[2])


class DraftAttention(nn.Module):
    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.scale = d**-0.5
        # Plain attribute (not a parameter): `DrafterBackbone.use_matmul_attention` sets it.
        object.__setattr__(self, "matmul_attention", False)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)

    def keys_values(
        self, x: mx.array, offset: int | mx.array, rope: Any
    ) -> tuple[mx.array, mx.array]:
        """k/v heads of rows `x` (batch, S, hidden) sitting at positions offset.., RoPE applied."""
        b, n = x.shape[:2]
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def __call__(
        self,
        x: mx.array,
        ctx_k: mx.array | None,
        ctx_v: mx.array | None,
        pos: int,
        rope: Any,
        mask: mx.array | None,
    ) -> mx.array:
        q, k, v = self.project(x, pos, rope)
        return self.output(self.attend(q, k, v, ctx_k, ctx_v, mask))

    def project(self, x: mx.array, pos: int | mx.array, rope: Any) -> tuple[mx.array, ...]:
        """The query, key and value heads of rows `x` (batch, n, hidden) at positions pos..,
        RoPE'd by `rope(heads, offset=pos)` (training passes one that places each row)."""
        b, n = x.shape[:2]
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=pos)
        k, v = self.keys_values(x, pos, rope)
        return q, k, v

    def output(self, out: mx.array) -> mx.array:
        """Heads merged back into rows, then the output projection."""
        b, n = out.shape[0], out.shape[2]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

    def attend(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        ctx_k: mx.array | None,
        ctx_v: mx.array | None,
        mask: mx.array | None,
    ) -> mx.array:
        """The block's queries over [context keys, block keys] (heads first)."""
        if ctx_k is not None:
            assert ctx_v is not None, "keys and values come in pairs"
            k = mx.concatenate([ctx_k, k], axis=2)
            v = mx.concatenate([ctx_v, v], axis=2)
        if self.matmul_attention:
            return matmul_attention(q, k, v, self.scale, mask)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def grouped_dynamic_conv(
    x: mx.array, dynamic: mx.array, base: mx.array, group_size: int
) -> mx.array:
    """Causal conv over the block rows: out_t = sum_j (base[j] + dyn_t[j]) * x_{t-j}.

    `dynamic` (1, L, taps, groups) is shared by the `group_size` channels of each group; rows
    before the block start read zeros, so nothing crosses the block boundary."""
    n, h = x.shape[1], x.shape[2]
    out = mx.zeros_like(x)
    for j in range(base.shape[0]):
        if j >= n:
            break
        shifted = x if j == 0 else mx.concatenate([mx.zeros_like(x[:, :j]), x[:, : n - j]], axis=1)
        dyn = mx.repeat(dynamic[:, :, j, :], group_size, axis=-1).astype(x.dtype)
        out = out + base[j].reshape(1, 1, h).astype(x.dtype) * shifted + dyn * shifted
    return out


class GroupedDynamicConv(nn.Module):
    """DFlash 2's conv around one sublayer: one projection of the sublayer *input* gives the
    dynamic kernels for both the input side (`prepare`) and the output side (`finish`)."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.base_kernel = mx.zeros((2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group_size), bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        dyn = self.kernel_projection(x).reshape(1, x.shape[1], 2, self.taps, -1)
        conv = grouped_dynamic_conv(x, dyn[:, :, 0], self.base_kernel[0], self.group_size)
        return conv, dyn[:, :, 1]

    def finish(self, y: mx.array, dyn: mx.array) -> mx.array:
        return grouped_dynamic_conv(y, dyn, self.base_kernel[1], self.group_size)


class DraftLayer(nn.Module):
    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.conv_kernel_size:
            k, g = cfg.conv_kernel_size, cfg.conv_group_size
            self.attention_conv = GroupedDynamicConv(cfg.hidden_size, k, g)
            self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, k, g)

    def __call__(self, x: mx.array, attend: Any) -> mx.array:
        conv = "attention_conv" in self
        h = self.input_layernorm(x)
        if conv:
            h, dyn = self.attention_conv.prepare(h)
        h = attend(self.self_attn, h)
        x = x + (self.attention_conv.finish(h, dyn) if conv else h)
        h = self.post_attention_layernorm(x)
        if conv:
            h, dyn = self.mlp_conv.prepare(h)
        h = self.mlp(h)
        return x + (self.mlp_conv.finish(h, dyn) if conv else h)


# -- compiled layers ---------------------------------------------------------------------------
# A drafting round builds ~25 MLX operations per layer in Python; on a GPU that host time is most
# of the drafter's cost (~1.3-1.9 ms a round on the H200 for the 5-layer DSpark drafter, against
# a 4-9 ms round). `DrafterBackbone.compile_layers()` runs each plain layer's parts around the
# attention through `mx.compile` (the same operations in the same order, so the same values);
# the context concatenation and the attention call stay in Python, their key counts change
# every round.


def _layer_pre(layer: DraftLayer, rope: Any, x: mx.array, pos: mx.array) -> tuple[mx.array, ...]:
    """A plain layer up to its attention (DraftLayer.__call__'s steps)."""
    return layer.self_attn.project(layer.input_layernorm(x), pos, rope)


def _layer_post(layer: DraftLayer, x: mx.array, out: mx.array) -> mx.array:
    """A plain layer from its attention's output (DraftLayer.__call__'s steps)."""
    x = x + layer.self_attn.output(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _block_mask(
    n_ctx: int, ctx_end: int, n: int, pos: int, window: int | None, causal: bool
) -> mx.array | None:
    """Which keys ([context rows, block rows]) each block query sees; None means all.

    A window applies to every key, block keys included (z-lab's torch `_attention_mask`; only
    matters when the block is longer than the window)."""
    if window is None and not causal:
        return None
    q = pos + mx.arange(n)[:, None]
    ctx_pos = ctx_end - n_ctx + mx.arange(n_ctx)[None]
    blk_pos = pos + mx.arange(n)[None]
    ctx_ok = mx.ones((n, n_ctx), dtype=mx.bool_)
    blk_ok = (blk_pos <= q) if causal else mx.ones((n, n), dtype=mx.bool_)
    if window is not None:
        ctx_ok = q - ctx_pos < window
        blk_ok = blk_ok & (mx.abs(q - blk_pos) < window)
    return mx.concatenate([ctx_ok, blk_ok], axis=1)


class DrafterBackbone(nn.Module):
    """fc + hidden_norm over the tapped features, the draft layers, the final norm."""

    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DraftLayer(cfg) for _ in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        from mlx_lm.models.rope_utils import initialize_rope

        rope = initialize_rope(
            cfg.head_dim,
            cfg.rope_theta,
            False,
            cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )
        # Plain attributes: neither the config nor RoPE's tables are checkpoint parameters.
        object.__setattr__(self, "cfg", cfg)
        object.__setattr__(self, "_rope", rope)
        # layer index -> compiled (pre, post, context keys/values); empty: the plain path
        object.__setattr__(self, "_compiled", {})
        object.__setattr__(self, "_compiled_context_rows", 0)

    def compile_layers(self, max_context_rows: int = 16) -> int:
        """Take the compiled path (see `_layer_pre`) for every layer without DFlash 2's
        convolutions, where RoPE is the plain kind (whose offset may be an array); context
        extensions of at most `max_context_rows` rows too (a prompt's rows stay plain: one trace
        per prompt length would cost more than it saves). Returns how many layers compiled.
        Inference only: the traces hold the weights as they are now; after changing them in
        place (training), call it again (or build the drafter anew)."""
        compiled: dict[int, tuple[Any, Any, Any]] = {}
        rope = self._rope  # not `self`: the traces would keep the model alive in a cycle
        if type(rope) is nn.RoPE:
            for i, layer in enumerate(self.layers):
                if "attention_conv" in layer:
                    continue
                compiled[i] = (
                    mx.compile(functools.partial(_layer_pre, layer, rope)),
                    mx.compile(functools.partial(_layer_post, layer)),
                    mx.compile(functools.partial(layer.self_attn.keys_values, rope=rope)),
                )
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "_compiled_context_rows", max_context_rows)
        return len(compiled)

    def use_matmul_attention(self, on: bool = True) -> None:
        """Every layer's attention through `matmul_attention` instead of MLX's fused kernel."""
        for layer in self.layers:
            object.__setattr__(layer.self_attn, "matmul_attention", on)

    def compute_dtype(self) -> mx.Dtype:
        norm: mx.array = self.norm.weight
        return norm.dtype

    def extend_context(self, state: ContextKV, feats: mx.array) -> None:
        """Append committed rows `feats` (1, S, num_taps * hidden) at positions state.end.."""
        h = self.hidden_norm(self.fc(feats.astype(self.compute_dtype())))
        compiled = self._compiled if h.shape[1] <= self._compiled_context_rows else {}
        end = mx.array(state.end, dtype=mx.int32) if compiled else state.end
        for i, layer in enumerate(self.layers):
            fns = compiled.get(i)
            if fns is not None:
                k, v = fns[2](h, end)
            else:
                k, v = layer.self_attn.keys_values(h, state.end, self._rope)
            ctx_k, ctx_v = state.keys[i], state.values[i]
            if ctx_k is not None:
                assert ctx_v is not None, "keys and values come in pairs"
                k = mx.concatenate([ctx_k, k], axis=2)
                v = mx.concatenate([ctx_v, v], axis=2)
            window = self.cfg.window(i)
            if window is not None and k.shape[2] > window - 1:
                # The anchor (the first query) sees the last window-1 rows; older ones never again.
                k, v = k[:, :, -(window - 1) :], v[:, :, -(window - 1) :]
            state.keys[i], state.values[i] = k, v
        state.end += feats.shape[1]

    def __call__(self, state: ContextKV, x: mx.array) -> mx.array:
        """Normalised hidden states of the block `x` (1, B, hidden), the anchor at state.end."""
        pos, n = state.end, x.shape[1]
        pos_array = mx.array(pos, dtype=mx.int32) if self._compiled else None
        for i, layer in enumerate(self.layers):
            mask = _block_mask(
                state.held(i), state.end, n, pos, self.cfg.window(i), self.cfg.causal(i)
            )
            fns = self._compiled.get(i)
            if fns is not None:
                q, k, v = fns[0](x, pos_array)
                out = layer.self_attn.attend(q, k, v, state.keys[i], state.values[i], mask)
                x = fns[1](x, out)
                continue

            def attend(attn: DraftAttention, h: mx.array, i: int = i, mask: Any = mask) -> mx.array:
                return attn(h, state.keys[i], state.values[i], pos, self._rope, mask)

            x = layer(x, attend)
        return self.norm(x)
