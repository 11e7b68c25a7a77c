"""Errors a user can act on.

Every error meant for a person derives from `DsparkFlowError`: the CLI and the server print its
message as one line (no traceback) and the CLI exits with `exit_code`.
"""

from __future__ import annotations


class DsparkFlowError(Exception):
    """A problem the user can fix (bad recipe, missing model, no network...)."""

    exit_code = 2


class RecipeError(DsparkFlowError):
    """The recipe is malformed or names something that does not exist."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class RegistryError(DsparkFlowError):
    """A strategy kind is unknown, claimed twice, or fails to import."""


class ModelError(DsparkFlowError):
    """A model is missing, corrupt, unreachable or incompatible."""


class ConfigError(DsparkFlowError):
    """Strategies that validate alone but do not fit together (checked at build time)."""
