"""Trained-drafter checkpoints: read the two published layouts, load weights strictly, check the
target/drafter pair, and look up a target's drafter in `data/drafters.json`.

Layouts (as the upstream code writes them):
- DeepSpec (`deepseek-ai/dspark_*`, and DeepSpec's own `dflash_*_block7`): HF `save_pretrained`
  of `Qwen3DSparkModel`; the config is a copy of the target's with the drafter fields at the top
  level (block_size, target_layer_ids, mask_token_id, markov_rank, ...); the weights include
  `embed_tokens` and `lm_head` (no `lm_head` when the config ties the head to the embedding and
  the checkpoint stores none: the logits then come from `embed_tokens`).
- z-lab DFlash (`z-lab/*-DFlash*`): drafter fields nested under `dflash_config` (falling back to
  the top level, as z-lab's `_draft_value` does); no embedding or LM head (the target's are
  reused). DFlash 2 (`architectures: ["DFlash2DraftModel"]`) adds the conv and selector tensors;
  its two codebooks are stored as bare tensors, not `.weight`.

Either layout may be stored quantized by mlx-lm's convention: config `quantization` holds the
default `group_size`/`bits`/`mode` and optionally a `{group_size, bits, mode}` entry per module
path; a module is stored quantized iff its `<path>.scales` tensor is present.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from dspark_flow.arrays import load_arrays
from dspark_flow.errors import ConfigError, ModelError
from dspark_flow.models.drafter_backbone import BackboneConfig

DEEPSPEC, DFLASH, DFLASH2 = "deepspec", "dflash", "dflash2"
QUANT_GROUP = 64
_IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_DATA = Path(__file__).resolve().parent.parent / "data" / "drafters.json"
# Name suffixes that only say how a target was quantized or converted.
_QUANT_SUFFIX = re.compile(
    r"(-(\d+bit|bf16|fp16|f16|f32|fp8|mxfp4|nvfp4|dwq|mlx|awq|gptq|int4|int8|q\d(_k)?(_[sml])?))+$"
)


@dataclass
class DrafterSpec:
    """What a checkpoint's config.json says, in one shape for both layouts."""

    layout: str
    path: Path
    config: dict[str, Any]
    backbone: BackboneConfig
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    vocab_size: int
    num_target_layers: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.path)


def _require(cfg: dict[str, Any], key: str, where: Path) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelError(f"drafter config {where / 'config.json'} has no {key!r}")
    return cfg[key]


def _positive(cfg: dict[str, Any], key: str, where: Path) -> int:
    """A size the layers are built from: 0 heads would divide by zero inside MLX."""
    value = int(_require(cfg, key, where))
    if value <= 0:
        raise ModelError(f"drafter config {where / 'config.json'}: {key} is {value}, not positive")
    return value


def detect_layout(cfg: dict[str, Any], where: Path) -> str:
    arch = (cfg.get("architectures") or [""])[0]
    if arch == "Qwen3DSparkModel":
        return DEEPSPEC
    if arch == "DFlash2DraftModel":
        return DFLASH2
    if arch == "DFlashDraftModel" or "dflash_config" in cfg:
        return DFLASH
    if arch == "Gemma4DSparkModel":
        raise ModelError(
            f"{where}: Gemma4DSparkModel drafters (v-norm, four-norm layers) are not supported yet; "
            "the Qwen3-style DeepSpec drafters are"
        )
    raise ModelError(
        f"{where} is not a DSpark/DFlash drafter checkpoint (architectures={arch or 'none'}; "
        "expected Qwen3DSparkModel, DFlashDraftModel or DFlash2DraftModel)"
    )


def read_spec(path: Path) -> DrafterSpec:
    """Parse `path/config.json` (either layout) into a DrafterSpec."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read drafter config {path / 'config.json'}: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelError(f"drafter config {path / 'config.json'} is not a JSON object")
    try:
        return _spec_from(cfg, path)
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:  # "block_size": "x"
        raise ModelError(f"drafter config {path / 'config.json'}: a malformed value ({e})") from e


def _spec_from(cfg: dict[str, Any], path: Path) -> DrafterSpec:
    layout = detect_layout(cfg, path)
    nested = cfg.get("dflash_config") or {}

    def value(key: str, default: Any = None) -> Any:
        # z-lab reads dflash_config first, then the top level; DeepSpec only the top level.
        if layout != DEEPSPEC and key in nested:
            return nested[key]
        return cfg.get(key, default)

    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    hidden = _positive(cfg, "hidden_size", path)
    heads = _positive(cfg, "num_attention_heads", path)
    layers = _positive(cfg, "num_hidden_layers", path)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    num_target_layers = cfg.get("num_target_layers")
    layer_ids = value("target_layer_ids")
    if layer_ids is None:
        if layout == DEEPSPEC or num_target_layers is None:
            raise ModelError(f"drafter config {path / 'config.json'} has no 'target_layer_ids'")
        layer_ids = default_target_layer_ids(int(num_target_layers), layers)
    layer_ids = [int(i) for i in layer_ids]
    if any(b <= a for a, b in zip(layer_ids, layer_ids[1:], strict=False)):
        raise ModelError(f"{path}: target_layer_ids {layer_ids} must be strictly increasing")
    mask_id = value("mask_token_id")
    if mask_id is None:
        raise ModelError(f"drafter config {path / 'config.json'} has no 'mask_token_id'")
    backbone = BackboneConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=_positive(cfg, "intermediate_size", path),
        num_taps=len(layer_ids),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope if rope_type != "default" else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
        attention_bias=bool(cfg.get("attention_bias", False)),
        layer_types=tuple(cfg.get("layer_types") or ()),
        sliding_window=cfg.get("sliding_window"),
        # DeepSpec drafts with is_causal=False; z-lab: config, else causal iff sliding.
        is_causal=False if layout == DEEPSPEC else cfg.get("is_causal"),
    )
    if layout == DEEPSPEC:
        # DeepSpec builds layer_types as all full attention; never window its drafters.
        backbone.layer_types, backbone.sliding_window = (), None
    if any(t == "sliding_attention" for t in backbone.layer_types) and not backbone.sliding_window:
        raise ModelError(f"{path}: sliding_attention layers need 'sliding_window' in the config")
    extra: dict[str, Any] = {}
    if layout == DEEPSPEC:
        extra["markov_rank"] = int(cfg.get("markov_rank", 0))
        extra["markov_head_type"] = str(cfg.get("markov_head_type", "vanilla")).lower()
        extra["enable_confidence_head"] = bool(cfg.get("enable_confidence_head", False))
        extra["confidence_head_with_markov"] = bool(cfg.get("confidence_head_with_markov", False))
        # Tied only when the checkpoint really has no head: a stored lm_head wins over the flag
        # (HF and mlx-lm would tie and drop it instead; a stored head is what was trained).
        extra["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False)) and not (
            {"lm_head.weight", "lm_head.scales"} & stored_tensor_names(path)
        )
    else:
        extra["output_multiplier"] = float(value("output_multiplier", 1.0))
        extra["final_logit_softcapping"] = value("final_logit_softcapping")
        extra["input_embedding_scale"] = float(value("input_embedding_scale", 1.0))
    if layout == DFLASH2:
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if value(key) is None:
                raise ModelError(f"DFlash 2 drafter config {path / 'config.json'} has no {key!r}")
            extra[key] = int(value(key))
        if hidden % extra["conv_group_size"]:
            raise ModelError(f"{path}: conv_group_size must divide hidden_size {hidden}")
        backbone.conv_kernel_size = extra["conv_kernel_size"]
        backbone.conv_group_size = extra["conv_group_size"]
    vocab = int(_require(cfg, "vocab_size", path))
    block = int(value("block_size", 16))
    # The first drafted slot is 1 for DFlash (slot 0 holds the last committed token).
    if block < (1 if layout == DEEPSPEC else 2):
        raise ModelError(f"{path}: block_size {block} leaves the drafter no slot to draft in")
    # The mask id fills the block's empty slots and is looked up in the embedding: outside it,
    # the lookup would read past the table (a crash, not an error, on some backends).
    if not 0 <= int(mask_id) < vocab:
        raise ModelError(f"{path}: mask_token_id {mask_id} is outside the vocabulary [0, {vocab})")
    return DrafterSpec(
        layout=layout,
        path=path,
        config=cfg,
        backbone=backbone,
        target_layer_ids=layer_ids,
        block_size=block,
        mask_token_id=int(mask_id),
        vocab_size=vocab,
        num_target_layers=int(num_target_layers) if num_target_layers is not None else None,
        extra=extra,
    )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default when a config names no layers: spread over [1, n - 3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def stored_tensor_names(path: Path) -> set[str]:
    """Names of the tensors in `path/*.safetensors`, from the file headers only."""
    names: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        try:
            with f.open("rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > f.stat().st_size - 8:  # read(size) of a 2e18 "size": MemoryError
                    raise ModelError(
                        f"cannot read {f}: not a safetensors file (a Git LFS pointer, or cut "
                        "short? fetch it with git lfs pull or download it again)"
                    )
                header = json.loads(fh.read(size))
        except (OSError, ValueError, struct.error) as e:
            raise ModelError(f"cannot read {f}: {str(e).splitlines()[0]}") from e
        names.update(k for k in header if k != "__metadata__")
    return names


def read_tensors(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"drafter checkpoint {path} has no *.safetensors files")
    tensors: dict[str, mx.array] = {}
    for f in files:
        try:
            tensors.update(load_arrays(f))
        except Exception as e:  # a corrupt header or truncated file
            raise ModelError(f"cannot read {f}: {str(e).splitlines()[0]}") from e
    return tensors


def load_checked(model: nn.Module, tensors: dict[str, mx.array], where: Path) -> None:
    """Load `tensors` into `model`; every expected tensor must be there with its shape."""
    expected = dict(tree_flatten(model.parameters()))
    for name, param in expected.items():
        if name not in tensors:
            raise ModelError(
                f"drafter checkpoint {where} is missing tensor {name!r} (expected shape "
                f"{tuple(param.shape)})"
            )
        got = tuple(tensors[name].shape)
        if got != tuple(param.shape):
            raise ModelError(
                f"drafter checkpoint {where}: tensor {name!r} has shape {got}, "
                f"expected {tuple(param.shape)} from its config"
            )
    unknown = [n for n in tensors if n not in expected and not _IGNORED_TENSORS.search(n)]
    if unknown:
        raise ModelError(
            f"drafter checkpoint {where} has tensors this drafter does not use: "
            f"{', '.join(sorted(unknown)[:5])}{' ...' if len(unknown) > 5 else ''} "
            "(a variant of the architecture that is not supported?)"
        )
    model.update(tree_unflatten([(n, tensors[n]) for n in expected]))


def compute_dtype(requested: str) -> mx.Dtype | None:
    """float32 on the CPU backend under 'auto' (as the target), else as stored (None)."""
    if requested == "auto":
        from dspark_flow.models.backend import backend_name

        return mx.float32 if backend_name() == "cpu" else None
    return {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[requested]


def quantizable(module: nn.Module, group: int = QUANT_GROUP) -> bool:
    """A matrix that quantizes in groups of `group` (at load time and at export alike)."""
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        return False
    out_dim, in_dim = module.weight.shape
    # A single-group row (the Markov head's rank-32 factors) stays float: MLX 0.32's CUDA
    # quantized kernels fail on it ("SmallVector out of range"), and it is small anyway.
    return in_dim % group == 0 and in_dim > group and out_dim >= group


def resolve_quantize(quantize: int | str | None) -> int | None:
    """'auto' -> 4 bits on GPU backends, none on the CPU backend (whose quantized matmul costs K
    times one row for K rows, which a block drafter's parallel pass cannot afford)."""
    if quantize == "auto":
        from dspark_flow.models.backend import backend_name

        return None if backend_name() == "cpu" else 4
    if quantize not in (None, 4, 8):
        raise ConfigError(f"quantize must be 'auto', 4, 8 or none, not {quantize!r}")
    return None if quantize is None else int(quantize)


def stored_quantization(
    model: nn.Module, spec: DrafterSpec, tensors: dict[str, mx.array]
) -> dict[str, dict[str, Any]]:
    """{module path: to_quantized params} of the modules the checkpoint stores quantized, each
    checked against the stored packed weight, scales and biases shapes."""
    cfg = spec.config.get("quantization")
    quantized = {n[: -len(".scales")] for n in tensors if n.endswith(".scales")}
    if not quantized:
        return {}
    if not isinstance(cfg, dict):
        raise ModelError(
            f"drafter checkpoint {spec.path} stores quantized tensors "
            f"({sorted(quantized)[0]}.scales, ...) but its config has no 'quantization' section"
        )
    default = {
        "group_size": int(cfg.get("group_size", QUANT_GROUP)),
        "bits": int(cfg.get("bits", 4)),
        "mode": str(cfg.get("mode", "affine")),
    }
    plan: dict[str, dict[str, Any]] = {}
    leaves = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    for path, module in cast(list[tuple[str, nn.Module]], leaves):
        if path not in quantized or not hasattr(module, "to_quantized"):
            continue  # a stray .scales is reported by load_checked as an unknown tensor
        entry = cfg.get(path)
        if entry is False:
            raise ModelError(
                f"drafter checkpoint {spec.path}: {path}.scales is stored but the config's "
                f"quantization section says {path!r} is not quantized"
            )
        params = dict(default)
        if isinstance(entry, dict):
            params.update(
                {k: (str(v) if k == "mode" else int(v)) for k, v in entry.items() if k in params}
            )
        _check_quantized_shapes(path, module.weight.shape, params, tensors, spec.path)
        plan[path] = params
    return plan


def _check_quantized_shapes(
    path: str,
    shape: tuple[int, ...],
    params: dict[str, Any],
    tensors: dict[str, mx.array],
    where: Path,
) -> None:
    """The stored weight/scales/biases of `path` must be what quantizing its (out, in) float
    weight with `params` gives; else a one-line ModelError naming the first tensor that is not."""
    out_dim, in_dim = shape
    claim = f"{params['bits']}-bit group-{params['group_size']} {params['mode']}"
    try:  # one row tells the packed widths (and whether the claim is a valid quantization)
        with mx.stream(mx.cpu):  # MLX CUDA's quantize fails on a single row (IndexError)
            row = mx.quantize(mx.zeros((1, in_dim)), **params)
    except (ValueError, RuntimeError, IndexError) as e:
        raise ModelError(
            f"drafter checkpoint {where}: {path}.scales claims {claim} quantization, which does "
            f"not fit {path} ({out_dim} x {in_dim}): {str(e).splitlines()[0]}"
        ) from e
    for suffix, ref in zip(("weight", "scales", "biases"), row, strict=False):
        name = f"{path}.{suffix}"
        want = (out_dim, ref.shape[1])
        got = tuple(tensors[name].shape) if name in tensors else None
        if got != want:
            have = f"has shape {got}" if got is not None else "is missing"
            raise ModelError(
                f"drafter checkpoint {where}: {name} {have}, but {claim} quantization of {path} "
                f"({out_dim} x {in_dim}) stores it as {want}"
            )


def load_drafter_weights(
    model: nn.Module, spec: DrafterSpec, quantize: int | str | None, dtype: str
) -> nn.Module:
    """Fill `model` from the checkpoint, cast float params, quantize if asked; returns it.

    A float checkpoint is quantized to `quantize` bits ('auto': 4 on GPU backends, none on CPU).
    A stored-quantized checkpoint keeps its own quantization (never re-quantized), except that it
    is dequantized where `quantize` is None (to `dtype`; 'auto': float32 on the CPU backend,
    bfloat16 elsewhere) and on the CPU backend with both 'auto' (to float32)."""
    tensors = read_tensors(spec.path)
    if spec.layout == DFLASH2:
        for name in ("predecessor_codebook", "successor_codebook"):
            key = f"candidate_selector.{name}"
            if key in tensors:
                tensors[f"{key}.weight"] = tensors.pop(key)
    plan = stored_quantization(model, spec, tensors)
    if plan:  # an mlx-converted drafter: quantize the skeleton to match, module by module
        nn.quantize(model, class_predicate=lambda p, m: dict(plan[p]) if p in plan else False)
    load_checked(model, tensors, spec.path)
    bits = resolve_quantize(quantize)
    target_dtype = compute_dtype(dtype)
    if plan and (quantize is None or (quantize == "auto" and dtype == "auto" and _on_cpu())):
        from dspark_flow.models.backend import dequantize_model

        # (MLX's quantized matmul on the CPU costs K times one row, so float32 there; on a
        # GPU, null lets one measure a float drafter against the shipped 4-bit one)
        float_dtype = target_dtype or (mx.float32 if _on_cpu() else mx.bfloat16)
        return dequantize_model(model, float_dtype)  # also casts (and evaluates) the rest
    if target_dtype is not None:
        model.set_dtype(target_dtype)
    if bits and not plan:
        nn.quantize(
            model,
            group_size=QUANT_GROUP,
            bits=bits,
            class_predicate=lambda _path, m: quantizable(m),
        )
    mx.eval(model.parameters())
    return model


def quantize_as_stored(path: Path) -> str | None:
    """The `quantize` setting that loads a drafter directory as it ships: a stored-quantized
    one keeps its quantization ('auto'; on the CPU backend it is dequantized to float32, as any
    drafter there), a float one stays float (None, where 'auto' would quantize it on GPUs)."""
    try:
        spec = read_spec(Path(path))
    except ModelError:
        return None  # the loader names the problem
    return "auto" if spec.config.get("quantization") else None


def _on_cpu() -> bool:
    from dspark_flow.models.backend import backend_name

    return backend_name() == "cpu"


def check_pair(spec: DrafterSpec, target: nn.Module, target_name: str = "the target") -> None:
    """Refuse a drafter trained for another target (hidden size, vocabulary, depth)."""
    from dspark_flow.models.taps import find_layers, target_hidden_size, target_vocab_size

    hidden = target_hidden_size(target)
    if hidden != spec.backbone.hidden_size:
        raise ConfigError(
            f"drafter {spec.name} does not fit {target_name}: it reads target hidden states of "
            f"size {spec.backbone.hidden_size} (fc input {spec.backbone.num_taps} x "
            f"{spec.backbone.hidden_size}), the target's hidden size is {hidden}"
        )
    vocab = target_vocab_size(target)
    if vocab != spec.vocab_size:
        raise ConfigError(
            f"drafter {spec.name} does not fit {target_name}: drafter vocabulary {spec.vocab_size}, "
            f"target vocabulary {vocab}"
        )
    depth = len(find_layers(target))
    if spec.num_target_layers is not None and spec.num_target_layers != depth:
        raise ConfigError(
            f"drafter {spec.name} was trained on a target with {spec.num_target_layers} layers; "
            f"{target_name} has {depth}"
        )


# -- the target -> drafter table ---------------------------------------------------------------


def target_key(ref: str) -> str:
    """'mlx-community/Qwen3-8B-8bit' -> 'qwen3-8b' (owner and quantization suffix dropped)."""
    if ref.startswith("builtin:"):
        return ref.lower()
    name = ref.rstrip("/").rsplit("/", 1)[-1].lower()
    return _QUANT_SUFFIX.sub("", name)


def drafter_table() -> list[dict[str, Any]]:
    return list(json.loads(_DATA.read_text())["pairs"])


def resolve_drafter(target: str, kind: str | None = None) -> dict[str, Any]:
    """The table entry for `target` (first available one, of `kind` when given)."""
    key = target_key(target)
    known = [e for e in drafter_table() if key in e["targets"] and kind in (None, e["kind"])]
    for entry in known:
        if entry.get("available", True):
            return entry
    desc = f"{kind} drafter" if kind else "trained drafter"
    if known:
        note = f" ({known[0]['note']})" if known[0].get("note") else ""
        raise ConfigError(
            f"the {desc} for {target}, {known[0]['drafter']}, is not published yet{note}; "
            "pass a checkpoint (local dir or hub id)"
        )
    raise ConfigError(
        f"no {desc} is known for {target} (looked up as {key!r} in {_DATA.name}); "
        "pass a checkpoint (local dir or hub id)"
    )


def resolve_target(drafter: str) -> dict[str, Any] | None:
    """The table entry whose drafter is `drafter` (for loading a pair from its drafter)."""
    for entry in drafter_table():
        if entry["drafter"].lower() == drafter.lower():
            return entry
    return None
