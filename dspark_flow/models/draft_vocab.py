"""A drafter's draft vocabulary (FR-Spec style): the N token ids the target emits most often.

With `draft_vocab: N` a trained drafter computes its LM head over those N rows only (gathered
once at warm-up, quantized rows kept quantized), drafts within them and maps its picks back to
vocabulary ids. Verification is untouched, so greedy output stays greedy output; at T > 0 the
drafter's q is the distribution it really drew from (zero outside the N ids), so speculative
sampling stays exact. What it costs is acceptance on tokens outside the N.

The list is `draft_vocab.npy` in the drafter directory: the int32 ids of the tokens seen, most
frequent first (ties by ascending id). A draft vocabulary larger than the list continues with
the ids never seen, in ascending order (BPE ids roughly follow merge frequency), so the file stays
small. `dspark-flow train RECIPE --stage vocab` (and the export stage) write it from the counts of
the answer tokens in the self-distilled training data, which are the target's own outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dspark_flow.errors import ConfigError, DsparkFlowError
from dspark_flow.files import write_atomic

VOCAB_FILE = "draft_vocab.npy"


# -- the file ----------------------------------------------------------------------------------


def count_answer_tokens(samples: Any, vocab_size: int) -> np.ndarray:
    """int64 counts per token id of the answer tokens (after `prompt_len`) of training samples."""
    counts = np.zeros(vocab_size, np.int64)
    for s in samples:
        answer = np.asarray(s.tokens[s.prompt_len :], np.int64)
        if answer.size and (answer.min() < 0 or answer.max() >= vocab_size):
            bad = int(answer.min()) if answer.min() < 0 else int(answer.max())
            raise DsparkFlowError(
                f"training data holds token id {bad} outside the target's "
                f"vocabulary of {vocab_size} (data of another target?)"
            )
        counts += np.bincount(answer, minlength=vocab_size)
    return counts


def ranked_ids(counts: np.ndarray) -> np.ndarray:
    """Every token id, most frequent first; ties by ascending id (int32)."""
    counts = np.asarray(counts)
    return np.lexsort((np.arange(len(counts)), -counts)).astype(np.int32)


def coverage(counts: np.ndarray, sizes: tuple[int, ...] = (4096, 8192, 16384)) -> dict[str, float]:
    """Share of the counted tokens that the top-N ids hold, for a few N."""
    ordered = np.sort(np.asarray(counts))[::-1]
    total = max(int(ordered.sum()), 1)
    return {str(n): round(float(ordered[:n].sum()) / total, 5) for n in sizes if n < len(ordered)}


def write_draft_vocab(directory: Path, counts: np.ndarray) -> Path:
    """Write `directory/draft_vocab.npy` (the ids counted at least once, ranked) atomically."""
    directory = Path(directory)
    path = directory / VOCAB_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        ids = ranked_ids(counts)[: int((np.asarray(counts) > 0).sum())]
        write_atomic(path, lambda f: np.save(f, ids))
    except OSError as e:
        raise DsparkFlowError(f"cannot write {path}: {e}") from e
    return path


def read_draft_vocab(directory: Path, n: int, vocab_size: int, who: str = "drafter") -> mx.array:
    """The `n` ids of the draft vocabulary (int32): `directory/draft_vocab.npy`'s, then the ids
    it does not list in ascending order; checked, with one-line errors."""
    path = Path(directory) / VOCAB_FILE
    if n < 1:
        raise ConfigError(f"{who}: draft_vocab must be at least 1, got {n}")
    if n > vocab_size:
        raise ConfigError(
            f"{who}: draft_vocab {n} is larger than the vocabulary ({vocab_size} tokens)"
        )
    if not path.is_file():
        raise ConfigError(
            f"{who}: draft_vocab {n} needs {path} (token ids by frequency; "
            "`dspark-flow train RECIPE --stage vocab` writes it), which does not exist"
        )
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # EOFError: an empty file
        # numpy reads text that is no .npy as a pickle, and then suggests unpickling it
        reason = "not a .npy array file" if "pickle" in str(e) else str(e) or type(e).__name__
        raise ConfigError(f"{who}: cannot read {path}: {reason.splitlines()[0]}") from e
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"{path}: expected a 1-D array of token ids, got {ids.dtype} {ids.shape}")
    ids = ids.astype(np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ConfigError(f"{path}: token ids must lie in [0, {vocab_size})")
    if len(np.unique(ids)) != len(ids):
        raise ConfigError(f"{path}: token ids are not distinct")
    if n > len(ids):  # continue with the ids never seen, in id order
        unseen = np.setdiff1d(np.arange(vocab_size), ids, assume_unique=True)
        ids = np.concatenate([ids, unseen])
    return mx.array(ids[:n].astype(np.int32))


# -- the head ----------------------------------------------------------------------------------


class SubsetHead(nn.Module):
    """Rows `ids` of an output projection, gathered once: `head(x)` gives the logits of those ids
    in that order, equal to the full head's logits taken at `ids`.

    Takes a Linear, an Embedding used as the head (tied), or their mlx quantized forms, whose
    packed weight, scales and biases are row-sliced alike (one output row is one row of each)."""

    def __init__(self, head: nn.Module, ids: mx.array):
        super().__init__()
        if not isinstance(
            head, (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding)
        ):
            raise ConfigError(
                f"draft_vocab: cannot restrict an output head of type {type(head).__name__} "
                "(Linear, Embedding or their quantized forms)"
            )
        self.weight = head.weight[ids]
        quant = None
        if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            self.scales = head.scales[ids]
            biases = head.get("biases")
            if biases is not None:
                self.biases = biases[ids]
            quant = {"group_size": head.group_size, "bits": head.bits, "mode": head.mode}
        bias = head.get("bias") if isinstance(head, (nn.Linear, nn.QuantizedLinear)) else None
        if bias is not None:
            self.bias = bias[ids]
        object.__setattr__(self, "quant", quant)
        self.freeze()
        mx.eval(self.parameters())

    def __call__(self, x: mx.array) -> mx.array:
        if self.quant is not None:
            out = mx.quantized_matmul(
                x,
                self["weight"],
                scales=self["scales"],
                biases=self.get("biases"),
                transpose=True,
                **self.quant,
            )
        else:
            out = x @ self["weight"].T
        return out + self["bias"] if "bias" in self else out
