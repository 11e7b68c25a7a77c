"""Write a trained drafter in the published layouts that `drafter_loading` reads:
DeepSpec's (`Qwen3DSparkModel`, drafter fields at the top level, own embedding) for DSpark and
z-lab's (`DFlashDraftModel`, fields under `dflash_config`, no embedding or head) for DFlash.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dspark_flow.errors import DsparkFlowError
from dspark_flow.models.draft_vocab import VOCAB_FILE
from dspark_flow.models.drafter_loading import quantizable
from dspark_flow.training.recipe import TrainRecipe

WEIGHTS = "model.safetensors"
# What an exported drafter folder holds: export replaces the folder whole, so anything else in
# it (a user's notes, a report) makes the folder not ours to replace.
DRAFTER_FILES = {WEIGHTS, "config.json", "README.md", "train_summary.json", VOCAB_FILE}
IGNORED_FILES = {".DS_Store"}  # what a file browser adds (macOS Finder)


def exported_by(out: Path) -> str | None:
    """The name of the training recipe that exported the drafter in `out` (its config.json's
    `dspark_flow.recipe`); None for anything else, a hub drafter included."""
    try:
        config = json.loads((Path(out) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    mark = config.get("dspark_flow") if isinstance(config, dict) else None
    name = mark.get("recipe") if isinstance(mark, dict) else None
    return name if isinstance(name, str) else None


def _unreadable_config(out: Path) -> bool:
    try:
        json.loads((out / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    return False


def refusal(out: Path, recipe_name: str, replace: bool = False) -> str | None:
    """Why the recipe `recipe_name` may not write its drafter into `out` (None: it may).

    It may write into a new or empty folder, one holding only a draft vocabulary (its own vocab
    stage's), or a drafter it exported itself; a drafter another recipe exported only with
    `replace`; never into anything else (a hub drafter, a folder of notes, a drafter folder
    with a user's file added): a user's files are not deleted to make room."""
    out = Path(out)
    if not out.exists():
        return None
    if not out.is_dir():
        return "is a file"
    names = sorted(p.name for p in out.iterdir() if p.name not in IGNORED_FILES)
    if not names or names == [VOCAB_FILE]:
        return None
    owner = exported_by(out)
    foreign = [name for name in names if name not in DRAFTER_FILES]
    if owner is None and not foreign and _unreadable_config(out):  # whose it was is unknown
        return "holds a drafter whose config.json is unreadable: remove the folder to export there"
    if owner is None or foreign:
        return f"holds files this tool did not export ({', '.join((foreign or names)[:3])})"
    if owner != recipe_name and not replace:
        return f"holds the drafter that recipe '{owner}' exported (--replace replaces it)"
    return None


def drafter_config(recipe: TrainRecipe, dims: dict[str, int], mask_token_id: int) -> dict[str, Any]:
    """config.json of the drafter this recipe trains on a target with `dims`."""
    arch = recipe.drafter
    common: dict[str, Any] = {
        "hidden_size": dims["hidden_size"],
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads or dims["num_heads"],
        "num_key_value_heads": arch.num_kv_heads or dims["num_kv_heads"],
        "head_dim": arch.head_dim or dims["head_dim"],
        "intermediate_size": arch.intermediate_size or dims["intermediate_size"],
        "rms_norm_eps": dims.get("rms_norm_eps", 1e-6),
        "rope_theta": dims.get("rope_theta", 10000.0),
        "max_position_embeddings": dims.get("max_position_embeddings", 8192),
        "vocab_size": dims["vocab_size"],
        "hidden_act": "silu",
        "attention_bias": False,
        "num_target_layers": dims["num_layers"],
        "dspark_flow": {"trained_with": "dspark-flow train", "recipe": recipe.name},
    }
    if arch.kind == "dspark":
        return {
            "architectures": ["Qwen3DSparkModel"],
            "model_type": "qwen3",
            **common,
            "tie_word_embeddings": True,
            "block_size": arch.block_size,
            "target_layer_ids": list(arch.target_layer_ids),
            "mask_token_id": mask_token_id,
            "markov_rank": arch.markov_rank,
            "markov_head_type": arch.markov_head_type,
            "enable_confidence_head": arch.confidence_head,
            "confidence_head_with_markov": False,
        }
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **common,
        "dflash_config": {
            "block_size": arch.block_size,
            "target_layer_ids": list(arch.target_layer_ids),
            "mask_token_id": mask_token_id,
        },
    }


def export_weights(
    model: nn.Module, dtype: mx.Dtype, quantize: int | None, group_size: int
) -> dict[str, mx.array]:
    """Flat tensors as the loader expects them: floats cast to `dtype`; with `quantize`, every
    Linear/Embedding whose width the group divides stored as mlx affine (weight, scales, biases).

    Pure array work on the CPU stream: nothing is copied or converted in place, and no GPU
    kernel is needed for a one-off write."""
    flat = dict(tree_flatten(model.parameters()))
    with mx.stream(mx.cpu):
        out = {k: v.astype(dtype) for k, v in flat.items()}
        if quantize:
            for path, module in model.named_modules():
                if not path or not quantizable(module, group_size):
                    continue
                w = flat[f"{path}.weight"].astype(mx.float32)
                q, scales, biases = mx.quantize(w, group_size=group_size, bits=quantize)
                out[f"{path}.weight"] = q
                out[f"{path}.scales"] = scales.astype(dtype)
                out[f"{path}.biases"] = biases.astype(dtype)
        mx.eval(out)
    return out


def write_drafter(
    model: nn.Module,
    config: dict[str, Any],
    out: Path,
    *,
    quantize: int | None = None,
    group_size: int = 32,
    dtype: str = "bfloat16",
    extra_files: dict[str, str] | None = None,
    replace: bool = False,
) -> Path:
    """Save `model` + `config` as a loadable drafter directory, atomically replacing what
    `refusal` allows (a drafter another recipe exported only with `replace`)."""
    config = dict(config)
    if quantize:
        config["quantization"] = {"group_size": group_size, "bits": quantize, "mode": "affine"}
    weights = export_weights(model, getattr(mx, dtype), quantize, group_size)
    out = Path(out)
    if why := refusal(out, config.get("dspark_flow", {}).get("recipe", ""), replace):
        raise DsparkFlowError(f"output {out} {why}; name a new directory in `output`")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would make the installed drafter private
    except OSError as e:
        raise DsparkFlowError(f"cannot write drafter to {out}: {e}") from e
    try:
        mx.save_safetensors(str(tmp / WEIGHTS), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DsparkFlowError(f"cannot write drafter to {out}: {e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*")) / 2**20
