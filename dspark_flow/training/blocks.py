"""Host-side batch assembly: sequences cut to a fixed length, anchors sampled per sequence, and
everything the drafter's training pass needs about each block (inputs, labels, masks).

Conventions (one for both drafter kinds): draft d of a block anchored at position a predicts
token a + 1 + d. DSpark reads draft d from block slot d; DFlash from slot d + 1 (its slot 0 is
the anchor's own). A block sees the target features of positions < a only (exactly what it sees
at inference, where the anchor is the last committed token, not yet run through the target), and
every slot of its own block (bidirectional inside the block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dspark_flow.training.data import Sample


@dataclass
class BlockBatch:
    tokens: np.ndarray  # (B, L) int32, padded with `pad_id` after each sequence's end
    block_ids: np.ndarray  # (B, N * bs) int32: [anchor token, mask, ...] per block
    block_pos: np.ndarray  # (B, N * bs) int32: absolute position of each block slot
    mask: np.ndarray  # (B, 1, N * bs, L + N * bs) bool: which keys each block row sees
    labels: np.ndarray  # (B, N, S) int32: token each draft should produce
    prev: np.ndarray  # (B, N, S) int32: token before each draft's (teacher forcing, Markov head)
    aligned: np.ndarray  # (B, N, S) int32: position whose target logits give that token's dist
    weights: np.ndarray  # (B, N, S) float32: 1 where the label exists (else 0)
    num_blocks: int  # blocks with at least one label

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.labels.shape


def pad_sequences(
    samples: list[Sample], seq_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (B, L), lengths (B,)): each sample cut to L tokens (its start kept: positions
    must match what the target saw), padded after the end."""
    out = np.full((len(samples), seq_len), pad_id, dtype=np.int32)
    lengths = np.zeros(len(samples), dtype=np.int32)
    for i, s in enumerate(samples):
        n = min(len(s.tokens), seq_len)
        out[i, :n] = s.tokens[:n]
        lengths[i] = n
    return out, lengths


def sample_blocks(
    samples: list[Sample],
    *,
    seq_len: int,
    anchors: int,
    block_size: int,
    first_slot: int,
    mask_token_id: int,
    pad_id: int,
    rng: np.random.Generator,
) -> BlockBatch:
    """Sample `anchors` blocks per sequence among the answer positions (no replacement)."""
    tokens, lengths = pad_sequences(samples, seq_len, pad_id)
    bsz, n_blk, bs = len(samples), anchors, block_size
    drafts = bs - first_slot
    anchor_pos = np.zeros((bsz, n_blk), dtype=np.int32)
    keep = np.zeros((bsz, n_blk), dtype=bool)
    for i, s in enumerate(samples):
        # Decoding's first round anchors on the first answer token (the prefill sampled it,
        # with the whole prompt as context), so anchors start there; a + 1 < length.
        lo, hi = s.prompt_len, int(lengths[i]) - 1
        if hi <= lo:
            continue
        count = min(n_blk, hi - lo)
        picks = np.sort(rng.choice(np.arange(lo, hi), size=count, replace=False))
        anchor_pos[i, :count] = picks
        keep[i, :count] = True

    d = np.arange(drafts)
    label_pos = anchor_pos[..., None] + 1 + d  # (B, N, S)
    valid = keep[..., None] & (label_pos < lengths[:, None, None])
    safe = np.minimum(label_pos, seq_len - 1)
    rows = np.arange(bsz)[:, None, None]
    labels = np.where(valid, tokens[rows, safe], 0).astype(np.int32)
    prev = np.where(valid, tokens[rows, safe - 1], 0).astype(np.int32)
    aligned = np.where(valid, safe - 1, 0).astype(np.int32)

    block_ids = np.full((bsz, n_blk, bs), mask_token_id, dtype=np.int32)
    block_ids[:, :, 0] = np.where(keep, tokens[np.arange(bsz)[:, None], anchor_pos], mask_token_id)
    block_pos = anchor_pos[..., None] + np.arange(bs)  # (B, N, bs)

    q = n_blk * bs
    q_block = np.repeat(np.arange(n_blk), bs)  # block index of each query row
    ctx_ok = np.arange(seq_len)[None, None, :] < np.repeat(anchor_pos, bs, axis=1)[:, :, None]
    own = (q_block[:, None] == q_block[None, :])[None].repeat(bsz, axis=0)
    mask = np.concatenate([ctx_ok, own], axis=2)[:, None]  # (B, 1, Q, L + Q)
    assert mask.shape == (bsz, 1, q, seq_len + q)
    return BlockBatch(
        tokens=tokens,
        block_ids=block_ids.reshape(bsz, q),
        block_pos=block_pos.reshape(bsz, q).astype(np.int32),
        mask=mask,
        labels=labels,
        prev=prev,
        aligned=aligned,
        weights=valid.astype(np.float32),
        num_blocks=int(valid[..., 0].sum()),
    )
