"""The drafters' attention (drafter option `attention`): `matmul_attention` is MLX's fused
attention computed as two matmuls and a softmax (no per-shape plan on CUDA), its values agree
with the fused kernel's, and `auto` takes it on CUDA only."""

from __future__ import annotations

import dspark_flow  # noqa: F401  (first: OpenBLAS must bind before mlx.core, see models/backend.py)

# isort: split
import json

import mlx.core as mx
import pytest

from dspark_flow.models import attention
from dspark_flow.models.attention import matmul_attention


def _random(shape, dtype):
    return (mx.random.normal(shape) + 0.1).astype(dtype)  # never zeros


@pytest.mark.parametrize("dtype, atol", [(mx.float32, 1e-5), (mx.bfloat16, 3e-2)])
@pytest.mark.parametrize(
    "queries, keys, heads, kv_heads", [(1, 9, 4, 4), (7, 50, 9, 3), (8, 300, 8, 2), (3, 20, 6, 1)]
)
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
def test_matmul_attention_agrees_with_mlx_fused_attention(
    dtype, atol, queries, keys, heads, kv_heads, mask
):
    mx.random.seed(queries * keys + heads)
    q = _random((1, heads, queries, 64), dtype)
    k, v = _random((1, kv_heads, keys, 64), dtype), _random((1, kv_heads, keys, 64), dtype)
    m = None
    if mask is not None:
        seen = mx.random.uniform(shape=(queries, keys)) > 0.3
        seen[:, 0] = True  # every query sees a key
        m = seen if mask == "bool" else mx.where(seen, 0.0, -1e9).astype(dtype)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
    got = matmul_attention(q, k, v, 0.125, m)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=atol).item()


def test_drafter_layers_with_matmul_attention_keep_their_values():
    from tests.test_compiled_layers import _backbone, _drafter_rounds

    model = _backbone()
    want, want_state = _drafter_rounds(model)
    model.use_matmul_attention(True)
    assert all(layer.self_attn.matmul_attention for layer in model.layers)
    got, got_state = _drafter_rounds(model)
    for a, b in zip(want + want_state.keys, got + got_state.keys, strict=True):
        assert mx.allclose(a, b, atol=1e-5).item()


@pytest.mark.parametrize(
    "choice, backend, matmul",
    [("auto", "cuda", True), ("auto", "cpu", False), ("auto", "metal", False),
     ("matmul", "cpu", True), ("fused", "cuda", False)],
)  # fmt: skip
def test_auto_takes_matmul_attention_on_cuda_only(monkeypatch, choice, backend, matmul):
    from dspark_flow.strategies.drafters.dspark import DSparkConfig, DSparkDrafter

    monkeypatch.setattr(attention, "backend_name", lambda: backend)
    assert DSparkDrafter(DSparkConfig(attention=choice)).matmul_attention is matmul


def test_shipped_drafter_with_matmul_attention_drafts_as_before(embedded):
    """On this CPU the shipped drafter drafts the same with either attention (acceptance per
    round), and the output is greedy's."""
    from dspark_flow.pipeline import Pipeline

    def pipeline(attention: str | None) -> Pipeline:
        if attention is None:
            return Pipeline.from_dict({}, target=embedded).warm_up()
        recipe = {
            "drafter": {"kind": "dspark", "checkpoint": "builtin:smollm2-135m-dspark",
                        "attention": attention},
            "draft_cap": {"kind": "fixed", "k": 6},
        }  # fmt: skip
        return Pipeline.from_dict(recipe, target=embedded).warm_up()

    fused, matmul = pipeline("fused"), pipeline("matmul")
    layers = matmul.components.drafter.model.layers
    assert all(layer.self_attn.matmul_attention for layer in layers)
    prompt = "Write a Python function that reverses a list."
    want = pipeline(None).generate(prompt, max_new_tokens=40).token_ids
    a = fused.generate(prompt, max_new_tokens=40)
    b = matmul.generate(prompt, max_new_tokens=40)
    assert a.token_ids == b.token_ids == want
    assert a.accept_lengths == b.accept_lengths and a.mean_accept_len > 1.0


def test_a_bad_attention_choice_fails_in_one_line(tmp_path):
    from dspark_flow.errors import RecipeError
    from dspark_flow.recipe.load import load_recipe

    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"version": 1, "drafter": {"kind": "dflash", "attention": "flash"}}))
    with pytest.raises(RecipeError) as err:
        load_recipe(bad)
    message = str(err.value)
    assert "attention" in message and "\n" not in message.strip()
