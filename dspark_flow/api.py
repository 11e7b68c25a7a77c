"""The one-call Python API. Each function is a recipe in disguise: it builds the same `Pipeline`
the CLI runs, around a target the caller already loaded."""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dspark_flow.errors import ConfigError, ModelError
from dspark_flow.pipeline import Pipeline, Prompt, build_strategy, stop_strings
from dspark_flow.recipe.schema import DEFAULT_MODEL
from dspark_flow.result import GenResult

if TYPE_CHECKING:  # these load at first use (mlx-lm, the calibration package, the drafters)
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from dspark_flow.calibration import Mode
    from dspark_flow.strategies.draft_caps.auto import AutoCap
    from dspark_flow.strategies.drafters.block_drafter import BlockDrafter, BlockDrafterConfig
    from dspark_flow.strategy import DraftCap, Drafter

    # A drafter as the generate functions take it: loaded, or a checkpoint to load
    DrafterRef = Drafter | str | os.PathLike[str]


def load_target(
    model: str | os.PathLike[str] | None = None, revision: str | None = None, weights: str = "auto"
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a target: the embedded default when `model` is None, else `builtin:<name>`, a hub
    repo id or a local mlx-lm directory. Returns (model, tokenizer)."""
    from dspark_flow.models.loading import load

    ref = _model_ref(model, "load_target: model")
    return load(ref or DEFAULT_MODEL, weights, revision)


def _model_ref(value: Any, what: str) -> str | None:
    """A model name or path as a str (None stays None: the caller's default). An empty name is
    refused, not taken for the default."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{what} is a model name or path, got {type(value).__name__}")
    ref = os.fspath(value)
    if not ref.strip():
        raise ModelError(f"{what}: the model name is empty (None picks the default)")
    return ref


def _check_target(target: Any, where: str, what: str = "target") -> None:
    """A loaded model (load_target's first value), not its tokenizer or a name."""
    import mlx.nn as nn

    if not isinstance(target, nn.Module):
        hint = (
            " (load it with load_target first)" if isinstance(target, str) or target is None else ""
        )
        raise ConfigError(f"{where}: {what} is a loaded model, got {type(target).__name__}{hint}")


def sampler_section(
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
) -> dict[str, Any]:
    """The recipe's sampler section for these settings (greedy at temperature 0)."""
    if temperature == 0.0 and top_p == 1.0 and top_k == 0 and min_p == 0.0:
        if seed is not None:  # unused when greedy, but a bad one is still the caller's mistake
            from dspark_flow.recipe.load import validate

            validate({"sampler": {"kind": "sample", "seed": seed}})
        return {"kind": "greedy"}
    return {
        "kind": "sample",
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
    }


def run_recipe(
    target: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: Prompt,
    *,
    drafter: dict[str, Any],
    draft_cap: dict[str, Any] | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    on_text: Callable[[str], None] | None = None,
    chat: bool | None = True,
    verifier: dict[str, Any] | None = None,
    objects: dict[str, Any] | None = None,
) -> GenResult:
    """Build and run the recipe these arguments describe. `verifier`: the recipe's verifier
    section (default `reference`; `{"kind": "kernels", "invariant": True}` is the CLI's exact
    stack, which warms up, and on a GPU probes, per call: for many calls build a `Pipeline`).
    `objects` passes ready strategy objects by slot (e.g. a drafter holding a loaded model)."""
    recipe: dict[str, Any] = {
        "drafter": drafter,
        "sampler": sampler_section(temperature, top_p, top_k, min_p, seed),
        "stop": [{"kind": "eos"}, {"kind": "max_tokens", "limit": max_new_tokens}],
    }
    if strings := stop_strings(stop):  # checks a stop given as "" too
        recipe["stop"].append({"kind": "strings", "strings": strings})
    if draft_cap is not None:
        recipe["draft_cap"] = draft_cap
    if verifier is not None:
        recipe["verifier"] = verifier
    pipeline = Pipeline.from_dict(recipe, target=(target, tokenizer), **(objects or {}))
    return pipeline.generate(prompt, on_text=on_text, chat=chat)  # checks chat as generate does


def _passed_on(
    wrapper: Callable[..., Any],
    kwargs: dict[str, Any],
    own: tuple[str, ...],
    through: tuple[Callable[..., Any], ...] = (),
) -> dict[str, Any]:
    """The keywords a wrapper hands on, checked in the wrapper's name: Python's own TypeError
    would name `run_recipe`, which the caller never called. `own`: what the wrapper sets
    itself; `through`: the functions the rest goes through (`run_recipe` always)."""
    keywords = [
        p.name
        for fn in (wrapper, *through, run_recipe)
        for p in inspect.signature(fn).parameters.values()
        if p.kind == p.KEYWORD_ONLY
    ]
    allowed = [name for name in dict.fromkeys(keywords) if name not in own]
    caller = wrapper.__name__
    for name in kwargs:
        if name in own:
            raise TypeError(f"{caller}() sets {name} itself; it takes: {', '.join(allowed)}")
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; it takes: {', '.join(allowed)}"
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}{hint}")
    return kwargs


def greedy_generate(
    target: nn.Module, tokenizer: TokenizerWrapper, prompt: Prompt, **kwargs: Any
) -> GenResult:
    """Plain decoding (no drafter) - greedy, or sampled when `temperature` > 0."""
    kwargs = _passed_on(greedy_generate, kwargs, ("drafter", "draft_cap"))
    if "drafter" in (kwargs.get("objects") or {}):  # it would quietly draft with it
        raise TypeError("greedy_generate() decodes without a drafter; objects cannot give one")
    return run_recipe(target, tokenizer, prompt, drafter={"kind": "none"}, **kwargs)


def lookup_generate(
    target: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: Prompt,
    *,
    max_draft_tokens: int = 16,
    min_ngram: int = 2,
    max_ngram: int = 4,
    **kwargs: Any,
) -> GenResult:
    """Speculative decoding with prompt/context n-gram lookup as the drafter."""
    drafter = {
        "kind": "lookup",
        "min_ngram": min_ngram,
        "max_ngram": max_ngram,
        "max_draft": max_draft_tokens,
    }
    kwargs = _passed_on(lookup_generate, kwargs, ("drafter", "draft_cap"))
    return run_recipe(
        target, tokenizer, prompt, drafter=drafter, draft_cap={"kind": "full_block"}, **kwargs
    )


def draft_model_generate(
    target: nn.Module,
    tokenizer: TokenizerWrapper,
    draft: nn.Module,
    prompt: Prompt,
    *,
    max_draft_tokens: int | None = 4,
    **kwargs: Any,
) -> GenResult:
    """Classic speculative decoding with an already loaded draft model sharing the tokenizer
    (`max_draft_tokens` None: as many as the draft model's own cap)."""
    from dspark_flow.strategies.drafters.draft_model import DraftModelConfig, DraftModelDrafter

    kwargs = _passed_on(draft_model_generate, kwargs, ("drafter", "draft_cap", "objects"))
    _check_target(draft, "draft_model_generate", "draft")
    drafter = DraftModelDrafter(DraftModelConfig(model="<in memory>"), model=draft)
    return run_recipe(
        target,
        tokenizer,
        prompt,
        drafter={"kind": "draft_model", "model": "<in memory>"},
        draft_cap=_cap_section(None, max_draft_tokens)[0],
        objects={"drafter": drafter},
        **kwargs,
    )


def calibrate(
    target: nn.Module | tuple[nn.Module, TokenizerWrapper],
    drafter: Drafter | nn.Module | None = None,
    mode: Mode = "lookup",
    target_repo: str | None = None,
    drafter_repo: str | None = None,
    force: bool = False,
    **kwargs: Any,
) -> AutoCap:
    """Measure (or load cached) draft cost curves on this machine; returns an `auto` draft cap
    for `Pipeline(..., draft_cap=...)`. See `dspark_flow.calibration.calibrate`."""
    from dspark_flow.calibration import calibrate as _calibrate

    return _calibrate(target, drafter, mode, target_repo, drafter_repo, force, **kwargs)


# -- trained drafters (DSpark, DFlash) ---------------------------------------------------------


def load_drafter(
    checkpoint: str | os.PathLike[str],
    target: nn.Module,
    *,
    kind: str | None = None,
    revision: str | None = None,
    quantize: int | str | None = "auto",
    dtype: str = "auto",
    **options: Any,
) -> BlockDrafter:
    """Load a DSpark/DFlash drafter checkpoint (local dir, hub id or builtin:<name>) for an
    already loaded `target`; `kind` defaults to what the checkpoint's layout says. The drafter is
    checked against the target (hidden size, vocabulary, depth) and its feature taps installed.

    `quantize` ('auto', 4, 8 or None) quantizes a float checkpoint at load: 'auto' is 4 bits on
    GPU backends and none on the CPU backend, where MLX's quantized matmul costs K times one row.
    A checkpoint stored quantized keeps its quantization, but on the CPU backend with dtype
    'auto' it is dequantized to float32 (unless `quantize` is 4 or 8), and `quantize=None`
    dequantizes it anywhere (to `dtype`; 'auto': bfloat16 on GPU backends)."""
    from dspark_flow.models.drafter_loading import DEEPSPEC, read_spec
    from dspark_flow.models.loading import resolve_model_path
    from dspark_flow.strategies.drafters.block_drafter import BlockDrafter
    from dspark_flow.strategy import BuildContext, warm

    ref = _model_ref(checkpoint, "load_drafter: checkpoint")
    if ref is None:
        raise ConfigError("load_drafter: checkpoint is a drafter name or path, got None")
    _check_target(target, "load_drafter")
    if kind is None and (hint := _kind_not_checkpoint(ref)):
        raise ConfigError(f"load_drafter: {ref!r} is a drafter kind, not a checkpoint; {hint}")
    if kind is not None:  # before anything is downloaded
        _check_checkpoint_kind(kind, "load_drafter")
    path = resolve_model_path(ref, revision)
    if kind is None:
        kind = "dspark" if read_spec(path).layout == DEEPSPEC else "dflash"
    section = {"kind": kind, "checkpoint": ref, "revision": revision, "quantize": quantize}
    drafter = build_strategy("drafter", {**section, "dtype": dtype, **options})
    assert isinstance(drafter, BlockDrafter)  # (its kind was checked above, or is one of ours)
    drafter.load_path(path)
    return warm(drafter, BuildContext(model=target, tokenizer=None, recipe=None))


def _check_checkpoint_kind(kind: str, caller: str) -> None:
    """A ConfigError unless `kind` names a drafter that loads a trained checkpoint."""
    from dspark_flow.strategies.drafters.block_drafter import BlockDrafter

    if not issubclass(_drafter_class(kind), BlockDrafter):
        raise ConfigError(
            f"{caller}: kind {kind!r} loads no checkpoint; trained drafters are dspark or "
            "dflash (lookup_generate and draft_model_generate take the others)"
        )


def _kind_not_checkpoint(ref: str) -> str | None:
    """What to do instead when `ref` names a drafter kind ('lookup', 'dspark', ...) and no local
    folder: the caller meant the kind, and the hub would only say 'not found'."""
    from dspark_flow import registry
    from dspark_flow.strategies.drafters.block_drafter import BlockDrafter

    if os.path.exists(ref) or ref not in registry.kind_names("drafter"):
        return None
    if issubclass(registry.load_kind("drafter", ref), BlockDrafter):
        return "pass its checkpoint (builtin:<name>, a local folder or a hub id; see load_pair)"
    return "use lookup_generate or draft_model_generate, or a recipe's drafter section"


def _drafter_class(kind: Any) -> type:
    from dspark_flow import registry
    from dspark_flow.errors import RegistryError

    if not isinstance(kind, str):
        raise ConfigError(f"load_drafter: kind is a drafter kind's name, got {kind!r}")
    try:
        return registry.load_kind("drafter", kind)
    except RegistryError as e:
        raise ConfigError(f"load_drafter: {e}") from None


def load_pair(
    target: str | os.PathLike[str] | None = None,
    drafter: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    *,
    drafter_revision: str | None = None,
    kind: str | None = None,
    quantize: int | str | None = "auto",
    weights: str = "auto",
    **drafter_options: Any,
) -> tuple[nn.Module, TokenizerWrapper, BlockDrafter, BlockDrafterConfig]:
    """Load a target and its trained drafter: (model, tokenizer, drafter, drafter config).

    With `drafter` None the drafter is looked up by target name in the drafter table (any
    quantization of a known target matches; `kind` picks 'dspark' or 'dflash' when a target has
    both). `revision` pins the target, `drafter_revision` the drafter; `quantize` and the other
    drafter settings (`draft_vocab=8192`, `prompt_lookup=True`, ... as in a recipe) as in
    `load_drafter`."""
    from dspark_flow.models.drafter_loading import resolve_drafter

    target_ref = _model_ref(target, "load_pair: target") or DEFAULT_MODEL
    drafter = _model_ref(drafter, "load_pair: drafter")
    if drafter is None:  # before any download: an unknown target fails fast
        entry = resolve_drafter(target_ref, kind)
        drafter, kind = str(entry["drafter"]), str(entry["kind"])
    if kind is not None:  # a wrong kind or setting fails before the target is downloaded
        _check_checkpoint_kind(kind, "load_pair")
        build_strategy("drafter", {"kind": kind, "quantize": quantize, **drafter_options})
    model, tokenizer = load_target(target_ref, revision, weights)
    loaded = load_drafter(
        drafter, model, kind=kind, revision=drafter_revision, quantize=quantize, **drafter_options
    )
    return model, tokenizer, loaded, loaded.config


def _cap_section(
    cap_controller: DraftCap | dict[str, Any] | None, max_draft_tokens: int | None
) -> tuple[dict[str, Any], DraftCap | None]:
    """(draft_cap recipe section, ready cap object or None)."""
    if cap_controller is None:
        if max_draft_tokens is None:
            return {"kind": "full_block"}, None
        return {"kind": "fixed", "k": max_draft_tokens}, None
    if isinstance(cap_controller, dict):
        return cap_controller, None
    from dspark_flow.strategy import DraftCap

    if not isinstance(cap_controller, DraftCap):
        raise ConfigError(
            "cap_controller is a draft cap (from calibrate()) or its recipe section (a dict), "
            f"got {type(cap_controller).__name__}"
        )
    return cap_controller.config.model_dump(), cap_controller


def speculative_generate(
    target: nn.Module,
    tokenizer: TokenizerWrapper,
    drafter: DrafterRef,
    prompt: Prompt,
    *,
    max_new_tokens: int = 300,
    max_draft_tokens: int | None = 2,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    on_text: Callable[[str], None] | None = None,
    cap_controller: DraftCap | dict[str, Any] | None = None,
    **kwargs: Any,
) -> GenResult:
    """Speculative decoding with a trained drafter (from `load_pair`/`load_drafter`, or a
    checkpoint reference). `max_draft_tokens` drafts that many per round (None: the full block);
    `cap_controller` (a draft_cap strategy or its recipe section) overrides it."""
    from dspark_flow.strategy import Drafter

    kwargs = _passed_on(speculative_generate, kwargs, ("drafter", "draft_cap", "objects"))
    if drafter is None:
        raise ConfigError(
            "speculative_generate needs a drafter: a loaded one (load_pair, load_drafter) or a "
            "checkpoint path or hub id (lookup_generate drafts without one)"
        )
    if isinstance(drafter, Drafter):
        loaded = drafter
    else:
        if not isinstance(drafter, (str, os.PathLike)):
            raise ConfigError(
                "speculative_generate: drafter is a loaded drafter (load_pair, load_drafter) or "
                f"a checkpoint path or hub id, got {type(drafter).__name__}"
            )
        name = _model_ref(drafter, "speculative_generate: drafter")
        loaded = load_drafter(name, target)  # type: ignore[arg-type]  # (never None here)
    draft_cap, cap = _cap_section(cap_controller, max_draft_tokens)
    objects: dict[str, Any] = {"drafter": loaded}
    if cap is not None:
        objects["draft_cap"] = cap
    return run_recipe(
        target,
        tokenizer,
        prompt,
        drafter=loaded.config.model_dump(),
        draft_cap=draft_cap,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        on_text=on_text,
        objects=objects,
        **kwargs,
    )


def load_dflash_pair(
    repo: str | os.PathLike[str],
    revision: str | None = None,
    *,
    quantize: int | str | None = "auto",
) -> tuple[nn.Module, TokenizerWrapper, BlockDrafter, BlockDrafterConfig]:
    """A target and its DFlash drafter from either name: a DFlash drafter repo listed in the
    drafter table (its target is loaded too), or a target (its DFlash drafter is looked up)."""
    from dspark_flow.models.drafter_loading import resolve_target

    if isinstance(repo, os.PathLike):  # a local folder, as load_pair takes
        repo = os.fspath(repo)
    if not isinstance(repo, str) or not repo.strip():
        raise ConfigError(f"load_dflash_pair: expected a drafter or target name, got {repo!r}")
    entry = resolve_target(repo)
    if entry is None:
        return load_pair(repo, None, revision, kind="dflash", quantize=quantize)
    if entry["kind"] != "dflash":
        raise ConfigError(
            f"{repo} is a {entry['kind']} drafter, not a DFlash one; use load_pair(target, {repo!r})"
        )
    # A table entry names the target it was trained for (`targets`); an example target, where
    # given, is the checkpoint to load for it (a hub target names its family, not one file):
    # a family name such as 'qwen3-8b' is a lookup key, no repo to load.
    loadable = [t for t in entry.get("targets") or [] if t.startswith("builtin:") or "/" in t]
    target = entry.get("example_target") or next(iter(loadable), None)
    if not target:
        raise ConfigError(f"{repo} names no target; use load_pair(target, {repo!r})")
    return load_pair(
        target,
        repo,
        None,
        drafter_revision=revision,
        kind="dflash",
        quantize=quantize,
    )


def dflash_generate(
    target: nn.Module,
    tokenizer: TokenizerWrapper,
    drafter: DrafterRef,
    prompt: Prompt,
    *,
    max_draft_tokens: int | None = None,
    **kwargs: Any,
) -> GenResult:
    """`speculative_generate` with DFlash's default of drafting the full block every round."""
    own = ("drafter", "draft_cap", "objects")
    kwargs = _passed_on(dflash_generate, kwargs, own, through=(speculative_generate,))
    return speculative_generate(
        target, tokenizer, drafter, prompt, max_draft_tokens=max_draft_tokens, **kwargs
    )
