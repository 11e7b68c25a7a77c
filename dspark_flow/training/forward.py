"""The drafter's training pass: every sampled block of a batch in one batched forward.

It reuses the inference modules (`DrafterBackbone`, its `DraftLayer`s, their projections and
`DraftAttention.project`/`output`), so the weights trained are the weights loaded later; only
attention differs in form: all blocks of a sequence are concatenated into one query run with an
explicit mask (blocks.py) instead of one block at a time, and block rows get RoPE at per-row
positions. tests/test_training.py checks this
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
    """The inference attention's own steps, with RoPE at each row's position and the mask."""

    def rope(x: mx.array, offset: Any = None) -> mx.array:
        return rope_at(x, positions, base)

    q, k, v = attn.project(h, 0, rope)
    # MLX's fused kernel whatever the inference option: the matmul route's mask is one sequence's
    out = mx.fast.scaled_dot_product_attention(
        q, mx.concatenate([ctx_k, k], axis=2), mx.concatenate([ctx_v, v], axis=2),
        scale=attn.scale, mask=mask,
    )  # fmt: skip
    return attn.output(out)


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
