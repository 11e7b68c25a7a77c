"""`Pipeline`: a recipe made runnable.

Construction is cheap (strategies are instantiated from their validated configs, nothing is
loaded); `warm_up()` loads the target and lets every strategy load or check what it needs;
`generate()` / `events()` run the decode loop. Per-request changes (sampling, stop strings, token
budget) swap in fresh strategy objects for that request only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from numbers import Integral, Real
from pathlib import Path
from typing import Any, cast

import mlx.nn as nn
from pydantic import ValidationError

from dspark_flow import registry
from dspark_flow.engine.decode import Components, DoneEvent, Event, TextEvent, decode
from dspark_flow.errors import ConfigError, PromptError, validation_message
from dspark_flow.log import get_logger
from dspark_flow.models.context import config_vocab_size
from dspark_flow.recipe.load import load_recipe, validate
from dspark_flow.recipe.schema import Recipe
from dspark_flow.result import GenResult
from dspark_flow.strategy import (
    SLOTS,
    BuildContext,
    StopRule,
    Strategy,
    StrategyConfig,
    construct,
    warm,
)

log = get_logger()

Prompt = str | Sequence[dict[str, str]] | Sequence[int]


def build_strategy(slot: str, config: StrategyConfig | dict[str, Any]) -> Strategy:
    """Instantiate the strategy a config names (validating a plain dict first)."""
    if not isinstance(config, (dict, StrategyConfig)):
        raise ConfigError(
            f"{slot}: expected a recipe section (a dict with a kind) or a strategy config, "
            f"got {type(config).__name__}"
        )
    if isinstance(config, StrategyConfig):
        cls = registry.load_kind(slot, config.kind)
        if isinstance(config, cls.Config):
            return construct(cls, config)
        # a bare StrategyConfig (Recipe.model_validate skips the kinds' own configs): check it
        config = config.model_dump()
    if not isinstance(config.get("kind"), str):
        raise ConfigError(f"{slot}: {registry.missing_kind_message(slot)}")
    cls = registry.load_kind(slot, config["kind"])
    try:
        validated = cls.Config.model_validate(config)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, f"{slot} {config['kind']}")) from None
    return construct(cls, validated)


def stop_strings(stop: str | Sequence[str] | None, what: str = "stop strings") -> list[str]:
    """Stop strings as a list: one string given bare is one stop string, not its characters.
    `what` names them in errors (the server's `stop_sequences`, say)."""
    if stop is None:
        return []
    # Any iterable of strings but a mapping (a dict's keys would pass unnoticed) or bytes.
    listable = isinstance(stop, Iterable) and not isinstance(stop, bytes | Mapping)
    strings = [stop] if isinstance(stop, str) else list(stop) if listable else None
    if strings is None or not all(isinstance(s, str) for s in strings):
        raise ConfigError(f"stop: expected a string or a list of strings, got {stop!r}")
    if any(not s for s in strings):  # "" would match everywhere; it used to be dropped silently
        raise ConfigError(f"{what} must not be empty")
    for i, s in enumerate(strings):  # a lone surrogate could never match decoded text
        check_text(s, f"{what}[{i}]")
    return strings


def _is_id(token: Any) -> bool:
    """A token id: any integer (numpy's too) but a bool."""
    return isinstance(token, Integral) and not isinstance(token, bool)


def _check_prompt(prompt: Any) -> list[int] | None:
    """Token ids as ints (None for text or chat messages, after checking their shape)."""
    if isinstance(prompt, str):
        if not prompt:  # through a chat template it would still make tokens: the template's own
            raise PromptError("the prompt is empty")
        check_text(prompt, "the prompt")
        return None
    if not isinstance(prompt, (list, tuple)):
        raise PromptError(
            "a prompt is text, a list of token ids or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    if not prompt:
        raise PromptError("the prompt is empty")
    if any(_is_id(t) or isinstance(t, Real) for t in prompt):  # token ids (or meant as such)
        for i, t in enumerate(prompt):
            if not _is_id(t):
                raise PromptError(
                    f"token id list: prompt[{i}] is {type(t).__name__}, not an integer id"
                )
        return [int(t) for t in prompt]
    for i, m in enumerate(prompt):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m):
            raise PromptError(
                f'prompt[{i}]: expected a chat message {{"role": ..., "content": ...}}, '
                f"got {type(m).__name__}"
            )
        content = m["content"]
        if isinstance(content, str):
            check_text(content, f"prompt[{i}].content")
        elif not isinstance(content, list):  # a template may take a list of parts, not None
            raise PromptError(
                f"prompt[{i}].content: expected text (or a list of parts), got "
                f"{type(content).__name__}"
            )
    return None


def check_text(text: str, where: str) -> None:
    """Text that cannot be UTF-8 (lone surrogates: undecodable bytes from a terminal or a
    file read with surrogateescape, or a JSON escape) would reach the tokenizer as a bare
    TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"{where} is not valid UTF-8 text (at character {e.start + 1})") from None


class Pipeline:
    def __init__(
        self,
        recipe: Recipe | dict[str, Any],
        target: tuple[Any, Any] | None = None,
        **strategies: Any,
    ):
        """`recipe` is a validated Recipe or a recipe as a dict (validated here, as `from_dict`
        does); `target` is an already loaded (model, tokenizer); `strategies` may pass ready
        strategy objects by slot name (e.g. `drafter=...`) instead of building from the recipe."""
        if isinstance(recipe, dict):
            recipe = validate(recipe)
        elif not isinstance(recipe, Recipe):
            raise ConfigError(
                f"Pipeline: the recipe is a Recipe or a dict, got {type(recipe).__name__} "
                "(a YAML file goes through Pipeline.from_yaml)"
            )
        slots = [slot for slot in SLOTS if slot != "stop"]  # stop rules come from the recipe
        unknown = sorted(set(strategies) - set(slots))
        if unknown:  # a misspelt slot would otherwise drop the caller's strategy silently
            raise ConfigError(
                f"Pipeline: unknown strategy slot {', '.join(unknown)} (slots: {', '.join(slots)})"
            )
        for slot, given in strategies.items():
            if given is not None and not isinstance(given, Strategy):
                raise ConfigError(
                    f"Pipeline: {slot} is a strategy object, got {type(given).__name__} "
                    "(a recipe section goes in the recipe)"
                )
            if given is not None and given.slot != slot:  # it would fail later, blaming another
                raise ConfigError(
                    f"Pipeline: {slot}= takes a {slot} strategy, got a {given.slot} "
                    f"({type(given).__name__})"
                )
        self.recipe = recipe
        self._target = target
        self.drafter = strategies.get("drafter") or build_strategy("drafter", recipe.drafter)
        self.verifier = strategies.get("verifier") or build_strategy("verifier", recipe.verifier)
        self.sampler = strategies.get("sampler") or build_strategy("sampler", recipe.sampler)
        self.draft_cap = strategies.get("draft_cap") or build_strategy(
            "draft_cap", recipe.draft_cap
        )
        self.cache = strategies.get("cache") or build_strategy("cache", recipe.cache)
        self.stops: list[StopRule] = [build_strategy("stop", s) for s in recipe.stop]  # type: ignore[misc]
        self.components: Components | None = None

    @classmethod
    def from_yaml(
        cls,
        path: str | Path,
        overrides: list[str] | None = None,
        target: Any = None,
        defaults: dict[str, Any] | None = None,
    ) -> Pipeline:
        """`defaults`: sections for slots the file leaves out (the CLI passes TOOL_DEFAULTS)."""
        return cls(load_recipe(path, overrides, defaults), target=target)

    @classmethod
    def from_dict(cls, data: dict[str, Any], target: Any = None, **strategies: Any) -> Pipeline:
        return cls(validate(data), target=target, **strategies)

    # -- warm-up -----------------------------------------------------------------------------

    def warm_up(self) -> Pipeline:
        if self.components is not None:
            return self
        if self._target is None:
            from dspark_flow.models.loading import load

            spec = self.recipe.target
            self._target = load(spec.model, spec.weights, spec.revision)
        pair = self._target
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ConfigError(
                "target: expected (model, tokenizer) as load_target returns, got "
                f"{type(pair).__name__}"
            )
        model, tokenizer = pair
        if not isinstance(model, nn.Module) or not callable(getattr(tokenizer, "encode", None)):
            got = type(model).__name__ if not isinstance(model, nn.Module) else "no tokenizer"
            raise ConfigError(
                f"target: expected a loaded model and its tokenizer (load_target, load_pair), got {got}"
            )
        ctx = BuildContext(model=model, tokenizer=tokenizer, recipe=self.recipe)
        # Order matters: the verifier probes only the verify shapes the drafter can ask for,
        # and the cache, draft cap and stops look at all three.
        for strategy in (self.sampler, self.drafter):
            warm(strategy, ctx)
        ctx.sampler, ctx.drafter = self.sampler, self.drafter  # type: ignore[assignment]
        warm(self.verifier, ctx)
        ctx.verifier = self.verifier  # type: ignore[assignment]
        for strategy in (self.cache, self.draft_cap, *self.stops):
            warm(strategy, ctx)
        self.components = Components(
            model=model,
            tokenizer=tokenizer,
            drafter=self.drafter,  # type: ignore[arg-type]
            verifier=self.verifier,  # type: ignore[arg-type]
            sampler=self.sampler,  # type: ignore[arg-type]
            draft_cap=self.draft_cap,  # type: ignore[arg-type]
            cache=self.cache,  # type: ignore[arg-type]
            stops=self.stops,
        )
        return self

    @property
    def tokenizer(self) -> Any:
        return self.warm_up().components.tokenizer  # type: ignore[union-attr]

    # -- prompts -----------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Text -> ids through the chat template (when the recipe asks and the model has one)."""
        tok = self.tokenizer
        if (ids := _check_prompt(prompt)) is not None:
            return self._checked_ids(ids)  # already token ids
        if chat is not None and not isinstance(chat, bool):  # "no" is truthy: refuse, not guess
            raise ConfigError(f"chat is True, False or None, got {chat!r}")
        use_chat = self.recipe.prompt.chat if chat is None else chat
        if isinstance(prompt, str):
            if not (use_chat and getattr(tok, "has_chat_template", False)):
                return list(tok.encode(prompt))
            messages: list[dict[str, str]] = []
            if self.recipe.prompt.system:
                messages.append({"role": "system", "content": self.recipe.prompt.system})
            messages.append({"role": "user", "content": prompt})
        else:
            messages = [dict(m) for m in cast(Sequence[dict[str, str]], prompt)]
            if not getattr(tok, "has_chat_template", False):
                raise PromptError(
                    "this model has no chat template: give the prompt as text or token ids, "
                    "not chat messages"
                )
        try:
            return list(tok.apply_chat_template(messages, add_generation_prompt=True))
        except Exception as exc:  # the template is the model's Jinja code; its failure is data
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PromptError(
                f"the model's chat template failed on these messages: {first}"
            ) from exc

    @property
    def vocab_size(self) -> int:
        """Rows of the target's embedding: the token ids it accepts. (A Hugging Face tokenizer's
        `vocab_size` leaves out added tokens such as Qwen's <|im_end|>; the full vocabulary
        is the fallback.)"""
        model = self.warm_up().components.model  # type: ignore[union-attr]
        vocab = config_vocab_size(model)
        return vocab if vocab is not None else len(self.tokenizer.get_vocab())

    def _checked_ids(self, ids: list[int]) -> list[int]:
        """Ids outside the embedding crash MLX's gather on some backends (a segfault on the
        CPU), so they stop here."""
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise PromptError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        return ids

    # -- generation --------------------------------------------------------------------------

    def _request_components(
        self,
        max_new_tokens: int | None,
        sampler: StrategyConfig | dict[str, Any] | None,
        stop: str | Sequence[str] | None,
    ) -> Components:
        base = self.warm_up().components
        assert base is not None
        changes: dict[str, Any] = {}
        ctx = BuildContext(model=base.model, tokenizer=base.tokenizer, recipe=self.recipe)
        if sampler is not None:
            changes["sampler"] = warm(build_strategy("sampler", sampler), ctx)
        if max_new_tokens is not None or stop is not None:
            stops = [s for s in base.stops if max_new_tokens is None or s.token_budget is None]
            extra: list[dict[str, Any]] = []
            if max_new_tokens is not None:
                extra.append({"kind": "max_tokens", "limit": max_new_tokens})
            if strings := stop_strings(stop):  # checked even when empty ([]: no strings)
                extra.append({"kind": "strings", "strings": strings})
            for config in extra:
                stops.append(warm(build_strategy("stop", config), ctx))  # type: ignore[arg-type]
            changes["stops"] = stops
        return base.with_request(**changes) if changes else base

    def events(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int | None = None,
        sampler: StrategyConfig | dict[str, Any] | None = None,
        stop: str | Sequence[str] | None = None,
        chat: bool | None = None,
        stream_text: bool = True,
    ) -> Generator[Event, None, None]:
        """Yield `TextEvent`s of committed text, then one `DoneEvent` with the `GenResult`; a
        prompt longer than one prefill chunk first yields `PrefillEvent`s as it is read (points
        where a consumer may stop)."""
        started = time.perf_counter()
        components = self._request_components(max_new_tokens, sampler, stop)
        prompt_ids = self.encode_prompt(prompt, chat)
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        for event in decode(components, prompt_ids, stream_text=stream_text, started=started):
            if isinstance(event, DoneEvent):
                r = event.result
                log.info(
                    "generation",
                    tokens=r.num_tokens,
                    prompt_tokens=len(prompt_ids),
                    decode_tok_s=round(r.decode_tokens_per_sec, 2),
                    tok_s=round(r.tokens_per_sec, 2),
                    tau=round(r.mean_accept_len, 3),
                    rounds=r.num_rounds,
                    ttft_s=round(r.ttft_seconds, 3),
                    finish=r.finish_reason,
                )
            yield event

    def generate(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int | None = None,
        sampler: StrategyConfig | dict[str, Any] | None = None,
        stop: str | Sequence[str] | None = None,
        chat: bool | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenResult:
        if on_text is not None and not callable(on_text):  # found only at the first text
            raise ConfigError(f"on_text is a function taking text, got {type(on_text).__name__}")
        result: GenResult | None = None
        for event in self.events(
            prompt,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            stop=stop,
            chat=chat,
            stream_text=on_text is not None,
        ):
            if isinstance(event, TextEvent) and on_text is not None:
                on_text(event.text)
            elif isinstance(event, DoneEvent):
                result = event.result
        assert result is not None
        return result
