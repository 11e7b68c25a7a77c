"""Shared machinery of the trained block drafters (`dspark`, `dflash`); not a kind itself.

Each round drafts one block [anchor, mask, mask, ...] in a single parallel pass of the drafter
backbone, where the anchor is the last committed token (whose target features do not exist yet:
the target has not run on it) and the context is the tapped target features of every committed
position before it. Features arrive through `after_forward`, right after each target forward, cut
to the committed rows; they are projected into the drafter's context keys/values once and never
rolled back, because only committed rows ever enter.

With `draft_vocab: N` the drafter's output head covers only the N ids of the checkpoint's
`draft_vocab.npy` (dspark_flow/models/draft_vocab.py): subclasses compute logits over those rows,
`token_ids` maps their picks back to vocabulary ids and `full_probs` scatters a sampled q back
onto the vocabulary (zero elsewhere), so the sampler's accept/reject test sees the q drawn from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

import mlx.core as mx
import mlx.nn as nn
from pydantic import Field, field_validator

from dspark_flow.errors import ConfigError, DsparkFlowError
from dspark_flow.models.attention import AttentionChoice, matmul_chosen
from dspark_flow.models.draft_vocab import SubsetHead, read_draft_vocab
from dspark_flow.models.drafter_backbone import ContextKV, DrafterBackbone
from dspark_flow.models.drafter_loading import (
    DrafterSpec,
    check_pair,
    load_drafter_weights,
    read_spec,
    resolve_drafter,
)
from dspark_flow.models.taps import FeatureTaps, install_taps
from dspark_flow.strategies.drafters.lookup import CopyIndex, NgramSearch
from dspark_flow.strategy import (
    COPY_SOURCE,
    DRAFTER_SOURCE,
    BuildContext,
    Draft,
    Drafter,
    Sampler,
    StrategyConfig,
)


class PromptLookup(NgramSearch):
    """Copy runs first: where the context's last tokens repeat an earlier run of at least
    `min_match` tokens, draft what followed that run instead of running the drafter."""

    min_match: int = Field(
        4,
        ge=1,
        description="shortest match (in tokens, reaching back from the context's end) whose "
        "continuation is drafted instead of the drafter's block",
    )


# What the before-validators below also accept, for the recipe's JSON Schema (editors would
# flag a shipped recipe's `prompt_lookup: true` otherwise).
_OFF_WORDS = Literal["none", "null", "off"]
QuantizeChoice = Literal["auto", 4, 8]
_QUANTIZE_INPUT = QuantizeChoice | _OFF_WORDS | None
_LOOKUP_INPUT = PromptLookup | bool | _OFF_WORDS | None


class BlockDrafterConfig(StrategyConfig):
    BOOLEAN_WORDS: ClassVar[frozenset[str]] = frozenset({"draft_vocab"})  # `draft_vocab: off`: all
    # Settings that leave the drafter's pass and its cost as they are (calibration keys skip them)
    COST_NEUTRAL: ClassVar[frozenset[str]] = frozenset({"prompt_lookup"})
    checkpoint: str = Field(
        "auto",
        description="builtin:<name>, hub repo id or local dir; 'auto' looks the target up in "
        "the drafter table (dspark_flow/data/drafters.json)",
    )
    revision: str | None = Field(None, description="hub revision of the checkpoint to pin")
    quantize: QuantizeChoice | None = Field(
        "auto",
        description="quantize a float checkpoint's matrices to 4 or 8 bits at load (null: keep "
        "float); auto = 4 on GPU backends, none on the CPU backend. A checkpoint stored "
        "quantized keeps its own quantization, except that null dequantizes it (to dtype; auto: "
        "float32 on the CPU backend, bfloat16 elsewhere)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="float parameters: auto = float32 on the CPU backend (a stored-quantized "
        "checkpoint is dequantized to float32 there unless quantize is 4 or 8), else as stored",
    )

    draft_vocab: int | None = Field(
        None,
        ge=1,
        description="draft only among the N most frequent tokens of the target's outputs (the "
        "checkpoint's draft_vocab.npy): the head computes N rows instead of the vocabulary. "
        "Lossless (verification is unchanged); costs acceptance on rarer tokens. null: all",
    )

    prompt_lookup: PromptLookup | None = Field(
        None,
        description="copy runs from the context first (prompt lookup): a round whose context "
        "ends in a run that occurred earlier drafts what followed it, up to the round's k, and "
        "skips the drafter's pass; the other rounds draft as usual. null: off",
    )
    compile_layers: bool = Field(
        True,
        description="run each drafter layer's parts around its attention through mx.compile: "
        "the same values with fewer host-side calls a round (speculative decoding 1-3% faster "
        "in A/Bs on an H200 and a CPU; dspark_flow/models/drafter_backbone.py)",
    )

    attention: AttentionChoice = Field(
        "auto",
        description="the drafter's attention: fused = MLX's scaled_dot_product_attention, "
        "matmul = two matmuls and a softmax (no per-shape plan); auto = matmul on CUDA, where "
        "the fused kernel plans every new key length anew (a DSpark pass cost 41-64 ms on an "
        "H200 at context lengths not seen before, 2.1 ms as matmul), fused elsewhere",
    )

    @field_validator("quantize", mode="before", json_schema_input_type=_QUANTIZE_INPUT)
    @classmethod
    def _none_word(cls, value: Any) -> Any:
        # `quantize: none` in YAML is the string "none", not null.
        return (
            None if isinstance(value, str) and value.lower() in ("none", "null", "off") else value
        )

    @field_validator("prompt_lookup", mode="before", json_schema_input_type=_LOOKUP_INPUT)
    @classmethod
    def _lookup_switch(cls, value: Any) -> Any:
        # `prompt_lookup: true` (or `--set drafter.prompt_lookup=true`) takes the defaults.
        if value is True:
            return {}
        if value is False or (isinstance(value, str) and value.lower() in ("none", "null", "off")):
            return None
        return value

    # (No input type for the schema here: it would lose the minimum of 1 there, pydantic 2.13;
    # the schema offers a count or null, the tool also takes the off words.)
    @field_validator("draft_vocab", mode="before")
    @classmethod
    def _vocab_off(cls, value: Any) -> Any:
        # YAML reads `off`/`no` as false; `none` is a string. Each means the full vocabulary.
        if value is False or (isinstance(value, str) and value.lower() in ("none", "null", "off")):
            return None
        if value is True:
            raise ValueError("draft_vocab is a number of tokens (e.g. 8192), or null for all")
        return value


class BlockDrafter(Drafter):
    Config: ClassVar[type[StrategyConfig]] = BlockDrafterConfig
    config: BlockDrafterConfig
    LAYOUTS: ClassVar[tuple[str, ...]] = ()
    # Which block slot predicts the first draft token: DSpark's slot 0 (the anchor's own slot)
    # predicts the token after the anchor; DFlash's slot 0 is unused and slot j predicts the
    # token at the anchor's position + j. Tests flip it to prove the convention matters.
    first_slot: int = 0

    def __init__(
        self,
        config: BlockDrafterConfig | None = None,
        model: nn.Module | None = None,
        spec: DrafterSpec | None = None,
    ):
        super().__init__(config)
        self.model: Any = model
        self.spec: DrafterSpec | None = spec
        self._target: nn.Module | None = None
        self._taps: FeatureTaps | None = None
        self._sampler: Sampler | None = None
        self._state = ContextKV(0)
        self._pending: list[mx.array] = []
        self._rows = 0  # committed rows received since begin()
        self._copies: CopyIndex | None = None  # prompt_lookup's index of the committed tokens
        self._ids: mx.array | None = None  # the draft vocabulary's token ids (None: all)
        # Set to a list to record each slot's scores (tests compare them with a reference).
        self.trace: list[Any] | None = None

    # -- loading -----------------------------------------------------------------------------

    def build(self, spec: DrafterSpec) -> DrafterBackbone:
        """The empty drafter module for this checkpoint (names match the checkpoint's)."""
        raise NotImplementedError

    def bind(self, target: nn.Module) -> None:
        """Take what the drafter borrows from the target (DFlash: embedding and LM head)."""

    def restrict(self, target: nn.Module) -> None:
        """Gather the draft vocabulary's rows (`head_rows`) of the output head and of anything
        else computed over the vocabulary; called once per target, after `bind`."""
        raise NotImplementedError

    def embed(self, tokens: mx.array) -> mx.array:
        raise NotImplementedError

    def draft(self, hidden: mx.array, anchor: int, k: int) -> Draft:
        """Up to k tokens from the block's hidden states (B, hidden)."""
        raise NotImplementedError

    def checkpoint_ref(self, ctx: BuildContext) -> str:
        ref = self.config.checkpoint
        if ref != "auto":
            return ref
        target = getattr(getattr(ctx.recipe, "target", None), "model", None)
        if not target:
            raise ConfigError(f"drafter {self.config.kind}: checkpoint 'auto' needs a target name")
        return str(resolve_drafter(target, self.config.kind)["drafter"])

    def load(self, ref: str) -> None:
        from dspark_flow.models.loading import resolve_model_path

        path = resolve_model_path(ref, self.config.revision)
        self.load_path(path)

    def load_path(self, path: Path) -> None:
        spec = read_spec(Path(path))
        if spec.layout not in self.LAYOUTS:
            other = "dspark" if self.config.kind == "dflash" else "dflash"
            raise ConfigError(
                f"{path} is a {spec.layout} checkpoint ({spec.config.get('architectures')}); "
                f"drafter kind '{self.config.kind}' reads {', '.join(self.LAYOUTS)} checkpoints: "
                f"use kind '{other}' (DeepSpec's dflash_*_block7 models are DSpark-format)"
            )
        self.model = load_drafter_weights(
            self.build(spec), spec, self.config.quantize, self.config.dtype
        )
        self.spec = spec
        if self.config.compile_layers:
            self.model.compile_layers(max_context_rows=self.block_size + 1)
        self.model.use_matmul_attention(self.matmul_attention)
        self._target = None  # bind (and restrict) the new weights at the next warm_up

    def warm_up(self, ctx: BuildContext) -> None:
        if self.model is None:
            self.load(self.checkpoint_ref(ctx))
        if ctx.model is not self._target:
            assert self.spec is not None
            check_pair(self.spec, ctx.model)
            self._taps = install_taps(ctx.model, self.spec.target_layer_ids)
            self.bind(ctx.model)
            if self.config.draft_vocab is not None:
                self._ids = read_draft_vocab(
                    self.spec.path,
                    self.config.draft_vocab,
                    self.spec.vocab_size,
                    f"drafter {self.config.kind}",
                )
                self.restrict(ctx.model)
            self._target = ctx.model

    @property
    def bound_to(self) -> Any:
        """The target whose features it reads (None before warm_up); warm_up with another
        model moves it there."""
        return self._target

    @property
    def matmul_attention(self) -> bool:
        return matmul_chosen(self.config.attention)

    # -- one generation ----------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.spec.block_size if self.spec is not None else 0

    @property
    def max_draft(self) -> int | None:
        return (self.block_size - self.first_slot) if self.spec is not None else None

    def begin(self, prompt_ids: list[int], sampler: Sampler) -> None:
        if self._taps is None:
            raise DsparkFlowError(f"drafter {self.config.kind}: warm_up() first")
        self._sampler = sampler
        self._state = ContextKV(len(self.model.layers))
        self._pending, self._rows = [], 0
        self._copies = None
        self._taps.latest.clear()

    def after_forward(self, committed: int) -> None:
        assert self._taps is not None and self.spec is not None
        feats = self._taps.take(self.spec.target_layer_ids)
        if feats is None:
            raise ConfigError(
                f"drafter {self.config.kind}: the target forward recorded no features at layers "
                f"{self.spec.target_layer_ids}; the verifier must run the target's own layers "
                "(use verifier 'reference')"
            )
        # Rounds that draft nothing, or whose drafts were all accepted, keep every row.
        self._pending.append(feats if committed == feats.shape[1] else feats[:, :committed])
        self._rows += committed

    def _sync_context(self, history: list[int]) -> None:
        """Project the newly committed rows into the context; check they line up with history."""
        anchor_pos = len(history) - 1  # rows before the anchor are exactly the context
        if self._pending:
            if self._state.end == 0:
                # A reused prompt-cache prefix was never forwarded, so it has no features: the
                # context then starts where the forwarded rows start.
                self._state.end = anchor_pos - self._rows
                if self._state.end < 0:
                    raise DsparkFlowError("more target features than committed tokens")
            feats = (
                self._pending[0] if len(self._pending) == 1 else mx.concatenate(self._pending, 1)
            )
            self._pending = []
            self.model.extend_context(self._state, feats)
        if self._state.end != anchor_pos:
            raise DsparkFlowError(
                f"drafter {self.config.kind} lost step with the committed tokens (context ends at "
                f"{self._state.end}, anchor at {anchor_pos}): after_forward must follow every "
                "target forward"
            )

    def source(self, history: list[int]) -> str:
        return COPY_SOURCE if self._copy_run(history) else DRAFTER_SOURCE

    def propose(self, history: list[int], k: int) -> Draft:
        # A copy run is likelier accepted than the drafter's guess; the features of the rows
        # committed meanwhile wait in _pending until the drafter runs again.
        if copied := self._copy_run(history):
            return Draft(tokens=copied[:k])
        return self.propose_block(history, k)

    def _copy_run(self, history: list[int]) -> list[int]:
        """The run `prompt_lookup` would copy after `history` (empty: none, or the option is
        off); `source` and `propose` ask about the same history, and the index answers the
        second from memory."""
        lookup = self.config.prompt_lookup
        if lookup is None:
            return []
        if self._copies is None:
            self._copies = CopyIndex(lookup)
        tokens, match = self._copies.find(history, self.max_draft or 0)
        return tokens if match >= lookup.min_match else []

    def propose_block(self, history: list[int], k: int) -> Draft:
        """The drafter's own pass over one block (what calibration times: a copied run costs
        less)."""
        assert self.spec is not None
        self._sync_context(history)
        block = mx.array([history[-1]] + [self.spec.mask_token_id] * (self.block_size - 1))
        hidden = self.model(self._state, self.embed(block)[None])[0]
        return self.draft(hidden, history[-1], k)

    # -- the draft vocabulary ----------------------------------------------------------------

    def head_rows(self, head: nn.Module) -> nn.Module:
        """`head` restricted to the draft vocabulary (unchanged without one)."""
        return head if self._ids is None else SubsetHead(head, self._ids)

    def token_ids(self, index: mx.array) -> mx.array:
        """Vocabulary ids of head row indices (the identity without a draft vocabulary)."""
        return index if self._ids is None else self._ids[index]

    def full_probs(self, q: mx.array) -> mx.array:
        """Distributions (rows, N) over the draft vocabulary as (rows, vocab), zero elsewhere."""
        if self._ids is None:
            return q
        assert self.spec is not None
        ids = mx.broadcast_to(self._ids, q.shape)
        return mx.put_along_axis(
            mx.zeros((q.shape[0], self.spec.vocab_size), q.dtype), ids, q, axis=-1
        )

    # -- sampling helpers --------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self._sampler is None or self._sampler.greedy

    @property
    def leave_pending(self) -> bool:
        """Hand greedy drafts over with their ids still on the device (`Draft.pending`) where the
        sampler resolves them: the loop then builds the verify forward while this drafter's
        forward runs, and the round keeps one host sync."""
        return self.greedy and getattr(self._sampler, "resolves_pending", False)

    def draw(self, q: mx.array) -> mx.array:
        """One token from the processed distribution q (lazy; no host sync)."""
        assert self._sampler is not None
        return self._sampler.sample_from(q)

    def probs(self, logits: mx.array) -> mx.array:
        assert self._sampler is not None
        return self._sampler.probs(logits[None])[0]
