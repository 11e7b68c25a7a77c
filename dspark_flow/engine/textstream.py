"""Committed tokens -> text, with stop strings cut and streaming that never splits a character.

Text is re-decoded from the generated ids (cheap next to a forward pass) rather than pieced
together per token, so byte-level tokens that form one UTF-8 character come out whole. A
decoded tail ending in U+FFFD is an unfinished character and is held back, as is any tail that
could be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dspark_flow.strategy import StopRule

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(
        self, tokenizer: Any, stops: list[StopRule], on_text: Callable[[str], None] | None
    ):
        self.tokenizer = tokenizer
        self.text_stops = [s for s in stops if type(s).check_text is not StopRule.check_text]
        self.on_text = on_text
        self.emitted = ""  # everything passed to on_text so far
        self.checked = 0  # characters already searched for stop strings
        self.seen = 0  # tokens already searched for them
        # Hugging Face's clean-up ("x ' s" -> "x's") lets more tokens rewrite earlier text, so a
        # stop string one prefix shows may be gone from a longer one.
        self.rewrites_text = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._text = ""

    @property
    def active(self) -> bool:
        """Decoding during the loop is only needed to stream or to find stop strings."""
        return self.on_text is not None or bool(self.text_stops)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def update(self, token_ids: list[int]) -> int | None:
        """Take the whole generated sequence so far. If a stop string appeared, return how many
        tokens the generation keeps: the fewest that show one, as when tokens come one at a
        time. A speculative round commits several at once, and tokens past the stop would
        make its token ids differ from plain decoding's (its text, cut at the stop, did not)."""
        stable, cut = self._find_stop(token_ids)
        if self.rewrites_text and self.text_stops and cut is None:
            # Each prefix the round skipped, as plain decoding saw them one token at a time.
            for m in range(self.seen + 1, len(token_ids)):
                stable_m, cut_m = self._find_stop(token_ids[:m])
                if cut_m is not None:
                    return self._stop(m, stable_m, cut_m)
        if cut is None:
            self.seen = len(token_ids)
            self.checked = len(stable)
            hold = max((rule.holdback(stable) for rule in self.text_stops), default=0)
            self._text = stable
            self._emit(stable[: len(stable) - hold])
            return None
        # Once visible a stop string stays visible as tokens are appended (with no clean-up,
        # and the scan above found none before): bisect the round (a copied run can commit
        # hundreds of tokens) for the fewest tokens that show one.
        low, keep = self.seen + 1, len(token_ids)
        while low < keep:
            mid = (low + keep) // 2
            stable_mid, cut_mid = self._find_stop(token_ids[:mid])
            if cut_mid is None:
                low = mid + 1
            else:
                keep, stable, cut = mid, stable_mid, cut_mid
        return self._stop(keep, stable, cut)

    def _stop(self, keep: int, stable: str, cut: int) -> int:
        self._text = stable[:cut]
        self._emit(self._text)
        return keep

    def _find_stop(self, token_ids: list[int]) -> tuple[str, int | None]:
        """(decoded text without an unfinished last character, where the first stop string
        in it begins or None)."""
        text = self._decode(token_ids)
        stable = text.rstrip(REPLACEMENT) if text.endswith(REPLACEMENT) else text
        start = min(self.checked, len(stable))
        cuts = [rule.check_text(stable, start) for rule in self.text_stops]
        return stable, min((at for at in cuts if at is not None), default=None)

    def _emit(self, upto: str) -> None:
        if len(upto) > len(self.emitted) and upto.startswith(self.emitted):
            piece = upto[len(self.emitted) :]
            self.emitted = upto
            if self.on_text is not None:
                self.on_text(piece)

    def finish(self, token_ids: list[int], stopped_by_text: bool) -> str:
        """Flush what was held back; the returned text equals the concatenation streamed."""
        if not stopped_by_text:
            self._text = self._decode(token_ids)
        self._emit(self._text)
        if not self._text.startswith(self.emitted):
            # Decoding a longer sequence rewrote earlier text (rare tokenizer clean-up rules):
            # what was streamed stays the truth, so the result matches the stream.
            return self.emitted
        return self._text
