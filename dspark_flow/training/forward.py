"""The drafter's training pass: every sampled block of a batch in one batched forward.

It reuses the inference modules (`DrafterBackbone`, its `DraftLayer`s and their projections), so
the weights trained are the weights loaded later; only attention differs in form: all blocks of
a sequence are concatenated into one query run with an explicit mask (blocks.py) instead of one
block at a time, and block rows get RoPE at per-row positions. tests/test_training.py checks this
pass against the inference drafter, block by block.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from dspark_flow.models.drafter_backbone import DraftAttention, DrafterBackbone


def rope_at(x: mx.array, positions: mx.array, base: float) -> mx.array:
    """Non-traditional RoPE (as mlx's nn.RoPE, traditional=False) at explicit positions.

    x: (B, H, Q, D); positions: (B, Q). nn.RoPE only takes one offset per call; blocks sit at
    different anchors."""
    d = x.shape[-1]
    inv_freq = mx.power(base, -mx.arange(0, d, 2, dtype=mx.float32) / d)
    angles = positions[:, None, :, None].astype(mx.float32) * inv_freq  # (B, 1, Q, D/2)
    cos, sin = mx.cos(angles), mx.sin(angles)
    x1, x2 = x[..., : d // 2].astype(mx.float32), x[..., d // 2 :].astype(mx.float32)
    out = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


def _attend(
    attn: DraftAttention,
    h: mx.array,
    ctx_k: mx.array,
    ctx_v: mx.array,
    positions: mx.array,
    mask: mx.array,
    base: float,
) -> mx.array:
    b, q_len, _ = h.shape
    q = attn.q_norm(attn.q_proj(h).reshape(b, q_len, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    k = attn.k_norm(attn.k_proj(h).reshape(b, q_len, attn.n_kv, -1)).transpose(0, 2, 1, 3)
    v = attn.v_proj(h).reshape(b, q_len, attn.n_kv, -1).transpose(0, 2, 1, 3)
    q, k = rope_at(q, positions, base), rope_at(k, positions, base)
    k = mx.concatenate([ctx_k, k], axis=2)
    v = mx.concatenate([ctx_v, v], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, q_len, -1))


def block_hidden(
    model: DrafterBackbone,
    feats: mx.array,
    block_embeds: mx.array,
    positions: mx.array,
    mask: mx.array,
) -> mx.array:
    """Normalised hidden states (B, Q, hidden) of all block rows.

    feats: (B, L, taps * hidden) target features of positions 0..L-1; block_embeds: (B, Q,
    hidden); positions: (B, Q); mask: (B, 1, Q, L + Q) bool."""
    cfg = model.cfg
    if cfg.rope_scaling is not None or cfg.conv_kernel_size or cfg.sliding_window:
        raise NotImplementedError(
            "training supports default RoPE, no sliding window, no DFlash 2 convolutions"
        )
    ctx = model.hidden_norm(model.fc(feats.astype(model.compute_dtype())))
    x = block_embeds.astype(model.compute_dtype())
    for layer in model.layers:
        # Every layer projects the same context rows with its own k/v (as extend_context does).
        ctx_k, ctx_v = layer.self_attn.keys_values(ctx, 0, model._rope)

        def attend(attn: DraftAttention, h: mx.array, ck: Any = ctx_k, cv: Any = ctx_v) -> mx.array:
            return _attend(attn, h, ck, cv, positions, mask, cfg.rope_theta)

        x = layer(x, attend)
    return model.norm(x)
