"""The papers' losses, over drafts of shape (B, N, S) with per-draft weights.

DSpark (DeepSpec `deepspec/modeling/dspark/loss.py`): cross entropy on the target's token, plus
the L1 distance between the drafter's and the target's next-token distributions, plus a BCE
teaching the confidence head the per-draft acceptance rate 1 - TV(draft, target); every term is
weighted by exp(-d / gamma) so early drafts, which gate all later ones, count most.
DFlash: the same position-weighted cross entropy alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass
class LossWeights:
    ce: float
    l1: float
    confidence: float
    decay_gamma: float


def decay(weights: mx.array, gamma: float) -> mx.array:
    d = mx.arange(weights.shape[-1], dtype=mx.float32)
    return weights * mx.exp(-d / gamma)


def draft_losses(
    logits: mx.array,
    labels: mx.array,
    weights: mx.array,
    lw: LossWeights,
    target_logits: mx.array | None = None,
    confidence: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """(total loss, metrics). logits/target_logits: (B, N, S, V); labels/weights: (B, N, S)."""
    w = decay(weights, lw.decay_gamma)
    den = mx.maximum(w.sum(), 1e-6)
    logits = logits.astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    total = lw.ce * (ce * w).sum() / den
    metrics = {"ce": (ce * w).sum() / den}
    if target_logits is not None and (lw.l1 > 0 or confidence is not None):
        p = mx.softmax(logits, axis=-1)
        t = mx.softmax(target_logits.astype(mx.float32), axis=-1)
        l1 = mx.abs(p - t).sum(axis=-1)
        metrics["l1"] = (l1 * w).sum() / den
        if lw.l1 > 0:
            total = total + lw.l1 * metrics["l1"]
        if confidence is not None:
            accept = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
            bce = nn.losses.binary_cross_entropy(
                confidence.astype(mx.float32), accept, reduction="none"
            )
            metrics["confidence"] = (bce * w).sum() / den
            total = total + lw.confidence * metrics["confidence"]
    # Teacher-forced greedy acceptance: the drafts a greedy verifier would keep, counted up to
    # the first miss; tau = 1 + that count (the target's own token), over blocks with labels.
    hit = (mx.argmax(logits, axis=-1) == labels) & (weights > 0)
    run = mx.cumprod(hit.astype(mx.float32), axis=-1).sum(axis=-1)
    blocks = mx.maximum((weights[..., 0] > 0).sum(), 1)
    metrics["tau"] = 1.0 + run.sum() / blocks
    metrics["acc0"] = (hit[..., 0].sum()) / blocks
    metrics["loss"] = total
    return total, metrics
