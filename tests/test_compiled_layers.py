"""Compiled verify layers (verifier option `compile_layers`): the same values as the stock
forward, only inside the verifier's scope, undone by `restore`, and lossless end to end."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from dspark_flow.models.compiled_layers import (
    CompiledLayers,
    attention_supported,
    compiled_scope,
)
from tests.tiny import tiny_model

CONTEXT = [(17 * i + 3) % 4000 + 100 for i in range(40)]


def _forwards(model, rows_list, compiled=None):
    """Logits of a forward of each row count after the same context (the cache trimmed back)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([CONTEXT]), cache=cache))
    out = []
    for rows in rows_list:
        ids = mx.array([[(31 * r + 7) % 4000 + 50 for r in range(rows)]])
        with compiled_scope(compiled):
            logits = model(ids, cache=cache)
        mx.eval(logits)
        out.append(logits)
        trim_prompt_cache(cache, rows)
    return out


def test_compiled_layers_compute_the_stock_values_bit_for_bit(embedded):
    model, _ = embedded
    rows = [1, 2, 5, 8, 16, 17]  # 17: past max_rows, the stock path
    stock = _forwards(model, rows)
    compiled = CompiledLayers(max_rows=16)
    try:
        n_layers = len(model.model.layers)
        assert compiled.install(model) == 2 * n_layers
        assert (compiled.attention_layers, compiled.mlp_layers) == (n_layers, n_layers)
        mine = _forwards(model, rows, compiled)
        # compiled functions for every attention and MLP (each traced per row count)
        assert len(compiled._fns) == 2 * n_layers
    finally:
        compiled.restore()
    for r, a, b in zip(rows, stock, mine, strict=True):
        assert mx.array_equal(a, b).item(), f"{r} rows differ"


def test_the_compiled_path_runs_only_inside_the_scope_and_restore_undoes_the_swap(embedded):
    model, _ = embedded
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    classes = (type(attn), type(mlp))
    first, second = CompiledLayers(max_rows=16), CompiledLayers(max_rows=16)
    try:
        first.install(model)
        assert type(attn).__name__.startswith("Compiled") and isinstance(attn, classes[0])
        second.install(model)  # a second verifier on the same model: no second swap
        assert type(attn).__mro__[1] is classes[0]
        _forwards(model, [1, 3])  # outside any scope: nothing traced
        assert not first._fns and not second._fns
        _forwards(model, [3], second)
        assert second._fns and not first._fns
    finally:
        second.restore()
        first.restore()
    assert (type(attn), type(mlp)) == classes


def test_unsupported_attention_keeps_the_stock_path():
    """Only the llama-family attention with a plain rotary embedding is reproduced; anything
    else (here: a qwen3-style attention with q/k norms) keeps its own forward, its MLP is still
    compiled, and the values stay the stock ones."""
    import mlx.nn as nn

    model = tiny_model(seed=3)
    attn = model.model.layers[0].self_attn
    assert attention_supported(attn)
    attn.q_norm = nn.RMSNorm(16)  # not called by llama's forward: only makes it look unsupported
    assert not attention_supported(attn)
    stock = _forwards(model, [1, 4])
    compiled = CompiledLayers(max_rows=16)
    try:
        assert compiled.install(model) == 1 and compiled.mlp_layers == 1
        mine = _forwards(model, [1, 4], compiled)
    finally:
        compiled.restore()
    assert all(mx.array_equal(a, b).item() for a, b in zip(stock, mine, strict=True))


@pytest.mark.parametrize("verifier", ["reference", "kernels"])
def test_speculation_with_compiled_layers_reproduces_greedy(embedded, verifier):
    """The shipped DSpark drafter reads the target's hidden states through taps on its decoder
    layers: they must still record with the layers' insides compiled."""
    from dspark_flow.pipeline import Pipeline

    v = {"kind": verifier, "compile_layers": True}
    greedy = Pipeline.from_dict({"verifier": {"kind": "reference"}}, target=embedded).warm_up()
    spec = Pipeline.from_dict(
        {
            "verifier": v,
            "drafter": {"kind": "dspark", "checkpoint": "builtin:smollm2-135m-dspark"},
            "draft_cap": {"kind": "fixed", "k": 4},
        },
        target=embedded,
    ).warm_up()
    try:
        assert spec.verifier.compiled is not None and spec.verifier.compiled.attention_layers
        for prompt in ["Write a Python function that reverses a list.", "What is 12 * 13?"]:
            want = greedy.generate(prompt, max_new_tokens=40)
            got = spec.generate(prompt, max_new_tokens=40)
            assert got.token_ids == want.token_ids
            assert got.mean_accept_len > 1.0  # the drafter's features arrived
    finally:
        spec.verifier.compiled.restore()


def test_compiled_layers_key_their_own_cost_curves():
    """Calibrated curves time the verifier's forward: compiled layers cost what they cost, so
    they are keyed apart from the plain forward (and the plain forward's key is unchanged)."""
    from dspark_flow.calibration.controller import config_identity
    from dspark_flow.strategies.verifiers.kernels import KernelsConfig
    from dspark_flow.strategies.verifiers.reference import ReferenceConfig

    assert config_identity(None) == config_identity(ReferenceConfig()) == "reference"
    compiled = config_identity(ReferenceConfig(compile_layers=True))
    assert compiled != "reference" and '"compile_layers": true' in compiled
    on, off = (config_identity(KernelsConfig(compile_layers=c)) for c in (True, False))
    assert on != off


# -- the drafter's layers (drafter option `compile_layers`) -----------------------------------


def _backbone(conv: int = 0, bits: int | None = None, dtype=mx.float32):
    import mlx.nn as nn

    from dspark_flow.models.drafter_backbone import BackboneConfig, DrafterBackbone

    mx.random.seed(3)
    cfg = BackboneConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, num_taps=2, conv_kernel_size=conv,
                         conv_group_size=16 if conv else 0)  # fmt: skip
    model = DrafterBackbone(cfg)
    if conv:  # the convolutions' base kernels start at zero: make them count
        for layer in model.layers:
            for c in (layer.attention_conv, layer.mlp_conv):
                c.base_kernel = mx.random.normal(c.base_kernel.shape) * 0.1
    model.set_dtype(dtype)
    if bits is not None:  # as GPU backends load the shipped drafter (quantize: auto)
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def _drafter_rounds(model):
    """Hidden states of three rounds (a 30-row prompt context, then 3 and 5 committed rows)."""
    from dspark_flow.models.drafter_backbone import ContextKV

    state, out = ContextKV(len(model.layers)), []
    for i, rows in enumerate([30, 3, 5]):
        mx.random.seed(10 + i)
        model.extend_context(state, mx.random.normal((1, rows, 128)))
        block = model(state, mx.random.normal((1, 8, 64)).astype(model.compute_dtype()))
        mx.eval(block)
        out.append(block)
    return out, state


@pytest.mark.parametrize("bits, dtype", [(None, mx.float32), (4, mx.float32), (4, mx.bfloat16)])
def test_compiled_drafter_layers_compute_the_same_values_bit_for_bit(bits, dtype):
    model = _backbone(bits=bits, dtype=dtype)
    want, want_state = _drafter_rounds(model)
    assert model.compile_layers(max_context_rows=9) == 2
    got, got_state = _drafter_rounds(model)
    for a, b in zip(want + want_state.keys + want_state.values,
                    got + got_state.keys + got_state.values, strict=True):  # fmt: skip
        assert mx.array_equal(a, b).item()


def test_dflash2_convolution_layers_keep_the_plain_path():
    model = _backbone(conv=2)
    want, _ = _drafter_rounds(model)
    assert model.compile_layers() == 0  # the convolutions are not in the compiled parts
    got, _ = _drafter_rounds(model)
    assert all(mx.array_equal(a, b).item() for a, b in zip(want, got, strict=True))


def test_shipped_drafter_with_compiled_layers_drafts_as_before(embedded):
    """Same drafts (acceptance per round) and greedy's output, with the option on and off."""
    from dspark_flow.pipeline import Pipeline

    recipe = {
        "drafter": {"kind": "dspark", "checkpoint": "builtin:smollm2-135m-dspark"},
        "draft_cap": {"kind": "fixed", "k": 6},
    }
    greedy = Pipeline.from_dict({}, target=embedded).warm_up()
    off = {**recipe, "drafter": {**recipe["drafter"], "compile_layers": False}}
    plain = Pipeline.from_dict(off, target=embedded).warm_up()
    compiled = Pipeline.from_dict(recipe, target=embedded).warm_up()  # the default
    assert (
        compiled.components.drafter.model._compiled and not plain.components.drafter.model._compiled
    )
    prompt = "Write a Python function that reverses a list."
    want = greedy.generate(prompt, max_new_tokens=40).token_ids
    a = plain.generate(prompt, max_new_tokens=40)
    b = compiled.generate(prompt, max_new_tokens=40)
    assert a.token_ids == b.token_ids == want
    assert a.accept_lengths == b.accept_lengths and a.mean_accept_len > 1.0
