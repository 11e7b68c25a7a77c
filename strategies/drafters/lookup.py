"""drafter `lookup`: prompt/context n-gram lookup, no second model.

The last n tokens (n from `max_ngram` down to `min_ngram`) are searched for earlier in the prompt
and output; the tokens that followed the most recent match are the draft. A match that extends
further back is stronger evidence of a copy run, so the draft length grows with the match length.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from dspark_flow.recipe.section import Section
from dspark_flow.strategy import Draft, Drafter, StrategyConfig


class NgramSearch(Section):
    """How the context is searched for the run its last tokens repeat (also the block drafters'
    `prompt_lookup`)."""

    min_ngram: int = Field(2, ge=1, description="shortest suffix to look up")
    max_ngram: int = Field(4, ge=1, description="longest suffix to look up")
    tokens_per_match: float = Field(
        2.0, gt=0, description="draft length per matched token (longer match, longer draft)"
    )
    max_match_scan: int = Field(64, ge=1, description="how far back a match is measured")

    @model_validator(mode="after")
    def _ngram_order(self) -> NgramSearch:
        if self.min_ngram > self.max_ngram:
            raise ValueError("min_ngram must not exceed max_ngram")
        return self


class LookupConfig(StrategyConfig, NgramSearch):
    kind: Literal["lookup"] = "lookup"
    max_draft: int = Field(16, ge=1, description="most tokens one round may propose")


class LookupDrafter(Drafter):
    Config = LookupConfig
    config: LookupConfig
    sizes_own_drafts: ClassVar[bool] = True  # the match length sizes each draft

    @property
    def max_draft(self) -> int:
        return self.config.max_draft

    def propose(self, history: list[int], k: int) -> Draft:
        tokens, _ = find_copy(history, min(k, self.config.max_draft), self.config)
        return Draft(tokens=tokens)


def find_copy(history: list[int], k: int, search: NgramSearch) -> tuple[list[int], int]:
    """Up to k tokens that followed the most recent earlier occurrence of the context's last
    n tokens (n from max_ngram down to min_ngram), with how many tokens that occurrence's
    match reaches back (0: no match, no tokens)."""
    if k <= 0 or len(history) < search.min_ngram + 1:
        return [], 0
    seq = np.asarray(history, dtype=np.int64)
    for n in range(min(search.max_ngram, len(seq) - 1), search.min_ngram - 1, -1):
        start = _last_match(seq, n)
        if start is None:
            continue
        follow = start + n  # first token after the earlier occurrence
        match_len = _match_length(seq, follow, search.max_match_scan)
        length = min(k, max(1, int(match_len * search.tokens_per_match)))
        tokens = seq[follow : follow + length].tolist()
        if tokens:
            return tokens, match_len
    return [], 0


def _last_match(seq: np.ndarray, n: int) -> int | None:
    """Start of the most recent earlier occurrence of the last n tokens, or None."""
    tail = seq[-n:]
    body = seq[:-1]  # an occurrence must be followed by at least one token
    if len(body) < n:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(body, n)
    hits = np.flatnonzero((windows == tail).all(axis=1))
    hits = hits[hits + n < len(seq)]
    hits = hits[hits != len(seq) - n]
    return int(hits[-1]) if len(hits) else None


def _match_length(seq: np.ndarray, follow: int, limit: int) -> int:
    """How many tokens before `follow` equal the tokens before the end of `seq`."""
    length = 0
    while (
        length < limit
        and follow - 1 - length >= 0
        and seq[follow - 1 - length] == seq[len(seq) - 1 - length]
        and follow - 1 - length != len(seq) - 1 - length
    ):
        length += 1
    return length
