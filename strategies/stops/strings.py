"""stop `strings`: end where any stop string appears in the output text, even across token
boundaries; the stop string itself is cut from the text."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from dspark_flow.strategy import StopRule, StrategyConfig


class StringsConfig(StrategyConfig):
    kind: Literal["strings"] = "strings"
    strings: list[str] = Field(default_factory=list, description="texts that end the output")

    @field_validator("strings")
    @classmethod
    def _no_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value


class StringsStop(StopRule):
    Config = StringsConfig
    config: StringsConfig

    def check_text(self, text: str, start: int) -> int | None:
        # A stop string can end in new text yet start before it: search from len-1 chars back.
        best = None
        for s in self.config.strings:
            at = text.find(s, max(0, start - len(s) + 1))
            if at != -1 and (best is None or at < best):
                best = at
        return best

    def holdback(self, text: str) -> int:
        """Longest tail of `text` that is a proper prefix of a stop string."""
        hold = 0
        for s in self.config.strings:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return hold
