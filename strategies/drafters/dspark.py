"""drafter `dspark`: DeepSpec's DSpark drafter (deepseek-ai/dspark_*), in one parallel pass.

The block is [anchor, mask x (B-1)] at the anchor's position onwards; DeepSpec "samples from the
anchor": slot j predicts the token j+1 places after the anchor, so a block of B gives B drafts
(deepspec/modeling/dspark/common.py: label_offsets 1..B). The drafter has its own embedding and
LM head (with `tie_word_embeddings` and no stored `lm_head`, the embedding serves as the head).
Two cheap heads run left to right after the pass: the Markov head adds a low-rank previous-token
correction to each slot's logits (vanilla, gated or RNN, as configured), and the confidence head
predicts whether each slot will be accepted; `confidence_threshold` cuts the block at the first
slot whose sigmoid falls below it (deepspec/eval/dspark/draft_ops.py).
With `draft_vocab` the head and the Markov head's output factor cover the draft vocabulary's rows
only; the Markov head and the confidence head read the previous draft token by its vocabulary id.
DeepSpec's own `dflash_*_block7` checkpoints are this architecture with both heads off.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from pydantic import Field

from dspark_flow.errors import ModelError
from dspark_flow.models.drafter_backbone import DrafterBackbone
from dspark_flow.models.drafter_loading import DEEPSPEC, DrafterSpec
from dspark_flow.strategies.drafters.block_drafter import BlockDrafter, BlockDrafterConfig
from dspark_flow.strategy import Draft


class DSparkConfig(BlockDrafterConfig):
    kind: Literal["dspark"] = "dspark"
    confidence_threshold: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="cut the block at the first slot whose confidence is below this "
        "(0: never, DeepSpec's default)",
    )


class MarkovHead(nn.Module):
    """prev token -> logit correction: W2 (W1[prev]) (vanilla), gated, or with a recurrent
    state carried along the block (rnn), as DeepSpec's markov_head.py defines them."""

    def __init__(self, kind: str, vocab: int, rank: int, hidden: int):
        super().__init__()
        if kind not in ("vanilla", "gated", "rnn"):
            raise ModelError(f"unknown markov_head_type {kind!r} (vanilla, gated or rnn)")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(
        self, prev: mx.array, hidden: mx.array, state: mx.array | None, w2: nn.Module | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """(bias over the vocabulary, next recurrent state) for one slot; `prev` has shape (1,)
        (a quantized embedding needs a batch axis). `w2` replaces the output factor (the draft
        vocabulary's rows of it)."""
        w2 = self.markov_w2 if w2 is None else w2
        e = self.markov_w1(prev)[0]
        if self.kind == "vanilla":
            return w2(e), state
        if self.kind == "gated":
            gate = mx.sigmoid(self.gate_proj(mx.concatenate([hidden, e], axis=-1)))
            return w2(gate * e), state
        assert state is not None
        proj = self.joint_proj(mx.concatenate([state, e, hidden], axis=-1))
        gate, cand, out = mx.split(proj, 3, axis=-1)
        gate = mx.sigmoid(gate)
        state = gate * state + (1.0 - gate) * mx.tanh(cand)
        return w2(mx.tanh(out)), state


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)[..., 0]


class DSparkModel(DrafterBackbone):
    def __init__(self, spec: DrafterSpec):
        super().__init__(spec.backbone)
        h, vocab, x = spec.backbone.hidden_size, spec.vocab_size, spec.extra
        self.embed_tokens = nn.Embedding(vocab, h)
        if not x.get("tie_word_embeddings", False):
            self.lm_head = nn.Linear(h, vocab, bias=False)
        if x["markov_rank"] > 0:
            self.markov_head = MarkovHead(x["markov_head_type"], vocab, x["markov_rank"], h)
        if x["enable_confidence_head"]:
            if x["confidence_head_with_markov"] and x["markov_rank"] == 0:
                raise ModelError(f"{spec.path}: confidence_head_with_markov needs a Markov head")
            with_markov = x["confidence_head_with_markov"]
            self.confidence_head = ConfidenceHead(h + (x["markov_rank"] if with_markov else 0))
        object.__setattr__(self, "confidence_with_markov", bool(x["confidence_head_with_markov"]))

    def logits(self, hidden: mx.array) -> mx.array:
        """The LM head, or the embedding used as one when the checkpoint ties them."""
        if "lm_head" in self:
            return self.lm_head(hidden)
        return self.embed_tokens.as_linear(hidden)

    def head_module(self) -> nn.Module:
        """The module whose rows are the output head (the embedding when tied)."""
        return self.lm_head if "lm_head" in self else self.embed_tokens


class DSparkDrafter(BlockDrafter):
    Config = DSparkConfig
    config: DSparkConfig
    LAYOUTS = (DEEPSPEC,)
    first_slot = 0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._head: Any = None  # the draft vocabulary's rows of the head (None: the full head)
        self._markov_w2: Any = None  # ... and of the Markov head's output factor

    def build(self, spec: DrafterSpec) -> DSparkModel:
        return DSparkModel(spec)

    def restrict(self, target: nn.Module) -> None:
        self._head = self.head_rows(self.model.head_module())
        markov = self.model.get("markov_head")
        self._markov_w2 = self.head_rows(markov.markov_w2) if markov is not None else None

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens)

    def draft(self, hidden: mx.array, anchor: int, k: int) -> Draft:
        m = self.model
        n = min(k, hidden.shape[0] - self.first_slot)
        hidden = hidden[self.first_slot : self.first_slot + n]
        # (n, vocab or draft vocab) before the Markov correction
        logits = m.logits(hidden) if self._head is None else self._head(hidden)
        markov = m.get("markov_head")
        conf_head = m.get("confidence_head")
        state = mx.zeros((markov.rank,), hidden.dtype) if markov and markov.kind == "rnn" else None
        prev = mx.array([anchor])
        tokens: list[mx.array] = []
        dists: list[mx.array] = []
        confs: list[mx.array] = []
        for j in range(n):  # left to right: each slot's correction depends on the previous token
            row = logits[j]
            if markov is not None:
                bias, state = markov.step(prev, hidden[j], state, self._markov_w2)
                row = row + bias
            if conf_head is not None:
                feat = hidden[j]
                if m.confidence_with_markov:
                    feat = mx.concatenate([feat, markov.markov_w1(prev)[0].astype(feat.dtype)])
                confs.append(conf_head(feat))
            if self.trace is not None:
                self.trace.append((row, confs[-1] if confs else None))
            if self.greedy:
                token = self.token_ids(mx.argmax(row))
            else:
                q = self.probs(row)
                dists.append(q)
                token = self.token_ids(self.draw(q))
            tokens.append(token)
            prev = token.reshape(1)
        if n == 0:
            return Draft()
        threshold = self.config.confidence_threshold
        if self.leave_pending and not (confs and threshold > 0.0):  # the length is known: n
            return Draft(pending=mx.stack(tokens))
        packed = mx.stack(tokens).astype(mx.float32)
        if confs:
            packed = mx.concatenate([packed, mx.sigmoid(mx.stack(confs).astype(mx.float32))])
        values = cast(list[float], packed.tolist())  # the drafter's one host sync
        ids = [int(t) for t in values[:n]]
        keep = n
        if confs and threshold > 0.0:
            below = [i for i, c in enumerate(values[n:]) if c < threshold]
            keep = below[0] if below else n
        probs = self.full_probs(mx.stack(dists[:keep])) if dists and keep else None
        return Draft(tokens=ids[:keep], probs=probs)
