"""`GenResult`: what every generate call returns, measured honestly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


@dataclass
class GenResult:
    """One generation's output and its speed and acceptance figures.

    Timing: `ttft_seconds` runs from the call to the first committed token (tokenising and
    prefill included); `tokens_per_sec` divides all generated tokens by the whole call's time;
    `decode_tokens_per_sec` divides the tokens after the first by the time after the first.
    `accept_lengths[i]` is the number of tokens round i committed (accepted drafts + the target's
    own token), so plain greedy gives 1 each round and `mean_accept_len` is τ. A round that
    meets a stop counts up to the token that stopped (an end token included), not the drafts
    it accepted past it.

    A stop string is cut from `text`, while `token_ids` end with the token that completed it
    (a token can hold text on both sides of the cut); tokens a speculative round committed
    after it are dropped, so ids, like text, equal plain decoding's.
    """

    text: str
    token_ids: list[int]
    num_tokens: int
    num_rounds: int
    target_forwards: int
    mean_accept_len: float
    tokens_per_sec: float
    decode_tokens_per_sec: float
    prefill_seconds: float
    ttft_seconds: float
    finish_reason: FinishReason
    accept_lengths: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return (
            f"{self.num_tokens} tokens, {self.decode_tokens_per_sec:.1f} tok/s decode, "
            f"{self.tokens_per_sec:.1f} tok/s end to end, τ={self.mean_accept_len:.2f} "
            f"over {self.num_rounds} rounds, finish={self.finish_reason}"
        )
