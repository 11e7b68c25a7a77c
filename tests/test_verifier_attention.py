"""The target's attention in the `reference` verifier (option `attention`): for 2 or more
queries it can run as plain MLX matmuls (`matmul_verify_attention`), which agree with MLX's
fused attention, decline what they do not compute, keep the output greedy's, and are what
`auto` takes for half-precision attention on CUDA only."""

from __future__ import annotations

import dspark_flow  # noqa: F401  (first: OpenBLAS must bind before mlx.core, see models/backend.py)

# isort: split
import json
import sys

import mlx.core as mx
import pytest

from dspark_flow.models import attention
from dspark_flow.models.attention import (
    MATMUL_MAX_KEYS,
    MATMUL_MAX_SCORES,
    matmul_verify_attention,
)
from dspark_flow.strategies.verifiers import reference
from dspark_flow.strategies.verifiers.reference import ReferenceConfig, ReferenceVerifier

pytestmark = pytest.mark.usefixtures("attention_unwrapped")


def _qkv(rows: int, keys: int, heads: int, kv_heads: int, dtype: mx.Dtype, seed: int = 0):
    mx.random.seed(seed)
    shape = ((1, heads, rows, 64), (1, kv_heads, keys, 64), (1, kv_heads, keys, 64))
    return [(mx.random.normal(s) + 0.1).astype(dtype) for s in shape]  # never zeros


@pytest.mark.parametrize(
    "dtype, atol", [(mx.float32, 1e-5), (mx.float16, 4e-3), (mx.bfloat16, 3e-2)]
)
@pytest.mark.parametrize(
    "rows, keys, heads, kv_heads", [(2, 2, 4, 4), (3, 40, 9, 3), (8, 300, 8, 2), (16, 17, 6, 1)]
)
@pytest.mark.parametrize("mask", [None, "causal"])
def test_matmul_verify_attention_agrees_with_mlx_fused_attention(
    dtype, atol, rows, keys, heads, kv_heads, mask
):
    """The verify's queries are the last `rows` of `keys` positions (a KV cache before them)."""
    q, k, v = _qkv(rows, keys, heads, kv_heads, dtype)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = matmul_verify_attention(q, k, v, None, 0.125, mask, None)
    assert got is not None and got.dtype == dtype and got.shape == want.shape
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=atol).item()


class _QuantizedCache:
    bits = 4


@pytest.mark.parametrize(
    "case",
    ["one query", "sinks", "quantized cache", "array mask", "too many scores", "too many keys",
     "batch of 2"],
)  # fmt: skip
def test_matmul_verify_attention_declines_what_it_does_not_compute(case):
    rows, keys = (1, 30) if case == "one query" else (4, 30)
    if case == "too many scores":
        rows, keys = 128, MATMUL_MAX_SCORES // 128 + 1
    elif case == "too many keys":
        keys = MATMUL_MAX_KEYS + 1
    q, k, v = _qkv(rows, keys, 4, 2, mx.float32)
    cache, mask, sinks = None, "causal", None
    if case == "sinks":
        sinks = mx.zeros((4,))
    elif case == "quantized cache":  # mlx-lm hands over keys and values as (data, scales, biases)
        cache, k, v = _QuantizedCache(), (k, k, k), (v, v, v)
    elif case == "array mask":
        mask = mx.ones((rows, keys), dtype=mx.bool_)
    elif case == "batch of 2":
        q, k, v = (mx.concatenate([a, a]) for a in (q, k, v))
    assert matmul_verify_attention(q, k, v, cache, 0.125, mask, sinks) is None


@pytest.mark.parametrize(
    "choice, backend, routed",
    [("auto", "cuda", {mx.bfloat16, mx.float16}), ("auto", "cpu", set()), ("auto", "metal", set()),
     ("matmul", "cpu", {mx.bfloat16, mx.float16, mx.float32}), ("fused", "cuda", set())],
)  # fmt: skip
def test_auto_takes_matmul_attention_for_half_precision_on_cuda_only(
    monkeypatch, choice, backend, routed
):
    """cuDNN (half precision on CUDA) is what plans each key length; float32 keeps MLX's own."""
    monkeypatch.setattr(attention, "backend_name", lambda: backend)
    route = ReferenceConfig(attention=choice).attention_route()
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        q, k, v = _qkv(4, 30, 4, 2, dtype)
        taken = route is not None and route(q, k, v, None, 0.125, "causal", None) is not None
        assert taken is (dtype in routed)


def test_matmul_verifies_keep_greedy_output_and_restore_gives_mlx_lm_its_function(
    embedded, monkeypatch
):
    """The real embedded target, a DFlash drafter drafting its full block (8-row verifies):
    with the matmul attention the prefill's and every verify's attention go through it, and the output is
    greedy's, token for token; `restore` puts mlx-lm's function back."""
    from dspark_flow.pipeline import Pipeline

    model, _ = embedded
    module = sys.modules[type(model).__module__]
    stock = module.scaled_dot_product_attention
    taken: list[int] = []

    def counting(q, *args):
        out = matmul_verify_attention(q, *args)
        if out is not None:
            taken.append(q.shape[2])
        return out

    monkeypatch.setattr(reference, "matmul_verify_attention", counting)

    def pipeline(verifier: dict | None) -> Pipeline:
        recipe = {
            "drafter": {"kind": "dflash", "checkpoint": "builtin:smollm2-135m-dflash"},
            "draft_cap": {"kind": "full_block"},
        }
        if verifier is None:  # greedy, MLX's own attention wherever this runs
            greedy = {"verifier": {"kind": "reference", "attention": "fused"}}
            return Pipeline.from_dict(greedy, target=embedded).warm_up()
        return Pipeline.from_dict({**recipe, "verifier": verifier}, target=embedded).warm_up()

    prompt = "Write a Python function that returns the squares of a list of numbers."
    want = pipeline(None).generate(prompt, max_new_tokens=40).token_ids
    fused = pipeline({"kind": "reference", "attention": "fused"})
    assert module.scaled_dot_product_attention is stock  # fused wraps nothing
    matmul = pipeline({"kind": "reference", "attention": "matmul"})
    assert module.scaled_dot_product_attention is not stock
    a = fused.generate(prompt, max_new_tokens=40)
    assert not taken
    b = matmul.generate(prompt, max_new_tokens=40)
    assert a.token_ids == b.token_ids == want
    assert b.mean_accept_len > 1.0
    # every layer's: the prompt's prefill, then the verifies (full blocks of 8 rows, fewer
    # only as the token limit nears)
    layers = len(model.model.layers)
    assert len(taken) % layers == 0 and taken[0] > 8 and taken.count(8) >= layers
    matmul.components.verifier.restore()
    assert module.scaled_dot_product_attention is stock
    assert not attention._WRAPPED


def test_a_bad_verifier_attention_fails_in_one_line(tmp_path):
    from dspark_flow.errors import RecipeError
    from dspark_flow.recipe.load import load_recipe

    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"version": 1, "verifier": {"kind": "reference", "attention": 2}}))
    with pytest.raises(RecipeError) as err:
        load_recipe(bad)
    message = str(err.value)
    assert "attention" in message and "\n" not in message.strip()


def test_a_verifier_collected_without_restore_drops_its_claim(embedded):
    """One-call APIs never restore their pipeline; the wrapper must not outlive every user."""
    import gc

    from dspark_flow.strategy import BuildContext

    module = sys.modules[type(embedded[0]).__module__]
    stock = module.scaled_dot_product_attention
    verifier = ReferenceVerifier(ReferenceConfig(attention="matmul"))
    verifier.warm_up(BuildContext(model=embedded[0], tokenizer=embedded[1], recipe=None))
    assert attention._WRAPPED and module.scaled_dot_product_attention is not stock
    del verifier
    gc.collect()
    assert not attention._WRAPPED and module.scaled_dot_product_attention is stock


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """The query rows of every call a reference verifier built afterwards hands its matmul route."""
    asked: list[int] = []

    def counting(q, *args, **kwargs):
        asked.append(q.shape[2])
        return matmul_verify_attention(q, *args, **kwargs)

    monkeypatch.setattr(reference, "matmul_verify_attention", counting)
    return asked


def test_a_verifier_routes_only_the_model_it_warmed_up(embedded, calls):
    """The wrapper is per module, so another verifier's forward on the same model class must
    not take this verifier's route (a benchmark's stock baseline beside a routed arm)."""
    from mlx_lm.models.cache import make_prompt_cache

    from dspark_flow.strategy import BuildContext

    model, tok = embedded
    warmed = ReferenceVerifier(ReferenceConfig(attention="matmul"))
    warmed.warm_up(BuildContext(model=model, tokenizer=tok, recipe=None))
    cold = ReferenceVerifier(ReferenceConfig(attention="matmul"))  # never warmed up
    mx.eval(cold.forward(model, [1, 2, 3], make_prompt_cache(model)))
    assert not calls
    mx.eval(warmed.forward(model, [1, 2, 3], make_prompt_cache(model)))
    assert calls and set(calls) == {3}
    warmed.restore()


def test_the_kernels_and_reference_verifiers_share_the_wrapper(
    embedded, calls, monkeypatch, tmp_path
):
    """Both verifiers wrap mlx-lm's attention function through one wrapper per module: each
    restore drops only its own claim, and each forward takes only its own route."""
    from mlx_lm.models.cache import make_prompt_cache

    from dspark_flow.kernels import probe
    from dspark_flow.strategies.verifiers.kernels import KernelsConfig, KernelVerifier
    from dspark_flow.strategy import BuildContext

    monkeypatch.setenv(probe.CACHE_ENV, str(tmp_path / "kernel-cache"))  # its verdicts: here
    model, tok = embedded
    module = sys.modules[type(model).__module__]
    stock = module.scaled_dot_product_attention
    ctx = BuildContext(model=model, tokenizer=tok, recipe=None)
    kernels = KernelVerifier(KernelsConfig(invariant=True))  # on the CPU: chunked attention
    kernels.warm_up(ctx)
    assert module.scaled_dot_product_attention is not stock
    routed = ReferenceVerifier(ReferenceConfig(attention="matmul"))
    routed.warm_up(ctx)
    tokens = [504, 2365, 6354]
    mx.eval(kernels.forward(model, tokens, make_prompt_cache(model)))
    assert not calls and kernels.attention_calls > 0  # its own route only
    kernels.restore()
    assert module.scaled_dot_product_attention is not stock  # still the reference's
    mx.eval(routed.forward(model, tokens, make_prompt_cache(model)))
    assert set(calls) == {3}
    routed.restore()
    assert module.scaled_dot_product_attention is stock and not attention._WRAPPED
