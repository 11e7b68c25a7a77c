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


class StrategyError(DsparkFlowError):
    """A strategy's own code failed while it started (constructor or warm_up), named."""


class PromptError(DsparkFlowError):
    """A prompt that is neither text, chat messages nor token ids of the model's vocabulary."""


def validation_message(exc: Exception, what: str) -> str:
    """A pydantic ValidationError as one line naming the field: "what: field: problem"."""
    list_errors = getattr(exc, "errors", None)
    errors = list_errors(include_url=False) if callable(list_errors) else []
    if not errors:
        return f"{what}: {exc}"
    field = ".".join(str(p) for p in errors[0]["loc"]) or "(settings)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = str(errors[0]["msg"]).removeprefix("Value error, ")  # pydantic's, for ValueErrors
    return f"{what}: {field}: {message}{more}"
