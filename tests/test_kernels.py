"""Kernels, their probe and the `kernels` verifier.

On this CPU there is no kernel: the dispatcher must decline (and say why), the twin runs, and the
`kernels` verifier must equal the reference. The kernels' arithmetic (bit layout, group scales)
is checked here through its plain-MLX emulation; the probe is exercised with injected kernels
(fast-but-wrong, correct, failing) and, where a decision needs "faster", a patched timer.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from dspark_flow.kernels import coprefill, probe
from dspark_flow.kernels import qmm_small_m as q
from dspark_flow.pipeline import Pipeline
from dspark_flow.strategies.verifiers.kernels import KernelsConfig, KernelVerifier

# The embedded target's matmuls (N, K): q/o, k/v, gate/up, down; the tied head is (49152, 576).
LINEAR_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)
ROWS = range(1, q.MAX_ROWS + 1)

# These tests pin down the CPU's behaviour (every probe declines). On a GPU backend the same
# checks run through benchmarks/kernels_device.py; here only the kernel-vs-twin test adapts.
ON_CPU = mx.default_device() == mx.cpu
cpu_only = pytest.mark.skipif(not ON_CPU, reason="asserts the CPU backend's declines")


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(probe.CACHE_ENV, str(tmp_path / "kernel-cache"))
    return tmp_path / "kernel-cache"


def _inputs(n: int, k: int, bits: int, group_size: int = 32, rows: int = 16, seed: int = 0):
    return probe.qmm_inputs(rows, n, k, bits, group_size, mx.float32, mx.float32)(seed)


def _fake_timer(kernel_ms: float, twin_ms: float):
    def timer(kernel, twin, inputs, **_):
        kernel(*inputs), twin(*inputs)
        return kernel_ms, twin_ms

    return timer


# -- kernel vs twin --------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [*LINEAR_SHAPES, (2048, 576)])  # a head slice: same K and format
def test_twin_and_kernel_arithmetic_agree_for_every_verify_shape(n, k, bits):
    x, w, s, b, gs, _ = _inputs(n, k, bits)
    emulated = q.qmm_small_m_emulated(x, w, s, b, gs, bits)
    for rows in ROWS:
        out = q.qmm_small_m(x[:rows], w, s, b, gs, bits)
        twin = q.qmm_small_m_reference(x[:rows], w, s, b, gs, bits)
        assert twin.shape == (rows, n) and twin.dtype == mx.float32
        assert probe.relative_error(emulated[:rows], twin) < 1e-5
        if ON_CPU:
            assert out is None  # no kernel on the CPU
            assert "cpu backend" in q.unsupported_reason(x[:rows], w, s, b, gs, bits)
        else:  # a GPU backend runs the real kernel: it must agree with its twin
            assert out is not None and probe.relative_error(out, twin) < 1e-4


@cpu_only
def test_dispatcher_declines_every_probe_shape_and_says_why():
    for n, k in [*LINEAR_SHAPES, HEAD_SHAPE]:
        for bits in (4, 8):
            for rows in ROWS:
                why = q.shape_reason(rows, n, k, bits, 32, mx.float32, mx.float16)
                assert why is not None and "cpu" in why
    # What a GPU backend would still refuse, checked without one.
    f32, f16 = mx.float32, mx.float16
    assert q.shape_reason(1, 576, 576, 4, 32, f32, f16, backend="cuda") is None
    assert "rows" in q.shape_reason(17, 576, 576, 4, 32, f32, f16, backend="cuda")
    assert "format" in q.shape_reason(1, 576, 576, 3, 32, f32, f16, backend="cuda")
    assert "dtypes" in q.shape_reason(1, 576, 576, 4, 32, mx.int32, f16, backend="cuda")
    x, w, s, b, gs, bits = _inputs(64, 64, 4, rows=2)
    assert "biases" in q.unsupported_reason(x, w, s, None, gs, bits, backend="cuda")
    assert "packed" in q.unsupported_reason(x[:, :32], w, s, b, gs, bits, backend="cuda")
    assert q.unsupported_reason(x, w, s, b, gs, bits, backend="cuda") is None
    assert [q.rows_bucket(m) for m in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert [q.lanes_per_column(wpr) for wpr in (72, 144, 40, 8, 1)] == [32, 32, 16, 4, 1]


# -- the probe -------------------------------------------------------------------------------


@cpu_only
def test_probe_declines_cleanly_on_cpu(kernel_cache):
    v = probe.probe_qmm(4, 576, 576, 4, 32, mx.float32, mx.float16)
    assert not v.enabled and "cpu" in v.reason and v.kernel_ms is None
    assert not kernel_cache.exists()  # nothing measured, nothing cached
    assert not coprefill.probe_coprefill(256, 576, 576, 4, 32, mx.float32, mx.float16).enabled


@cpu_only
def test_probe_refuses_a_wrong_kernel_even_when_faster(kernel_cache):
    def fast_but_wrong(x, w, scales, biases, group_size, bits):
        return mx.ones((x.shape[0], w.shape[0]), dtype=x.dtype)  # no work at all

    v = probe.probe_qmm(16, 1536, 576, 4, 32, mx.float32, mx.float32, kernel=fast_but_wrong)
    assert not v.enabled and v.reason.startswith("wrong values")
    assert v.kernel_ms < v.twin_ms  # it really was faster
    stored = json.loads((kernel_cache / probe.CACHE_FILE).read_text())
    assert stored["version"] == probe.CACHE_VERSION
    assert [e["enabled"] for e in stored["entries"].values()] == [False]


@pytest.mark.parametrize(
    "wrong",
    [
        lambda *a: q.qmm_small_m_reference(*a) * 1.001,  # slightly off
        lambda *a: q.qmm_small_m_reference(*a) * mx.nan,  # not finite
        lambda *a: q.qmm_small_m_reference(*a).astype(mx.float16),  # wrong dtype
        lambda *a: q.qmm_small_m_reference(*a)[:, :-1],  # wrong shape
    ],
)
def test_probe_refuses_subtly_wrong_kernels(monkeypatch, wrong):
    monkeypatch.setattr(probe, "time_pair", _fake_timer(1.0, 2.0))
    v = probe.probe_qmm(3, 192, 576, 4, 32, mx.float32, mx.float32, kernel=wrong)
    assert not v.enabled and v.reason.startswith("wrong values")


@cpu_only
def test_probe_cache_is_keyed_and_invalidated(monkeypatch, kernel_cache):
    calls = []

    def good(*a):
        calls.append(1)
        return q.qmm_small_m_reference(*a)

    monkeypatch.setattr(probe, "time_pair", _fake_timer(1.0, 2.0))

    def run(rows=2, n=192, **kw):
        before = len(calls)
        v = probe.probe_qmm(rows, n, 576, 4, 32, mx.float32, mx.float32, kernel=good, **kw)
        return v, len(calls) > before

    v, measured = run()
    assert v.enabled and measured and not v.cached and v.speedup == 2.0
    v, measured = run()
    assert v.enabled and v.cached and not measured  # from the cache, kernel not called
    assert run(rows=3)[1] and run(n=576)[1]  # another shape: probed
    assert run(force=True)[1]  # reprobe on request
    env = dict(probe.environment())
    for field, value in [("mlx", "9.9.9"), ("device", "Other GPU"), ("backend", "cuda")]:
        monkeypatch.setattr(probe, "environment", lambda f=field, v=value: {**env, f: v})
        assert run()[1], field  # changing MLX version / device / backend re-probes
    monkeypatch.setattr(probe, "environment", lambda: env)
    path = kernel_cache / probe.CACHE_FILE
    data = json.loads(path.read_text())
    assert len(data["entries"]) == 6
    path.write_text(json.dumps({**data, "version": probe.CACHE_VERSION + 1}))
    assert run()[1]  # a file of another version is ignored
    path.write_text("{not json")
    assert run()[1]  # a corrupt file too, and it is rewritten whole
    assert json.loads(path.read_text())["version"] == probe.CACHE_VERSION
    assert not run()[1]


@cpu_only
def test_probe_declines_slow_and_failing_kernels(monkeypatch):
    monkeypatch.setattr(probe, "time_pair", _fake_timer(1.0, 1.02))
    v = probe.probe_qmm(2, 192, 576, 4, 32, mx.float32, mx.float32, kernel=q.qmm_small_m_emulated)
    assert not v.enabled and v.reason.startswith("not faster") and v.max_rel_err < 1e-5

    def broken(*a):
        raise RuntimeError("Failed to compile kernel")

    v = probe.probe_qmm(2, 192, 576, 4, 32, mx.float32, mx.float32, kernel=broken)
    assert not v.enabled and "Failed to compile" in v.reason


def test_kernel_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv(probe.CACHE_ENV)
    monkeypatch.setenv("DSPARK_FLOW_HOME", str(tmp_path / "home"))
    assert probe.cache_dir() == tmp_path / "home" / "kernels"
    assert coprefill.row_bucket(40) is None and coprefill.row_bucket(300) == 256


# -- the kernels verifier --------------------------------------------------------------------


def _recipe(drafter: dict, verifier: dict | None = None, limit: int = 8) -> dict:
    data = {
        "drafter": drafter,
        "draft_cap": {"kind": "fixed", "k": 4},
        "prompt": {"chat": False},
        "stop": [{"kind": "eos"}, {"kind": "max_tokens", "limit": limit}],
    }
    if verifier is not None:
        data["verifier"] = verifier
    return data


@pytest.fixture(scope="module")
def native():
    from dspark_flow.api import load_target

    return load_target(weights="native")


@pytest.mark.slow
@cpu_only
def test_kernels_verifier_on_cpu_equals_greedy(native):
    model, tok = native
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}), target=native)
    spec = Pipeline.from_dict(
        _recipe({"kind": "lookup"}, {"kind": "kernels"}), target=native
    ).warm_up()
    verifier = spec.verifier
    assert isinstance(verifier, KernelVerifier) and verifier.verdicts
    assert all(not v["enabled"] and "cpu" in v["reason"] for v in verifier.verdicts)
    assert type(model.model.layers[0].mlp.up_proj) is nn.QuantizedLinear  # nothing swapped
    for prompt in ["Copy this: red green blue, red green blue,", "1, 2, 3, 4, 5,"]:
        want = greedy.generate(prompt).token_ids
        assert spec.generate(prompt).token_ids == want
    assert verifier.kernel_calls == 0


@pytest.fixture(scope="module")
def tiny_quantized(native):
    from tests.tiny import tiny_model

    model = tiny_model(seed=3)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model, native[1]


@cpu_only
def test_kernels_verifier_routes_only_enabled_shapes(monkeypatch, tiny_quantized):
    model, tok = tiny_quantized

    def timer(kernel, twin, inputs, **_):  # the kernel "wins" for up to 4 rows only
        return (1.0, 2.0) if inputs[0].shape[0] <= 4 else (2.0, 1.0)

    monkeypatch.setattr(probe, "time_pair", timer)
    used = []

    def kernel(*a):
        used.append(a[0].size // a[0].shape[-1])
        return q.qmm_small_m_emulated(*a)

    verifier = KernelVerifier(KernelsConfig(), kernel=kernel)
    recipe = _recipe({"kind": "lookup"}, limit=12)
    spec = Pipeline.from_dict(recipe, target=tiny_quantized, verifier=verifier).warm_up()
    assert len(verifier.verdicts) == 16 * 5  # 5 distinct (N, K) in the tiny model, rows 1..16
    assert all(v["enabled"] == (v["rows"] <= 4) for v in verifier.verdicts)
    layer = model.model.layers[0].mlp.up_proj
    assert type(layer).__name__ == "RoutedQuantizedLinear" and isinstance(layer, nn.QuantizedLinear)
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}, limit=12), target=tiny_quantized)
    prompt = [504, 2365, 6354, 504, 2365, 6354, 504, 2365]
    used.clear()
    want = greedy.generate(prompt).token_ids  # another verifier: the stock path, no kernel
    assert not used
    got = spec.generate(prompt)
    assert got.token_ids == want and verifier.kernel_calls == len(used) > 0
    assert max(used) <= 4  # prefill (8 rows) and 5-row verifies took the stock path
    verifier.restore()
    assert type(layer) is nn.QuantizedLinear


@cpu_only
def test_kernels_verifier_refuses_a_wrong_kernel(tiny_quantized):
    model, _ = tiny_quantized

    def wrong(x, w, scales, biases, group_size, bits):
        return mx.zeros((*x.shape[:-1], w.shape[0]), dtype=x.dtype)

    verifier = KernelVerifier(KernelsConfig(max_rows=4), kernel=wrong)
    spec = Pipeline.from_dict(_recipe({"kind": "lookup"}), target=tiny_quantized, verifier=verifier)
    spec.warm_up()
    assert verifier.verdicts and not any(v["enabled"] for v in verifier.verdicts)
    assert type(model.model.layers[0].mlp.up_proj) is nn.QuantizedLinear
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}), target=tiny_quantized)
    prompt = [504, 2365, 6354, 504, 2365]
    assert spec.generate(prompt).token_ids == greedy.generate(prompt).token_ids


def test_kernels_verifier_on_a_dense_model_is_the_reference():
    from dspark_flow.strategies.verifiers.reference import ReferenceVerifier
    from dspark_flow.strategy import BuildContext
    from tests.tiny import tiny_model

    model = tiny_model(seed=5)
    verifier = KernelVerifier()
    verifier.warm_up(BuildContext(model=model, tokenizer=None, recipe=None))
    assert verifier.verdicts == [] and verifier.kernel_calls == 0
    tokens = [504, 2365, 6354]
    got = verifier.forward(model, tokens, None)
    assert mx.array_equal(got, ReferenceVerifier().forward(model, tokens, None))
