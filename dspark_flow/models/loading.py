"""Turn a model reference into a loaded (model, tokenizer) pair.

A reference is one of: `builtin:<name>` (converted once into the cache), a local mlx-lm
directory, or a Hugging Face repo id. Every failure a user can fix becomes one ModelError line.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from dspark_flow.env import env_flag
from dspark_flow.errors import ModelError
from dspark_flow.log import get_logger
from dspark_flow.models.backend import (
    apply_weight_format,
    choose_weight_format,
    keep_compiled_kernels,
    prefer_openblas,
    warn_if_slow_blas,
)

# Must precede the first `import mlx.core` in the process to take effect (see backend.py).
prefer_openblas()

log = get_logger()

BUILTIN_PREFIX = "builtin:"
SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "data" / "drafters"
HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",  # what mlx-lm's tokenizer loader also reads
    "*.jsonl",
    "*.txt",
    "*.jinja",
    "draft_vocab.npy",  # a trained drafter's draft vocabulary (models/draft_vocab.py)
]
# Files a Hugging Face tokenizer commonly loads from (named when loading fails without any).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "tiktoken.model",
    "spiece.model",
)
# Sizes every mlx-lm architecture reads as numbers; a string there would fail deep inside the
# model's constructor with an arithmetic TypeError that names no field.
NUMERIC_CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _brief(e: BaseException, limit: int = 300) -> str:
    """An exception as one line: its lines joined, a bare KeyError named as the missing key;
    past `limit` characters its start and end are kept (tokenizers put the cause last)."""
    if isinstance(e, KeyError) and len(e.args) == 1:
        return f"missing key {e.args[0]!r}"
    text = " ".join(str(e).split()) or type(e).__name__
    if len(text) <= limit:
        return text
    return f"{text[: limit // 3]} ... {text[-(limit - limit // 3 - 5) :]}"


def _check_model_dir(path: Path) -> Path:
    _model_config(path)
    return path


def _model_config(path: Path) -> dict[str, Any]:
    """The directory's config.json as a dict, or a ModelError saying what is wrong."""
    if not path.is_dir():
        raise ModelError(f"not an mlx-lm model directory: {path} (not a directory)")
    config = path / "config.json"
    if not config.is_file():
        raise ModelError(f"not an mlx-lm model directory: {path} (no config.json)")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"corrupt config in {path}: {_brief(e)}") from e
    if not isinstance(data, dict):
        raise ModelError(f"{config} is not a model config (expected a JSON object)")
    return data


def _looks_like_path(ref: str) -> bool:
    if ref.startswith(("/", ".", "~")):
        return True
    return (os.sep in ref or "/" in ref) and not _REPO_ID.fullmatch(ref)


def _offline_variable() -> str | None:
    """The variable that keeps the hub offline, if one is set. huggingface_hub reads
    HF_HUB_OFFLINE once at import; this re-reads it so late settings count."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if env_flag(name):
            return name
    return None


def _hub_offline() -> bool:
    return _offline_variable() is not None


def _hub_timeout() -> float:
    from huggingface_hub import constants

    return float(constants.HF_HUB_ETAG_TIMEOUT)


def _cached_snapshot_if_unreachable(repo_id: str, revision: str | None) -> str | None:
    """Ask the hub about the repo within its metadata timeout: snapshot_download's own first
    request goes through a client with no timeout, so a stalled endpoint or proxy hung the
    load. None when the hub answered (snapshot_download then fetches as usual). When it did
    not, or refused, the local cache decides as snapshot_download's own fallback does: the
    cached snapshot's folder, else the hub's error is raised (a stall as a timeout)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import HFValidationError, RevisionNotFoundError  # (0.24 to 2.x)

    try:
        HfApi().repo_info(repo_id, revision=revision, timeout=_hub_timeout())
        return None
    except (HFValidationError, RevisionNotFoundError):  # no cached copy makes these right
        raise
    except Exception as asked:
        try:
            path = snapshot_download(
                repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=True
            )
        except Exception:
            raise asked from None
        log.warning(
            f"could not ask the Hugging Face hub ({type(asked).__name__}): using the local cache",
            repo=repo_id,
        )
        return str(path)


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    offline = _hub_offline()
    try:
        path = _cached_snapshot_if_unreachable(repo_id, revision) if not offline else None
        if path is None:
            path = snapshot_download(
                repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=offline
            )
    except Exception as e:  # hub errors come from requests/httpx/hf_hub: all mean "can't get it"
        kind = type(e).__name__
        if kind == "HFValidationError":  # not a repo id: most often a mistyped local path
            raise ModelError(
                f"{repo_id!r} is neither a local directory nor a valid hub repo id "
                f"({_brief(e, 160)})"
            ) from e
        if kind in ("RepositoryNotFoundError", "RevisionNotFoundError", "GatedRepoError"):
            raise ModelError(
                f"could not fetch {repo_id!r} from the Hugging Face hub: {kind} "
                "(check the name/revision, or log in with `hf auth login` for gated repos)"
            ) from e
        if "Timeout" in kind:
            raise ModelError(
                f"the Hugging Face hub did not answer about {repo_id!r} within "
                f"{_hub_timeout():g} s (HF_HUB_ETAG_TIMEOUT): check the network or proxy, or "
                "set HF_HUB_OFFLINE=1 with the model in the local HF cache"
            ) from e
        if offline:
            raise ModelError(
                f"{repo_id!r} is not in the local Hugging Face cache, and {_offline_variable()} "
                "is set: fetch it once with network access, or pass a local directory"
            ) from e
        raise ModelError(
            f"could not fetch {repo_id!r} from the Hugging Face hub (offline or unreachable; "
            f"no local directory {repo_id} either): set HF_HUB_OFFLINE=1 with the model in the "
            "local HF cache, or pass a local directory"
        ) from e
    return _check_model_dir(Path(path))


def resolve_model_path(ref: str, revision: str | None = None) -> Path:
    """Local directory holding an mlx-lm model for `ref`, fetching or converting it if needed."""
    if not ref.strip():
        raise ModelError(
            "the model name is empty: name builtin:smollm2-135m, a hub repo id or a local directory"
        )
    if revision is not None and not isinstance(revision, str):
        raise ModelError(
            f"revision: expected a branch, tag or commit name, got {type(revision).__name__}"
        )
    if ref.startswith(BUILTIN_PREFIX):
        if revision is not None:  # it used to be ignored: the user believed it pinned something
            raise ModelError(
                f"revision {revision!r}: {ref} is built in (one pinned build); revisions name "
                "commits of a hub repo"
            )
        name = ref[len(BUILTIN_PREFIX) :]
        if (SHIPPED_DRAFTERS / name / "config.json").is_file():  # trained drafters in the wheel
            return SHIPPED_DRAFTERS / name
        from dspark_flow.models.embedded import ensure_builtin

        return ensure_builtin(name)
    from dspark_flow.models.embedded import expanded_path

    local = expanded_path(ref, "model path")
    if local.exists():
        if revision is not None:  # a local copy is what it is; a folder named like a repo id
            log.warning("revision ignored for a local directory", path=ref, revision=revision)
        return _check_model_dir(local)
    if _looks_like_path(ref):
        raise ModelError(f"model path not found: {ref}")
    return _snapshot(ref, revision)


def _check_numeric_sizes(config: dict[str, Any], path: Path) -> None:
    """A ModelError naming the first size in `path`'s config.json that is not a number."""
    for key in NUMERIC_CONFIG_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ModelError(
                f"{path / 'config.json'}: {key} is {json.dumps(value)}, expected a number"
            )


def load_model_dir(path: str | os.PathLike[str], weights: str = "auto") -> tuple[Any, Any]:
    """Load (model, TokenizerWrapper) from an mlx-lm directory, in weight format `weights`."""
    from mlx_lm.utils import load_model, load_tokenizer

    keep_compiled_kernels()
    path = Path(path)
    config = _model_config(path)
    if "model_type" not in config:
        raise ModelError(f"{path / 'config.json'} names no model_type: mlx-lm cannot build it")
    _check_numeric_sizes(config, path)
    fmt = choose_weight_format(weights)  # validate before spending time on loading
    try:
        model, config = load_model(path)
    except json.JSONDecodeError as e:
        raise ModelError(f"corrupt config in {path}: {_brief(e)}") from e
    except FileNotFoundError as e:
        raise ModelError(f"incomplete model directory {path}: {_brief(e)}") from e
    except Exception as e:  # bad safetensors header, shape mismatch, unknown model_type ...
        raise ModelError(f"could not load model from {path}: {_brief(e)}") from e
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        if not any((path / f).is_file() for f in TOKENIZER_FILES):  # the usual cause, said plainly
            raise ModelError(
                f"no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}): {_brief(e, 160)}"
            ) from e
        raise ModelError(f"could not load tokenizer from {path}: {_brief(e)}") from e
    apply_weight_format(model, fmt)
    warn_if_slow_blas(fmt)
    return model, tokenizer


def load(ref: str, weights: str = "auto", revision: str | None = None) -> tuple[Any, Any]:
    """resolve_model_path + load_model_dir."""
    keep_compiled_kernels()  # before the embedded model's conversion runs anything on the GPU
    choose_weight_format(weights)  # a typo fails before a download or a conversion, not after
    return load_model_dir(resolve_model_path(ref, revision), weights)
