"""Test helpers for the trained drafters: checkpoints in both published layouts (tensor names and
config fields as the upstream code writes them, random weights), an independent numpy version of
the upstream forward, and a tiny teacher-forced trainer.

Nothing here imports the drafter implementation's naming: the tensor lists below are written from
DeepSpec (`deepspec/modeling/dspark/qwen3/modeling.py`, `markov_head.py`, `common.py`) and z-lab
(`dflash/model.py`, DFlash 2 fixture `tests/fixtures/dflash2-safetensors-header.json`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

MASK = 250  # a mask token id inside the small test vocabularies


def deepspec_config(hidden: int, vocab: int, target_layers: int, layer_ids: list[int], **kw: Any):
    layers = kw.get("layers", 1)
    return {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": kw.get("inter", 64),
        "num_hidden_layers": layers,
        "num_attention_heads": kw.get("heads", 2),
        "num_key_value_heads": kw.get("kv", 1),
        "head_dim": kw.get("head_dim", 16),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": vocab,
        "tie_word_embeddings": kw.get("tie", False),
        "layer_types": ["full_attention"] * layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "num_target_layers": target_layers,
        "block_size": kw.get("block", 7),
        "mask_token_id": kw.get("mask", MASK),
        "target_layer_ids": list(layer_ids),
        "num_anchors": 512,
        "enable_confidence_head": kw.get("confidence", False),
        "confidence_head_with_markov": kw.get("conf_markov", False),
        "markov_rank": kw.get("markov_rank", 0),
        "markov_head_type": kw.get("markov_type", "vanilla"),
        "torch_dtype": "bfloat16",
    }


def zlab_config(hidden: int, vocab: int, target_layers: int, layer_ids: list[int], **kw: Any):
    layers, v2, window = kw.get("layers", 1), kw.get("v2", False), kw.get("window")
    cfg: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel" if v2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": kw.get("inter", 64),
        "num_hidden_layers": layers,
        "num_attention_heads": kw.get("heads", 2),
        "num_key_value_heads": kw.get("kv", 1),
        "head_dim": kw.get("head_dim", 16),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "vocab_size": vocab,
        "num_target_layers": target_layers,
        "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": kw.get("mask", MASK), "target_layer_ids": layer_ids},
        "layer_types": ["sliding_attention" if window else "full_attention"] * layers,
        "dtype": "bfloat16",
    }
    if window:
        cfg.update(sliding_window=window, use_sliding_window=True)
    if v2:  # DFlash 2: drafter fields nested, rope_parameters, is_causal false
        cfg["is_causal"] = False
        cfg["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "default"}
        cfg["dflash_config"].update(
            block_size=kw.get("block", 8),
            conv_group_size=kw.get("group", 8),
            conv_kernel_size=2,
            selector_rank=kw.get("rank", 8),
            selector_top_k=kw.get("top_k", 4),
        )
        for key in ("output_multiplier", "final_logit_softcapping"):
            if key in kw:
                cfg["dflash_config"][key] = kw[key]
    else:  # DFlash v1 (z-lab/Qwen3-8B-DFlash-b16 style): block_size at the top level
        cfg["block_size"] = kw.get("block", 16)
        cfg["rope_theta"] = 1000000.0
    return cfg


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    dc = cfg.get("dflash_config", {})
    arch = cfg["architectures"][0]
    h, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter = cfg["intermediate_size"]
    ids = cfg.get("target_layer_ids") or dc["target_layer_ids"]
    t = {"fc.weight": (h, len(ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(n_layers):
        p = f"layers.{i}."
        t.update(
            {
                p + "self_attn.q_proj.weight": (nh * hd, h),
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.o_proj.weight": (h, nh * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if arch == "DFlash2DraftModel":
            k, g = dc["conv_kernel_size"], dc["conv_group_size"]
            for c in ("attention_conv", "mlp_conv"):
                t[p + c + ".base_kernel"] = (2, k, h)
                t[p + c + ".kernel_projection.weight"] = (2 * k * (h // g), h)
    if arch == "Qwen3DSparkModel":
        t["embed_tokens.weight"] = (v, h)
        if not cfg["tie_word_embeddings"]:  # save_pretrained drops a tied head
            t["lm_head.weight"] = (v, h)
        r = cfg["markov_rank"]
        if r:
            t["markov_head.markov_w1.weight"] = (v, r)
            t["markov_head.markov_w2.weight"] = (v, r)
            if cfg["markov_head_type"] == "gated":
                t["markov_head.gate_proj.weight"] = (r, h + r)
                t["markov_head.gate_proj.bias"] = (r,)
            if cfg["markov_head_type"] == "rnn":
                t["markov_head.joint_proj.weight"] = (3 * r, 2 * r + h)
                t["markov_head.joint_proj.bias"] = (3 * r,)
        if cfg["enable_confidence_head"]:
            t["confidence_head.proj.weight"] = (
                1,
                h + (r if cfg["confidence_head_with_markov"] else 0),
            )
            t["confidence_head.proj.bias"] = (1,)
    if arch == "DFlash2DraftModel":  # the two codebooks are bare tensors, not `.weight`
        r = dc["selector_rank"]
        t["candidate_selector.predecessor_codebook"] = (v, r)
        t["candidate_selector.successor_codebook"] = (v, r)
        t["candidate_selector.hidden_projection.weight"] = (r, h)
    return t


def random_tensors(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        a = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            a = 1.0 + 0.1 * a
        elif len(shape) == 1 or name.endswith("base_kernel"):
            a = 0.3 * a
        else:
            a = a / np.float32(np.sqrt(shape[-1]))
        out[name] = a.astype(np.float32)
    return out


def write_checkpoint(directory: Path, cfg: dict[str, Any], tensors: dict[str, Any]) -> Path:
    """config.json + model.safetensors in bfloat16, as the published checkpoints are."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    arrays = {
        k: mx.array(np.asarray(v, dtype=np.float32)).astype(mx.bfloat16) for k, v in tensors.items()
    }
    mx.save_safetensors(str(directory / "model.safetensors"), arrays)
    return directory


def write_quantized_checkpoint(
    directory: Path,
    cfg: dict[str, Any],
    tensors: dict[str, Any],
    modules: dict[str, tuple[int, int]],
    default: tuple[int, int] = (64, 4),
) -> Path:
    """As mlx-lm converts a checkpoint: each module path in `modules` stored quantized (affine,
    its (group_size, bits); `.weight` packed, `.scales`/`.biases` in bfloat16), every other tensor
    in bfloat16, and config `quantization` = the `default` pair plus one entry per module whose
    pair differs from it."""
    directory.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, mx.array] = {}
    quant: dict[str, Any] = {"group_size": default[0], "bits": default[1], "mode": "affine"}
    for name, value in tensors.items():
        arrays[name] = mx.array(np.asarray(value, dtype=np.float32)).astype(mx.bfloat16)
    for path, (group, bits) in modules.items():
        w = arrays[f"{path}.weight"]
        q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
        arrays[f"{path}.weight"] = q
        arrays[f"{path}.scales"], arrays[f"{path}.biases"] = scales, biases
        if (group, bits) != default:
            quant[path] = {"group_size": group, "bits": bits}
    (directory / "config.json").write_text(json.dumps({**cfg, "quantization": quant}, indent=2))
    mx.save_safetensors(str(directory / "model.safetensors"), arrays)
    return directory


def stored_weights(directory: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as float64 numpy (bf16 values, exactly)."""
    loaded = mx.load(str(directory / "model.safetensors"))
    return {k: np.array(v.astype(mx.float32)).astype(np.float64) for k, v in loaded.items()}


# -- numpy reference of the upstream forward -----------------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """HF rotate_half RoPE on (tokens, heads, dim)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def _conv(x: np.ndarray, dyn: np.ndarray, base: np.ndarray, g: int) -> np.ndarray:
    """z-lab `_grouped_dynamic_convolve` for one block: x (L, H), dyn (L, K, G), base (K, H)."""
    out = np.zeros_like(x)
    for t in range(base.shape[0]):
        shifted = np.concatenate([np.zeros_like(x[:t]), x[: len(x) - t]]) if t else x
        out += (base[t][None] + np.repeat(dyn[:, t], g, axis=-1)) * shifted
    return out


def reference_hidden(
    cfg: dict[str, Any],
    w: dict[str, np.ndarray],
    feats: np.ndarray,
    block: np.ndarray,
    embed: np.ndarray,
) -> np.ndarray:
    """Normed drafter hidden states of one block whose anchor sits right after `feats` rows:
    keys/values = [projected context ; block], one attention (HF style, upstream masks)."""
    dc = cfg.get("dflash_config", {})
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    s, b = len(feats), len(block)
    ctx = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = embed[block]
    qpos, kpos = s + np.arange(b), np.arange(s + b)
    window = (
        cfg.get("sliding_window") if "sliding_attention" in cfg.get("layer_types", []) else None
    )
    causal = cfg.get("is_causal", window is not None) if dc else False
    visible = np.ones((b, s + b), bool)
    if window:
        visible &= (qpos[:, None] - kpos[None] < window) & (kpos[None] - qpos[:, None] < window)
    if causal:
        visible &= kpos[None] <= qpos[:, None]
    conv = "layers.0.attention_conv.base_kernel" in w
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        if conv:
            g = dc["conv_group_size"]
            dyn = (h @ w[p + "attention_conv.kernel_projection.weight"].T).reshape(b, 2, 2, -1)
            h = _conv(h, dyn[:, 0], w[p + "attention_conv.base_kernel"][0], g)
        q = _rms(
            (h @ w[p + "self_attn.q_proj.weight"].T).reshape(b, nh, hd),
            w[p + "self_attn.q_norm.weight"],
        )
        kin = np.concatenate([ctx, h])
        k = _rms(
            (kin @ w[p + "self_attn.k_proj.weight"].T).reshape(s + b, nkv, hd),
            w[p + "self_attn.k_norm.weight"],
        )
        v = (kin @ w[p + "self_attn.v_proj.weight"].T).reshape(s + b, nkv, hd)
        q, k = _rope(q, qpos, theta), _rope(k, kpos, theta)
        heads = []
        for j in range(nh):
            kv = j // (nh // nkv)
            sc = q[:, j] @ k[:, kv].T / np.sqrt(hd)
            sc = np.where(visible, sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            heads.append((pr / pr.sum(-1, keepdims=True)) @ v[:, kv])
        a = np.concatenate(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
        if conv:
            a = _conv(a, dyn[:, 1], w[p + "attention_conv.base_kernel"][1], g)
        x = x + a
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        if conv:
            dyn = (h @ w[p + "mlp_conv.kernel_projection.weight"].T).reshape(b, 2, 2, -1)
            h = _conv(h, dyn[:, 0], w[p + "mlp_conv.base_kernel"][0], g)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        m = (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"
        ].T
        if conv:
            m = _conv(m, dyn[:, 1], w[p + "mlp_conv.base_kernel"][1], g)
        x = x + m
    return _rms(x, w["norm.weight"])


def reference_dspark(cfg, w, hidden, anchor):
    """DeepSpec's left-to-right sampling (greedy): per-slot corrected logits, tokens, confidences."""
    logits, tokens, confs = [], [], []
    prev = anchor
    base = hidden @ w["lm_head.weight"].T
    for j in range(len(hidden)):
        row = base[j].copy()
        if cfg["markov_rank"]:
            row += w["markov_head.markov_w2.weight"] @ w["markov_head.markov_w1.weight"][prev]
        if cfg["enable_confidence_head"]:
            f = hidden[j]
            if cfg["confidence_head_with_markov"]:
                f = np.concatenate([f, w["markov_head.markov_w1.weight"][prev]])
            confs.append(
                float(w["confidence_head.proj.weight"][0] @ f + w["confidence_head.proj.bias"][0])
            )
        logits.append(row)
        prev = int(np.argmax(row))
        tokens.append(prev)
    return np.array(logits), tokens, confs


def reference_selector(cfg, w, hidden, head, anchor):
    """z-lab CandidateSelector.select (greedy) over slots 1.. with the target's head."""
    dc = cfg["dflash_config"]
    logits = hidden @ head.T * dc.get("output_multiplier", 1.0)
    proj = hidden @ w["candidate_selector.hidden_projection.weight"].T
    pred_cb, succ_cb = (
        w["candidate_selector.predecessor_codebook"],
        w["candidate_selector.successor_codebook"],
    )
    prev, out = anchor, []
    for j in range(len(hidden)):
        cands = np.argsort(-logits[j])[: dc["selector_top_k"]]
        scores = logits[j][cands] + succ_cb[cands] @ (pred_cb[prev] * proj[j])
        prev = int(cands[np.argmax(scores)])
        out.append((cands, scores, prev))
    return out


# -- a tiny teacher-forced trainer (DeepSpec/z-lab training layout, batched over anchors) --------


def _mx_rope(x: mx.array, pos: mx.array, theta: float) -> mx.array:
    d = x.shape[-1]
    inv = theta ** (-mx.arange(0, d, 2, dtype=mx.float32) / d)
    ang = pos[:, None].astype(mx.float32) * inv[None]
    cos, sin = mx.cos(mx.concatenate([ang, ang], -1)), mx.sin(mx.concatenate([ang, ang], -1))
    rot = mx.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def block_logits(model, embed, head, feats, seq, anchors, block, mask_id, theta=1000000.0):
    """Logits (anchors, block, vocab) of every anchor's block at once: block rows see the context
    rows before their anchor and their own block (bidirectionally), as in DeepSpec's
    create_dspark_attention_mask. Uses the drafter module's layers, not its inference path."""
    a_n, t_n = len(anchors), feats.shape[1]
    anchors_mx = mx.array(anchors)
    ctx = model.hidden_norm(model.fc(feats))[0]
    ids = mx.array([[seq[a]] + [mask_id] * (block - 1) for a in anchors]).reshape(-1)
    x = embed(ids)
    qpos = (anchors_mx[:, None] + mx.arange(block)[None]).reshape(-1)
    kpos = mx.concatenate([mx.arange(t_n), qpos])
    q_anchor = mx.repeat(anchors_mx, block)
    q_blk = mx.arange(a_n * block) // block
    visible = mx.concatenate(
        [mx.arange(t_n)[None] < q_anchor[:, None], q_blk[:, None] == q_blk[None]], 1
    )
    for layer in model.layers:
        att = layer.self_attn
        h = layer.input_layernorm(x)
        q = _mx_rope(att.q_norm(att.q_proj(h).reshape(a_n * block, att.n_heads, -1)), qpos, theta)
        kin = mx.concatenate([ctx, h])
        k = _mx_rope(att.k_norm(att.k_proj(kin).reshape(kin.shape[0], att.n_kv, -1)), kpos, theta)
        v = att.v_proj(kin).reshape(kin.shape[0], att.n_kv, -1)
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(1, 0, 2)[None],
            k.transpose(1, 0, 2)[None],
            v.transpose(1, 0, 2)[None],
            scale=att.scale,
            mask=visible,
        )
        x = x + att.o_proj(out[0].transpose(1, 0, 2).reshape(a_n * block, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return head(model.norm(x)).reshape(a_n, block, -1)


def train_block_drafter(drafter, feats, seq, steps=300, lr=3e-3, seed=0):
    """Fit a loaded (float32) drafter to predict `seq` from the target features `feats` in the
    drafter's own slot convention; returns the final loss."""
    import mlx.nn as nn
    import mlx.optimizers as optim

    mx.random.seed(seed)
    model, spec = drafter.model, drafter.spec
    b, first = spec.block_size, drafter.first_slot
    dspark = "embed_tokens" in model
    embed = model.embed_tokens if dspark else drafter.embed
    head = model.logits if dspark else drafter._head
    if dspark:  # DeepSpec copies the target's embedding and head into the drafter, frozen
        model.embed_tokens.freeze()
        if "lm_head" in model:
            model.lm_head.freeze()
    anchors = list(range(1, len(seq) - b - 1))
    # Slot j of the block predicts the token j + 1 - first places after the anchor.
    labels = mx.array([[seq[a + j + 1 - first] for j in range(first, b)] for a in anchors])
    markov = model.get("markov_head")
    prev = mx.array([[seq[a + j - first] for j in range(first, b)] for a in anchors])

    def loss_fn(m):
        logits = block_logits(m, embed, head, feats, seq, anchors, b, spec.mask_token_id)[:, first:]
        if markov is not None:  # teacher-forced previous tokens, as DeepSpec trains the head
            logits = logits + m.markov_head.markov_w2(m.markov_head.markov_w1(prev))
        return nn.losses.cross_entropy(logits, labels, reduction="mean")

    opt = optim.Adam(learning_rate=lr)
    step = nn.value_and_grad(model, loss_fn)
    for _ in range(steps):
        loss, grads = step(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    return float(loss.item())
