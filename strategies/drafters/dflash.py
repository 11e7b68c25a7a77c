"""drafter `dflash`: z-lab's DFlash block-diffusion drafter (z-lab/*-DFlash*), DFlash 2 included.

The block is [anchor, mask x (B-1)]; slot 0 is the anchor itself and slot j >= 1 predicts the
token at the anchor's position + j, so a block of B gives B-1 drafts (z-lab dflash/model.py:
`draft_hidden[:, 1 - B:]`). The drafter has no embedding or LM head: it reuses the target's
(raw embedding x `input_embedding_scale`; logits x `output_multiplier`, then the optional
`final_logit_softcapping`). DFlash 2 (config architectures `DFlash2DraftModel`) adds dynamic
convolutions in every layer (see drafter_backbone) and a candidate selector: each slot keeps its
top-k candidates and a low-rank predecessor -> successor score picks a path left to right.
With `draft_vocab` the target's head is used at the draft vocabulary's rows only (gathered once
per target) and the selector's candidates come from those rows.
"""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import Field

from dspark_flow.arrays import int_list
from dspark_flow.errors import ConfigError
from dspark_flow.models.drafter_backbone import DrafterBackbone
from dspark_flow.models.drafter_loading import DFLASH, DFLASH2, DrafterSpec
from dspark_flow.models.taps import target_embedding, target_head_module, target_lm_head
from dspark_flow.strategies.drafters.block_drafter import BlockDrafter, BlockDrafterConfig
from dspark_flow.strategy import Draft


class DFlashConfig(BlockDrafterConfig):
    kind: Literal["dflash"] = "dflash"
    use_selector: bool = Field(
        True, description="DFlash 2: pick the path with the candidate selector (false: top-1)"
    )


class CandidateSelector(nn.Module):
    def __init__(self, vocab: int, rank: int, hidden: int, top_k: int):
        super().__init__()
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        object.__setattr__(self, "top_k", top_k)


class DFlash2Model(DrafterBackbone):
    def __init__(self, spec: DrafterSpec):
        super().__init__(spec.backbone)
        x = spec.extra
        self.candidate_selector = CandidateSelector(
            spec.vocab_size, x["selector_rank"], spec.backbone.hidden_size, x["selector_top_k"]
        )


class DFlashDrafter(BlockDrafter):
    Config = DFlashConfig
    config: DFlashConfig
    LAYOUTS = (DFLASH, DFLASH2)
    first_slot = 1

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._embed: Any = None
        self._head: Any = None

    def build(self, spec: DrafterSpec) -> DrafterBackbone:
        return DFlash2Model(spec) if spec.layout == DFLASH2 else DrafterBackbone(spec.backbone)

    def bind(self, target: nn.Module) -> None:
        self._embed = target_embedding(target)
        self._head = target_lm_head(target)

    def restrict(self, target: nn.Module) -> None:
        sel = self.model.get("candidate_selector")
        n = self.config.draft_vocab or 0
        if sel is not None and self.config.use_selector and n < sel.top_k:
            raise ConfigError(
                f"drafter dflash: draft_vocab {n} is smaller than the selector's "
                f"{sel.top_k} candidates per slot"
            )
        self._head = self.head_rows(target_head_module(target))

    def embed(self, tokens: mx.array) -> mx.array:
        assert self.spec is not None
        x = self._embed(tokens).astype(self.model.compute_dtype())
        scale = self.spec.extra["input_embedding_scale"]
        return x * scale if scale != 1.0 else x

    def logits(self, hidden: mx.array) -> mx.array:
        assert self.spec is not None
        out = self._head(hidden).astype(mx.float32) * self.spec.extra["output_multiplier"]
        cap = self.spec.extra["final_logit_softcapping"]
        if cap is not None and float(cap) > 0:
            out = mx.tanh(out / float(cap)) * float(cap)
        return out

    def draft(self, hidden: mx.array, anchor: int, k: int) -> Draft:
        n = min(k, hidden.shape[0] - self.first_slot)
        if n <= 0:
            return Draft()
        hidden = hidden[self.first_slot : self.first_slot + n]
        logits = self.logits(hidden)
        selector = self.model.get("candidate_selector")
        if selector is not None and self.config.use_selector:
            return self._select(selector, hidden, logits, anchor)
        if self.trace is not None:
            self.trace.extend(logits)
        if self.greedy:
            ids = self.token_ids(mx.argmax(logits, axis=-1))
            return Draft(pending=ids) if self.leave_pending else Draft(tokens=int_list(ids))
        q = self._sampler.probs(logits)  # type: ignore[union-attr]
        tokens = self.token_ids(mx.stack([self.draw(q[i]) for i in range(n)]))
        return Draft(tokens=int_list(tokens), probs=self.full_probs(q))

    def _select(
        self, sel: CandidateSelector, hidden: mx.array, logits: mx.array, anchor: int
    ) -> Draft:
        """Walk the slots left to right; each picks among its top-k by unary + edge score."""
        assert self.spec is not None
        # q spans the vocabulary: the head's width, or (draft vocabulary) the ids it maps into
        vocab = logits.shape[-1] if self._ids is None else self.spec.vocab_size
        rows = mx.argpartition(logits, -sel.top_k, axis=-1)[:, -sel.top_k :]
        unary = mx.take_along_axis(logits, rows, axis=-1)
        cands = self.token_ids(rows)  # vocabulary ids (the head may cover the draft vocab only)
        proj = sel.hidden_projection(hidden).astype(mx.float32)
        succ = sel.successor_codebook(cands).astype(mx.float32)  # (n, top_k, rank)
        prev = mx.array([anchor])  # shape (1,): a quantized codebook needs a batch axis
        tokens: list[mx.array] = []
        dists: list[mx.array] = []
        for j in range(hidden.shape[0]):
            pred = sel.predecessor_codebook(prev)[0].astype(mx.float32)
            scores = unary[j] + (succ[j] * (pred * proj[j])[None]).sum(axis=-1)
            if self.trace is not None:
                self.trace.append((cands[j], scores))
            if self.greedy:
                pick = mx.argmax(scores)
            else:
                q = self.probs(scores)  # over the candidates; scattered to the vocab below
                pick = self.draw(q)
                dists.append(mx.zeros((vocab,), mx.float32).at[cands[j]].add(q))
            prev = cands[j][pick].reshape(1)
            tokens.append(prev[0])
        if self.leave_pending:
            return Draft(pending=mx.stack(tokens))
        ids = int_list(mx.stack(tokens))  # the drafter's one host sync
        return Draft(tokens=ids, probs=mx.stack(dists) if dists else None)
