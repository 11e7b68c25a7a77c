"""Fused projections (verifier option `fuse_projections`): a stacked q/k/v or gate/up matmul
computes the separate projections bit for bit, the separate ones keep their values as views of
the stacked weights, and speculation through fused layers reproduces greedy."""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dspark_flow.kernels import probe
from dspark_flow.kernels import qmm_small_m as q
from dspark_flow.models.compiled_layers import CompiledLayers
from dspark_flow.models.fused_projections import FusedProjections, mlp_fusable, stack_linears
from dspark_flow.pipeline import Pipeline
from dspark_flow.strategies.verifiers.kernels import KernelsConfig, KernelVerifier
from tests.test_compiled_layers import _forwards
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def native():
    """The embedded target in its own 4-bit weights (a CPU verifies K rows at K times one: the
    tests below keep their forwards few)."""
    from dspark_flow.api import load_target

    return load_target(weights="native")


def _parts(kind: str, widths=(96, 32, 32), bias: bool = False) -> list[nn.Module]:
    mx.random.seed(5)
    parts = [nn.Linear(64, n, bias=bias) for n in widths]
    if bias:  # zero-initialised: make them count
        for p in parts:
            p.bias = mx.random.normal(p.bias.shape)
    if kind.endswith("bf16"):
        for p in parts:
            p.set_dtype(mx.bfloat16)
    if kind.startswith("q"):
        bits, group = {"q4": (4, 32), "q8": (8, 64)}[kind.split("-")[0]]
        parts = [nn.QuantizedLinear.from_linear(p, group, bits) for p in parts]
    mx.eval([p.parameters() for p in parts])
    return parts


@pytest.mark.parametrize("kind", ["q4", "q8", "q4-bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_stack_computes_its_parts_bit_for_bit_and_they_keep_their_values(kind, bias):
    parts = _parts(kind, bias=bias)
    xs = [mx.random.normal((1, rows, 64)) for rows in range(1, 17)]
    if kind.endswith("bf16"):
        xs = [x.astype(mx.bfloat16) for x in xs]
    before = [[np.array(p(x).astype(mx.float32)) for p in parts] for x in xs]
    fused = stack_linears(parts)
    assert fused is not None and fused.splits == (96, 128)
    assert type(fused.module) is type(parts[0])
    for x, want in zip(xs, before, strict=True):
        got = mx.split(fused.module(x), list(fused.splits), axis=-1)
        for a, b, p in zip(got, want, parts, strict=True):
            assert np.array_equal(np.array(a.astype(mx.float32)), b)  # the stack
            assert np.array_equal(np.array(p(x).astype(mx.float32)), b)  # the part, now a view


def test_parts_become_views_no_memory_is_added():
    parts = _parts("q8", widths=(1024, 1024, 1024))
    gc.collect()
    before = mx.get_active_memory()
    fused = stack_linears(parts)
    gc.collect()
    stacked = sum(v.nbytes for v in (fused.module.weight, fused.module.scales))
    assert mx.get_active_memory() - before < 0.1 * stacked


def test_layers_that_cannot_be_stacked_are_left_alone():
    assert stack_linears(_parts("f32")) is None  # dense: not the same arithmetic stacked
    assert stack_linears(_parts("q4") + _parts("f32")[:1]) is None  # quantized beside dense
    four, eight = _parts("q4"), _parts("q8")
    assert stack_linears([four[0], eight[1]]) is None  # other bits
    widths = [nn.QuantizedLinear.from_linear(nn.Linear(k, 32), 32, 4) for k in (64, 128)]
    assert stack_linears(widths) is None  # other input widths
    biased = [nn.QuantizedLinear.from_linear(nn.Linear(64, 32, bias=b), 32, 4) for b in (1, 0)]
    assert stack_linears(biased) is None  # one biased, one not

    assert len(FusedProjections.install(tiny_model(seed=4))) == 0  # dense: nothing stacked
    model = tiny_model(seed=4)
    nn.quantize(model, group_size=32, bits=4)
    mlp = model.model.layers[0].mlp

    class OwnMLP(type(mlp)):  # a user's MLP with its own forward is not reproduced
        def __call__(self, x):
            return self.down_proj(nn.gelu(self.gate_proj(x)) * self.up_proj(x))

    assert mlp_fusable(mlp)
    mlp.__class__ = OwnMLP
    assert not mlp_fusable(mlp)
    fused = FusedProjections.install(model)
    assert len(fused) == 1 and fused.of(mlp) is None  # q/k/v stacked, the MLP not
    assert FusedProjections.install(model) is fused  # a second verifier: the same stacks
    attn = model.model.layers[0].self_attn
    attn.q_proj = nn.QuantizedLinear.from_linear(nn.Linear(32, 32, bias=False), 32, 4)
    again = FusedProjections.install(model)  # a part's weights were replaced: stacked afresh
    assert again is not fused and again.of(attn).module.weight[:4].shape == (4, 4)


def test_only_attentions_the_compiled_layers_run_are_stacked():
    """A qwen3-style attention (q/k norms) keeps its own forward, which calls q/k/v: stacking
    them would leave the parts it calls unrouted by the kernels verifier."""
    model = tiny_model(seed=6)
    nn.quantize(model, group_size=32, bits=4)
    model.model.layers[0].self_attn.q_norm = nn.RMSNorm(16)
    fused = FusedProjections.install(model)
    assert fused.of(model.model.layers[0].self_attn) is None
    assert fused.of(model.model.layers[0].mlp) is not None


@pytest.mark.slow
def test_fused_compiled_layers_compute_the_stock_values_bit_for_bit(native):
    model = native[0]
    rows = [1, 3, 16, 17]  # 17: past max_rows, the stock path through the parts
    stock = _forwards(model, rows)
    fused = FusedProjections.install(model)
    assert len(fused) == 2 * len(model.model.layers)
    compiled = CompiledLayers(max_rows=16, fused=fused)
    try:
        compiled.install(model)
        mine = _forwards(model, rows, compiled)
    finally:
        compiled.restore()
    for r, a, b in zip(rows, stock, mine, strict=True):
        assert mx.array_equal(a, b).item(), f"{r} rows differ"


def test_fusion_without_compiled_layers_does_nothing():
    """Only the compiled path calls the stacks; `--set verifier.compile_layers=false` on the
    CLI's stack (which fuses) must still build."""
    model = tiny_model(seed=7)
    nn.quantize(model, group_size=32, bits=4)
    from dspark_flow.api import load_target

    target = (model, load_target()[1])
    pipe = Pipeline.from_dict(
        {"verifier": {"kind": "reference", "fuse_projections": True}}, target=target
    ).warm_up()
    assert pipe.verifier.compiled is None and not pipe.verifier.config.fusing


def test_the_kernels_verifier_routes_the_stacks_not_their_parts(monkeypatch):
    """The stacks are probed and routed like any layer (here the emulated kernel "wins" for 2..4
    rows); their parts, which verify forwards no longer call, are not; output = greedy's."""
    model = tiny_model(seed=3)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    from dspark_flow.api import load_target

    target = (model, load_target()[1])

    def timer(kernel, twin, inputs, **_):
        rows = inputs[0].shape[2] if isinstance(inputs[3], float) else inputs[0].shape[0]
        return (1.0, 2.0) if 2 <= rows <= 4 else (2.0, 1.0)

    monkeypatch.setattr(probe, "time_pair", timer)
    widths = []

    def kernel(*args):
        widths.append(args[1].shape[0])
        return q.qmm_small_m_emulated(*args)

    config = KernelsConfig(max_rows=4, compile_layers=True, fuse_projections=True)
    verifier = KernelVerifier(config, kernel=kernel)
    recipe = {
        "drafter": {"kind": "lookup"},
        "draft_cap": {"kind": "fixed", "k": 3},
        "stop": [{"kind": "max_tokens", "limit": 16}],
    }
    spec = Pipeline.from_dict(recipe, target=target, verifier=verifier).warm_up()
    try:
        layer = model.model.layers[0]
        stacks = verifier.fused.stacks
        assert len(stacks) == 2
        routes = verifier._router.routes
        assert all(id(s) in routes for s, _ in stacks)
        assert not any(id(p) in routes for _, parts in stacks for p in parts)
        greedy_recipe = {**recipe, "drafter": {"kind": "none"}}
        greedy = Pipeline.from_dict(greedy_recipe, target=target)
        prompt = [504, 2365, 6354, 504, 2365, 6354, 504, 2365]
        want = greedy.generate(prompt).token_ids
        verifier.compiled.reset()  # trace again, to see which matmuls the traces run
        widths.clear()
        assert spec.generate(prompt).token_ids == want
        qkv = layer.self_attn.q_proj.weight.shape[0] + 2 * layer.self_attn.k_proj.weight.shape[0]
        gate_up = 2 * layer.mlp.up_proj.weight.shape[0]
        assert {qkv, gate_up} <= set(widths)  # the stacks ran through the kernel
    finally:
        verifier.restore()


@pytest.mark.slow
def test_speculation_through_fused_layers_reproduces_greedy_on_the_4bit_target(native):
    """The CLI's verifier stack with fused projections, the shipped DSpark drafter (its taps
    read the target's hidden states), against plain greedy through MLX's stock forward."""
    target = native
    verifier = {"kind": "kernels", "invariant": True, "compile_layers": True,
                "fuse_projections": True}  # fmt: skip
    greedy = Pipeline.from_dict({"verifier": {"kind": "reference"}}, target=target).warm_up()
    spec = Pipeline.from_dict(
        {
            "verifier": verifier,
            "drafter": {"kind": "dspark", "checkpoint": "builtin:smollm2-135m-dspark"},
            "draft_cap": {"kind": "fixed", "k": 4},
        },
        target=target,
    ).warm_up()
    try:
        assert len(spec.verifier.fused) == 2 * len(target[0].model.layers)
        prompt = "Write a Python function that reverses a list."
        want = greedy.generate(prompt, max_new_tokens=32)
        got = spec.generate(prompt, max_new_tokens=32)
        assert got.token_ids == want.token_ids
        assert got.mean_accept_len > 1.0  # the drafter's features arrived
    finally:
        spec.verifier.restore()
