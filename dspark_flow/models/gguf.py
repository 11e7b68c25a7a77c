"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

`mx.load` already decodes Q4_0/Q4_1/Q8_0 blocks into MLX's affine layout (uint32-packed weights
plus per-group scales and biases), so quantized tensors are copied bit for bit; nothing is
requantized. What llama.cpp changed on the way in is undone here: the tensor names, the per-head
row order of q_proj/k_proj, and the tokenizer, which GGUF stores as raw vocab + merges.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dspark_flow.errors import ModelError

# GGUF per-block tensor name -> mlx-lm module path inside `model.layers.N`.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SUFFIXES = ("weight", "scales", "biases")

# llama.cpp pre-tokenizer types whose split is "each digit alone, then the GPT-2 regex"
# (llama-vocab.cpp lists "\p{N}" before the GPT-2 pattern for these) versus the GPT-2 regex only.
_PRE_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_GPT2 = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}

# general.file_type values (llama.cpp's LLAMA_FTYPE) whose bulk tensors mx.load keeps exact:
# F32, F16, Q4_0, Q4_1, Q8_0, BF16. mx.load silently casts other block types (K-quants, IQ*)
# to float16, so such files are refused rather than converted at a hidden precision change.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 32: "BF16"}

_CONTROL, _USER_DEFINED = 3, 4  # GGUF tokenizer.ggml.token_type values
# HF name -> GGUF key stem (tokenizer.ggml.<stem>_token_id).
_SPECIAL_IDS = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}


def _meta_value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """Metadata scalars come back as 0-d mx.arrays; strings and lists come back as-is."""
    value = meta.get(key, default)
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def _hyperparams(meta: dict[str, Any]) -> dict[str, Any]:
    arch = _meta_value(meta, "general.architecture")
    if arch is None:
        raise ModelError("not a model GGUF file (no general.architecture in its metadata)")
    if arch != "llama":
        raise ModelError(f"unsupported GGUF architecture {arch!r}: only 'llama' can be converted")
    ftype = _meta_value(meta, "general.file_type")
    if ftype is not None and int(ftype) not in _FILE_TYPES:
        raise ModelError(
            f"unsupported GGUF tensor type (file_type {ftype}); "
            f"use a {'/'.join(_FILE_TYPES.values())} GGUF"
        )

    def get(key: str, default: Any = None) -> Any:
        value = _meta_value(meta, f"llama.{key}", default)
        if value is None:
            raise ModelError(f"GGUF metadata lacks llama.{key}; the file is incomplete")
        return value

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", hidden // n_head))
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelError(f"unsupported GGUF: partial rotary embedding ({rope_dims} of {head_dim})")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    }
    scaling = _meta_value(meta, "llama.rope.scaling.type", "none")
    if scaling == "linear":
        factor = float(get("rope.scaling.factor"))
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise ModelError(f"unsupported GGUF rope scaling {scaling!r}")
    return config


def _mlx_name(gguf_name: str) -> tuple[str, str]:
    """'blk.3.attn_q.scales' -> ('model.layers.3.self_attn.q_proj', 'scales')."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in _SUFFIXES:
        raise ModelError(f"unsupported tensor {gguf_name!r} in GGUF file")
    if base in _TOP_NAMES:
        return _TOP_NAMES[base], suffix
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}", suffix
    raise ModelError(f"unsupported tensor {gguf_name!r} in GGUF file (not a plain llama layer)")


def _unpermute_rows(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's HF->GGUF per-head row interleave (reshape(n, 2, d/2).swapaxes(1, 2)).

    Only rows move, so packed weights, scales and biases all stay bit-exact.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _in_dims(module: str, config: dict[str, Any]) -> int:
    if module.endswith("o_proj"):
        return config["num_attention_heads"] * config["head_dim"]
    if module.endswith("down_proj"):
        return config["intermediate_size"]
    return config["hidden_size"]


def _convert_tensors(
    tensors: dict[str, Any], config: dict[str, Any], progress: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    import mlx.core as mx

    weights: dict[str, Any] = {}
    quant: dict[str, dict[str, int]] = {}
    for name in tqdm(sorted(tensors), desc="converting GGUF", unit="tensor", disable=not progress):
        module, suffix = _mlx_name(name)
        w = tensors[name]
        if suffix == "weight" and w.dtype == mx.uint32:
            scales = tensors.get(name[: -len("weight")] + "scales")
            if scales is None:
                raise ModelError(f"unsupported tensor type for {name!r}: packed but has no scales")
            in_dims = _in_dims(module, config)
            group_size, rem = divmod(in_dims, scales.shape[-1])
            bits, rem2 = divmod(w.shape[-1] * 32, in_dims)
            if rem or rem2 or bits not in (2, 3, 4, 5, 6, 8):
                raise ModelError(f"unsupported quantized layout for {name!r}: shape {w.shape}")
            quant[module] = {"group_size": group_size, "bits": bits}
        elif w.dtype not in (mx.float32, mx.float16, mx.bfloat16):
            raise ModelError(f"unsupported tensor type {w.dtype} for {name!r}")
        if module.endswith("q_proj"):
            w = _unpermute_rows(w, config["num_attention_heads"])
        elif module.endswith("k_proj"):
            w = _unpermute_rows(w, config["num_key_value_heads"])
        weights[f"{module}.{suffix}"] = w
    return weights, quant


def _quantization_config(quant: dict[str, dict[str, int]], modules: set[str]) -> dict[str, Any]:
    """Most common (group_size, bits) as the default, every other module spelled out.

    mlx-lm's loader checks `config["quantization"][path]` per module before the default, so a
    Q8_0 embedding next to Q4_1 linears gets its own entry, and float modules get `false`.
    """
    if not quant:
        return {}
    combos = [(q["group_size"], q["bits"]) for q in quant.values()]
    group_size, bits = max(set(combos), key=combos.count)
    config: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for module in sorted(modules):
        q = quant.get(module)
        if q is None:
            if not module.endswith(("norm", "layernorm")):
                config[module] = False
        elif (q["group_size"], q["bits"]) != (group_size, bits):
            config[module] = dict(q)
    return config


def _write_tokenizer(meta: dict[str, Any], out: Path) -> dict[str, Any]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _meta_value(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"unsupported GGUF tokenizer {kind!r}: only byte-level BPE ('gpt2')")
    pre = _meta_value(meta, "tokenizer.ggml.pre", "default")
    if pre in _PRE_DIGITS:
        split = [pre_tokenizers.Digits(individual_digits=True)]
    elif pre in _PRE_GPT2:
        split = []
    else:
        raise ModelError(f"unsupported GGUF tokenizer pre-type {pre!r}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelError("invalid tokenizer in GGUF file: token_type and tokens differ in length")

    try:
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    except Exception as e:  # the tokenizers library raises bare Exception
        raise ModelError(f"invalid tokenizer in GGUF file: {e}") from e
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*split, byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens must match as whole units (never BPE-split), and stay out of decoded text.
    special = [t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tok.save(str(out / "tokenizer.json"))

    ids = {
        name: int(v)
        for name, key in _SPECIAL_IDS.items()
        if (v := _meta_value(meta, f"tokenizer.ggml.{key}_token_id")) is not None
        and 0 <= int(v) < len(tokens)
    }
    named = {f"{name}_token": tokens[i] for name, i in ids.items()}
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_meta_value(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta_value(meta, "llama.context_length", 2048)),
        "additional_special_tokens": special,
        **named,
    }
    template = _meta_value(meta, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(out / "special_tokens_map.json", {**named, "additional_special_tokens": special})
    gen = {f"{name}_token_id": ids[name] for name in ("bos", "eos", "pad") if name in ids}
    _write_json(out / "generation_config.json", gen)
    return gen


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], progress: bool = True
) -> Path:
    """Convert `gguf_path` into an mlx-lm directory at `out_dir` (replaced if present).

    Everything is written into a temp dir beside `out_dir` and renamed into place at the end,
    so a crash or error never leaves a half-written model behind.
    """
    import mlx.core as mx

    from dspark_flow.arrays import load_with_metadata

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        tensors, meta = load_with_metadata(gguf_path)
    except Exception as e:  # mlx raises RuntimeError/ValueError with multi-line text
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelError(f"cannot read GGUF file {gguf_path}: {first}") from e

    config = _hyperparams(meta)
    weights, quant = _convert_tensors(tensors, config, progress)
    config["vocab_size"] = int(
        _meta_value(meta, "llama.vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))
    )
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    config["torch_dtype"] = "float16"
    modules = {k.rpartition(".")[0] for k in weights}
    if quantization := _quantization_config(quant, modules):
        config["quantization"] = quantization

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the result is a shareable cache entry
    try:
        ids = _write_tokenizer(meta, tmp)
        config.update(ids)
        _write_json(tmp / "config.json", config)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` is moved aside first (rename can't overwrite it)."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
