"""Kernels, their probe and the `kernels` verifier.

On this CPU there is no kernel: the dispatcher must decline (and say why), the twin runs, and the
`kernels` verifier must equal the reference. The kernels' arithmetic (bit layout, group scales)
is checked here through its plain-MLX emulation; the probe is exercised with injected kernels
(fast-but-wrong, correct, failing) and, where a decision needs "faster", a patched timer.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest

from dspark_flow.kernels import coprefill, probe
from dspark_flow.kernels import qmm_small_m as q
from dspark_flow.kernels import qmv_rows as qmv
from dspark_flow.kernels import sdpa_small_q as a
from dspark_flow.kernels import sdpa_vector_rows as sv
from dspark_flow.kernels import stock_rows as sr
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


pytestmark = pytest.mark.usefixtures("attention_unwrapped")


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


def test_stock_chunks_compute_each_row_as_one_row():
    x, w, s_, b, gs, bits = _inputs(1536, 576, 4, rows=16)
    singles = mx.concatenate([sr.qmm_stock_reference(x[i : i + 1], w, s_, b, gs, bits)
                              for i in range(16)])  # fmt: skip
    for chunk in (1, 3, 7, 16):
        out = sr.qmm_stock_chunked(x, w, s_, b, gs, bits, chunk)
        assert out.shape == (16, 1536) and mx.array_equal(out, singles).item()
    # leading dimensions are kept, as a model's (batch, tokens, features) input has them
    y = sr.chunked(7)(x.reshape(2, 8, 576), w, s_, b, gs, bits)
    assert y.shape == (2, 8, 1536) and mx.array_equal(y.reshape(16, 1536), singles).item()


def test_dense_chunks_compute_each_row_as_one_row_within_the_measured_span():
    """The CPU's dense route: MLX's own `x @ w.T`, in chunks of its probed span."""
    mx.random.seed(2)
    x, w = mx.random.normal((16, 576)), mx.random.normal((1536, 576)) * 0.05
    span = sr.invariant_span(x, w, None, None, 0, 0, matmul=sr.dense_reference)
    assert span >= 1
    singles = mx.concatenate([x[i : i + 1] @ w.T for i in range(16)])
    for chunk in sorted({1, span}):
        out = sr.dense_chunked(chunk)(x.reshape(2, 8, 576), w)  # leading dims kept
        assert out.shape == (2, 8, 1536)
        assert mx.array_equal(out.reshape(16, 1536), singles).item()
    whole = sr.dense_reference(x, w)  # the twin: the same values within rounding
    assert mx.allclose(sr.dense_chunked(span)(x, w), whole, atol=1e-5).item()


def test_padded_floor_finds_from_how_many_rows_products_agree():
    mx.random.seed(3)
    x, w = mx.random.normal((8, 64)), mx.random.normal((48, 64))

    def small_kernel_below(rows):  # a BLAS that takes another kernel for fewer than `rows` rows
        def matmul(x, w):
            y = x @ w.T
            return y * (1 + 1e-6) if x.shape[0] < rows else y

        return matmul

    calls = iter(range(10**6))

    def not_deterministic(x, w):
        return x @ w.T + next(calls) * 1e-7

    assert sr.padded_floor(x, w, small_kernel_below(1)) == 1  # every row count alike
    assert sr.padded_floor(x, w, small_kernel_below(2)) == 2  # a lone row differs
    assert sr.padded_floor(x, w, small_kernel_below(3)) == 3
    assert sr.padded_floor(x, w, not_deterministic) == 0


def test_dense_padded_route_computes_every_row_as_the_whole_product_from_its_floor():
    """The CPU's padded dense route: fewer rows than the measured floor take zero rows, so a
    one-row forward computes its row as a verify of 2..16 rows does (MLX's own `x @ w.T`)."""
    mx.random.seed(4)
    x, w = mx.random.normal((16, 1536)), mx.random.normal((576, 1536)) * 0.05
    floor = sr.padded_floor(x, w)
    assert 1 <= floor <= 16  # this machine's BLAS: where its rows start to agree
    whole = x @ w.T
    route = sr.dense_padded(floor)
    for m in range(1, 17):
        assert mx.array_equal(route(x[:m], w), whole[:m]).item(), m
    y = route(x[:1].reshape(1, 1, 1536), w)  # a model's (batch, tokens, features) input
    assert y.shape == (1, 1, 576) and mx.array_equal(y.reshape(1, 576), whole[:1]).item()
    # the twin, one row alone: the same values within rounding (bitwise where floor is 1)
    assert mx.allclose(route(x[:1], w), sr.dense_reference(x[:1], w), atol=1e-5).item()


def test_dense_floor_probe_is_cached(kernel_cache):
    first = probe.probe_dense_floor(4, 192, 576, mx.float32)
    again = probe.probe_dense_floor(4, 192, 576, mx.float32)
    assert 1 <= first.extra["floor"] <= 4 and first.enabled and not first.cached
    assert again.cached and again.extra == first.extra


@pytest.mark.parametrize(
    "pad_rows, floor, expected",
    [
        (True, 2, ["dense_stock_padded", "stock", "stock", "stock"]),
        (True, 3, ["stock", "dense_stock_chunks", "dense_stock_chunks", "dense_stock_chunks"]),
        (False, 2, ["stock", "dense_stock_chunks", "dense_stock_chunks", "dense_stock_chunks"]),
    ],
)
def test_invariant_mode_pads_a_lone_row_only_where_one_zero_row_makes_rows_agree(
    monkeypatch, kernel_cache, pad_rows, floor, expected
):
    """A dense layer whose span is one row: with `pad_rows` and a floor of 2, a one-row forward
    takes a zero row and every verify runs one stock matmul; a floor of 3 (two zero rows) or
    pad_rows off keeps the chunks."""
    from dspark_flow.strategy import BuildContext
    from tests.tiny import tiny_model

    def verdict(field, value):
        return lambda *a, **k: probe.Verdict(True, "faked", extra={field: value}, correct=True)

    floors = []
    monkeypatch.setattr(probe, "probe_dense_span", verdict("span", 1))
    monkeypatch.setattr(
        probe, "probe_dense_floor", lambda *a, **k: floors.append(a) or verdict("floor", floor)()
    )
    verifier = KernelVerifier(KernelsConfig(max_rows=4, invariant=True, pad_rows=pad_rows))
    model = tiny_model(seed=6)
    verifier.warm_up(BuildContext(model=model, tokenizer=None, recipe=None))
    try:
        routes = verifier.matmul_routes()
        assert routes and all(names == expected for names in routes.values()), routes
        assert bool(floors) == pad_rows  # the floor is probed only where padding may be taken
        for tokens in ([504], [504, 2365, 6354]):  # one row (padded or not) and a verify
            got = verifier.forward(model, tokens, None)
            assert mx.allclose(got, model(mx.array([tokens]), cache=None), atol=1e-4).item()
    finally:
        verifier.restore()


def test_attention_chunks_compute_each_query_as_one_query_call():
    """The CPU's attention route: MLX's own attention in causal query chunks of its span."""
    q, k, v, scale, _ = a.attention_inputs(16, 300, 9, 3, 64, mx.float32)(0)
    singles = sv.sdpa_vector_rows_reference(q, k, v, scale, "causal")  # one query per call
    span = sv.stock_span(q, k, v, scale)
    assert span >= 1
    for chunk in sorted({1, span}):
        out = sr.attention_chunked(chunk)(q, k, v, scale, "causal")
        assert mx.array_equal(out, singles).item(), chunk
    whole = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    assert mx.allclose(
        sr.attention_chunked(span)(q, k, v, scale, "causal"), whole, atol=1e-5
    ).item()


def test_dense_span_probe_is_cached(kernel_cache):
    first = probe.probe_dense_span(4, 192, 576, mx.float32)
    again = probe.probe_dense_span(4, 192, 576, mx.float32)
    assert first.extra["span"] >= 1 and not first.cached
    assert again.cached and again.extra == first.extra


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("weights, context", [("auto", 120), ("auto", 600), ("native", 120)])
def test_invariant_mode_on_the_cpu_computes_every_verify_row_as_one_row(weights, context):
    """The CLI's stack on the CPU (no kernel runs there): MLX's own matmuls and attention in
    chunks of their probed spans. A verify forward of K = 2..16 rows gives each row the logits
    of one-row forwards, bit for bit (the condition for speculation to reproduce greedy; at
    two key buckets: 120 and 600 keys)."""
    from dspark_flow.api import load_target
    from dspark_flow.models.row_invariance import row_differences, synthetic_tokens
    from dspark_flow.recipe.schema import TOOL_DEFAULTS

    target = load_target(weights=weights)
    pipe = Pipeline.from_dict({"verifier": dict(TOOL_DEFAULTS["verifier"])}, target=target)
    pipe.warm_up()
    model, verifier = target[0], pipe.verifier
    try:
        assert verifier._take_correct and not verifier._not_invariant
        assert any(v["kernel"] == "dense_row_span" for v in verifier.verdicts) == (
            weights == "auto"
        )
        routes = verifier.matmul_routes()  # names the routed shapes, dense ones included
        assert all(len(names) == 16 for names in routes.values())
        found = row_differences(
            verifier, model, synthetic_tokens(context), synthetic_tokens(16, 1), (2, 4, 8, 16)
        )
        assert all(d.rows_differing == 0 for d in found.values()), found
    finally:
        verifier.restore()


def test_invariant_span_finds_where_rows_start_to_differ():
    inputs = _inputs(192, 576, 4, rows=8)

    def tiled_from_four(x, *rest):  # a stock kernel that switches to another sum order at 4 rows
        y = sr.qmm_stock_reference(x, *rest)
        return y * (1 + 1e-6) if x.shape[0] >= 4 else y

    calls = iter(range(10**6))

    def not_deterministic(x, *rest):
        return sr.qmm_stock_reference(x, *rest) + next(calls) * 1e-7

    assert sr.invariant_span(*inputs) == 8  # MLX's CPU matmul: every row alike
    assert sr.invariant_span(*inputs, matmul=tiled_from_four) == 3
    assert sr.invariant_span(*inputs, matmul=not_deterministic) == 0


def test_stock_span_probe_is_cached(kernel_cache, monkeypatch):
    measure = sr.invariant_span
    v = probe.probe_stock_span(4, 192, 576, 4, 32, mx.float32, mx.float32)
    assert v.correct and v.extra["span"] == 4 and not v.cached
    monkeypatch.setattr(sr, "invariant_span", lambda *a: pytest.fail("measured again"))
    again = probe.probe_stock_span(4, 192, 576, 4, 32, mx.float32, mx.float32)
    assert again.cached and again.extra["span"] == 4
    # A damaged span in the file is probed again, not read into a failure of every run.
    monkeypatch.setattr(sr, "invariant_span", measure)
    path = kernel_cache / probe.CACHE_FILE
    data = json.loads(path.read_text())
    for bad in ("abc", None, [1], -3, 2.5, True):
        for entry in data["entries"].values():
            entry["extra"]["span"] = bad
        path.write_text(json.dumps(data))
        v = probe.probe_stock_span(4, 192, 576, 4, 32, mx.float32, mx.float32)
        assert not v.cached and v.extra["span"] == 4, bad


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
    changes = [("mlx", "9.9.9"), ("device", "Other GPU"), ("backend", "cuda"),
               ("blas", "reference|threads=1")]  # fmt: skip
    for field, value in changes:
        monkeypatch.setattr(probe, "environment", lambda f=field, v=value: {**env, f: v})
        assert run()[1], field  # changing MLX version / device / backend / BLAS re-probes
    monkeypatch.setattr(probe, "environment", lambda: env)
    path = kernel_cache / probe.CACHE_FILE
    data = json.loads(path.read_text())
    assert len(data["entries"]) == 7
    path.write_text(json.dumps({**data, "version": probe.CACHE_VERSION + 1}))
    assert run()[1]  # a file of another version is ignored
    path.write_text("{not json")
    assert run()[1]  # a corrupt file too, and it is rewritten whole
    assert json.loads(path.read_text())["version"] == probe.CACHE_VERSION
    assert not run()[1]
    # The speedup demanded is the caller's, not part of the key: a cached 2x verdict is
    # re-judged without measuring again.
    v, measured = run(min_gain=1.5)
    assert not measured and v.cached and v.correct and not v.enabled
    assert v.reason.startswith("not faster by 150%")
    v, measured = run(min_gain=0.5)
    assert not measured and v.enabled
    # No probe enables a kernel it found wrong: an entry saying so (or not saying it was right)
    # is damage, probed again rather than trusted.
    for damage in ({"correct": False}, {"correct": None}):
        data = json.loads(path.read_text())
        data["entries"] = {k: {**e, **damage} for k, e in data["entries"].items()}
        path.write_text(json.dumps(data))
        v, measured = run()
        assert measured and v.enabled and v.correct
    path.write_text("[" * 100_000 + "]" * 100_000)  # too deep for json: RecursionError
    assert run()[1]


@cpu_only
def test_probe_declines_slow_and_failing_kernels(monkeypatch):
    monkeypatch.setattr(probe, "time_pair", _fake_timer(1.0, 1.02))
    v = probe.probe_qmm(2, 192, 576, 4, 32, mx.float32, mx.float32, kernel=q.qmm_small_m_emulated)
    assert not v.enabled and v.reason.startswith("not faster") and v.max_rel_err < 1e-5

    def broken(*a):
        raise RuntimeError("Failed to compile kernel")

    v = probe.probe_qmm(2, 192, 576, 4, 32, mx.float32, mx.float32, kernel=broken)
    assert not v.enabled and "Failed to compile" in v.reason


def test_an_enabled_coprefill_verdict_without_its_share_is_probed_again(monkeypatch, kernel_cache):
    """The verifier reads the share of every enabled verdict: one without it (damage) must be
    re-probed, not fail every later warm-up. The probe itself runs here with a fake timer (the
    CPU has no second stream to split with: the split is the twin's own matmul here)."""
    timed = []

    def timer(kernel, twin, inputs, **_):
        timed.append(1)
        kernel(*inputs), twin(*inputs)
        return 1.0, 2.0

    def split(x, w, s, b, group_size, bits, share):  # noqa: ANN001, ANN202  (no GPU stream here)
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)

    monkeypatch.setattr(coprefill, "unavailable_reason", lambda: None)
    monkeypatch.setattr(coprefill, "time_pair", timer)
    monkeypatch.setattr(coprefill, "coprefill_qmm", split)

    def run():  # noqa: ANN202
        before = len(timed)
        v = coprefill.probe_coprefill(64, 192, 576, 4, 32, mx.float32, mx.float32)
        return v, len(timed) > before

    v, measured = run()
    assert measured and v.enabled and v.correct and v.extra["share"] in coprefill.SHARES
    assert not run()[1]
    path = kernel_cache / probe.CACHE_FILE
    data = json.loads(path.read_text())
    data["entries"] = {k: {**e, "extra": {}} for k, e in data["entries"].items()}
    path.write_text(json.dumps(data))
    v, measured = run()
    assert measured and v.enabled and "share" in v.extra


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
    matmuls = [v for v in verifier.verdicts if v["kernel"] == "qmm_small_m"]
    assert len(matmuls) == 16 * 5  # 5 distinct (N, K) in the tiny model, rows 1..16
    assert all(v["enabled"] == (v["rows"] <= 4) for v in matmuls)
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


def test_warm_up_compiles_every_routed_row_count(monkeypatch, tiny_quantized):
    """With the verdicts cached no probe runs the kernels, so warm-up runs each row count once
    (GPUs compile a shape on first use); only the routed counts reach the kernel."""

    def timer(kernel, twin, inputs, **_):  # the kernel "wins" for up to 4 rows only
        return (1.0, 2.0) if inputs[0].shape[0] <= 4 else (2.0, 1.0)

    monkeypatch.setattr(probe, "time_pair", timer)
    used: list[int] = []

    def kernel(*a):
        used.append(a[0].size // a[0].shape[-1])
        return q.qmm_small_m_emulated(*a)

    recipe = _recipe({"kind": "lookup"}, limit=12)
    first = KernelVerifier(KernelsConfig(precompile=False), kernel=kernel)
    Pipeline.from_dict(recipe, target=tiny_quantized, verifier=first).warm_up()
    first.restore()
    used.clear()
    quiet = KernelVerifier(KernelsConfig(precompile=False), kernel=kernel)
    Pipeline.from_dict(recipe, target=tiny_quantized, verifier=quiet).warm_up()
    assert not used  # the verdicts were cached: nothing ran the kernel
    quiet.restore()
    second = KernelVerifier(KernelsConfig(), kernel=kernel)
    Pipeline.from_dict(recipe, target=tiny_quantized, verifier=second).warm_up()
    second.restore()
    assert sorted(set(used)) == [1, 2, 3, 4]


@cpu_only
def test_kernels_verifier_refuses_a_wrong_kernel(tiny_quantized):
    model, _ = tiny_quantized

    def wrong(x, w, scales, biases, group_size, bits):
        return mx.zeros((*x.shape[:-1], w.shape[0]), dtype=x.dtype)

    def wrong_attn(q, k, v, scale, mask=None):
        return a.sdpa_small_q_emulated(q, k, v, scale * 1.5, mask)  # a wrong softmax scale

    verifier = KernelVerifier(KernelsConfig(max_rows=4), kernel=wrong, attention_kernel=wrong_attn)
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
    # No quantized matmul to probe; the attention is probed (and declined on the CPU).
    assert all(v["kernel"] == "sdpa_small_q" for v in verifier.verdicts)
    if ON_CPU:
        assert verifier.verdicts and not any(v["enabled"] for v in verifier.verdicts)
        from mlx_lm.models import llama

        assert not hasattr(llama.scaled_dot_product_attention, "dspark_flow_original")
    assert verifier.kernel_calls == 0 and verifier.attention_calls == 0
    tokens = [504, 2365, 6354]
    got = verifier.forward(model, tokens, None)
    assert mx.array_equal(got, ReferenceVerifier().forward(model, tokens, None))


# -- attention: sdpa_small_q -----------------------------------------------------------------


def _emulated_verifier(**config) -> KernelVerifier:
    """A kernels verifier whose 'kernels' are the plain-MLX emulations (they run on the CPU)."""
    return KernelVerifier(KernelsConfig(**config), kernel=q.qmm_small_m_emulated,
                          attention_kernel=a.sdpa_small_q_emulated)  # fmt: skip


# The embedded target's attention: 9 query heads over 3 key/value heads of 64.
HEADS = (9, 3, 64)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("queries,keys", [(1, 1), (1, 300), (2, 2), (4, 37), (8, 300), (16, 600)])
def test_attention_twin_emulation_and_float64_agree(queries, keys, dtype):
    q_, k_, v_, scale, _ = a.attention_inputs(queries, keys, *HEADS, dtype)(queries)
    mask = "causal" if queries > 1 else None
    twin = a.sdpa_small_q_reference(q_, k_, v_, scale, mask)
    tol = 1e-5 if dtype == mx.float32 else probe.TOLERANCE["bfloat16"]
    for other in (a.sdpa_small_q_emulated, a.sdpa_small_q_float64):
        got = other(q_, k_, v_, scale, mask)
        assert got.shape == twin.shape and got.dtype == dtype
        assert probe.relative_error(got, twin) < tol, other.__name__
    out = a.sdpa_small_q(q_, k_, v_, scale, mask)
    if ON_CPU:
        assert out is None and "cpu backend" in a.unsupported_reason(q_, k_, v_, mask)
    else:  # a GPU backend with a kernel: it must agree with the float64 values
        exact = a.sdpa_small_q_float64(q_, k_, v_, scale, mask)
        assert out is None or probe.relative_error(out, exact) < tol


def test_attention_causal_rows_see_their_own_prefix():
    # Row i of L causal queries over T keys is the one-query attention over the first T-L+i+1.
    q_, k_, v_, scale, _ = a.attention_inputs(5, 40, *HEADS, mx.float32)(7)
    full = a.sdpa_small_q_float64(q_, k_, v_, scale, "causal")
    for i in range(5):
        row = a.sdpa_small_q_float64(q_[:, :, i : i + 1], k_[:, :, : 36 + i], v_[:, :, : 36 + i],
                                     scale)  # fmt: skip
        assert probe.relative_error(full[:, :, i : i + 1], row) < 1e-6


def test_attention_dispatcher_reasons():
    f32 = mx.float32
    assert a.shape_reason(4, 9, 3, 64, f32, True, 300, backend="cuda") is None
    assert "queries" in a.shape_reason(17, 9, 3, 64, f32, True, 300, backend="cuda")
    assert "head dim" in a.shape_reason(4, 9, 3, 80, f32, True, 300, backend="cuda")
    assert "group" in a.shape_reason(4, 9, 2, 64, f32, True, 300, backend="cuda")
    assert "dtype" in a.shape_reason(4, 9, 3, 64, mx.int32, True, 300, backend="cuda")
    assert "at least as many keys" in a.shape_reason(8, 9, 3, 64, f32, True, 5, backend="cuda")
    q_, k_, v_, scale, _ = a.attention_inputs(4, 40, *HEADS, f32)(0)
    assert a.unsupported_reason(q_, k_, v_, "causal", backend="cuda") is None
    assert "mask" in a.unsupported_reason(q_, k_, v_, mx.ones((4, 40)), backend="cuda")
    assert "dtype" in a.unsupported_reason(q_, k_.astype(mx.float16), v_, None, backend="cuda")
    assert [probe.key_bucket(t) for t in (1, 512, 513, 8192, 8193)] == [512, 512, 2048, 8192, None]


@cpu_only
def test_attention_probe_declines_on_cpu_and_judges_injected_kernels(monkeypatch, kernel_cache):
    v = probe.probe_sdpa(4, 512, *HEADS, mx.float32)
    assert not v.enabled and "cpu" in v.reason and not kernel_cache.exists()
    monkeypatch.setattr(probe, "time_pair", _fake_timer(1.0, 2.0))
    good = probe.probe_sdpa(4, 512, *HEADS, mx.float32, kernel=a.sdpa_small_q_emulated)
    assert good.enabled and good.max_rel_err < 1e-5 and good.extra["twin_err"] < 1e-5

    def no_mask(q_, k_, v_, scale, mask=None):
        return a.sdpa_small_q_emulated(q_, k_, v_, scale, None)

    bad = probe.probe_sdpa(4, 512, *HEADS, mx.float32, kernel=no_mask)
    assert not bad.enabled and bad.reason.startswith("wrong values")


def test_probe_measures_kernel_and_twin_against_exact_values(monkeypatch, kernel_cache):
    # On CUDA the twin may run in TF32: a kernel as close to the true values as the twin passes,
    # one further away is refused (the tolerance alone would refuse both). The twin's error
    # raises the bar at most to 10x the tolerance, and a twin that is not finite raises nothing.
    monkeypatch.setattr(probe, "time_pair", _fake_timer(1.0, 2.0))
    x = mx.random.normal((4, 64), key=mx.random.key(1))

    def run(kernel_off, twin_off, name):
        key = probe.ProbeKey.make(name, "1", "test", 4, 64, 64, "float32")
        kernel = lambda x_: x_ * 2 * (1 + kernel_off)  # noqa: E731
        twin = lambda x_: x_ * 2 * (1 + twin_off)  # noqa: E731
        return probe.probe(key, kernel, twin, lambda seed: (x,), 5e-4, exact=lambda x_: x_ * 2)

    assert run(1e-3, 2e-3, "closer").enabled
    far = run(3e-3, 2e-3, "further")
    assert not far.enabled and far.reason.startswith("wrong values")
    assert far.extra["twin_err"] == pytest.approx(2e-3, rel=1e-3)
    assert not run(2e-2, 1e-1, "capped").enabled  # bar 5e-3, not the twin's 1e-1
    assert not run(1e-3, float("nan"), "nan twin").enabled  # bar stays at the tolerance
    nan_kernel = run(float("nan"), float("nan"), "nan kernel")
    assert not nan_kernel.enabled and not nan_kernel.correct


@cpu_only
def test_kernels_verifier_routes_attention(monkeypatch, tiny_quantized):
    from mlx_lm.models import llama

    original = llama.scaled_dot_product_attention

    def timer(kernel, twin, inputs, **_):  # the attention kernel "wins" for 2..8 queries
        if isinstance(inputs[3], float):
            return (1.0, 2.0) if 2 <= inputs[0].shape[2] <= 8 else (2.0, 1.0)
        return 2.0, 1.0  # the matmul kernel never does

    monkeypatch.setattr(probe, "time_pair", timer)
    seen = []

    def attention(q_, k_, v_, scale, mask=None):
        seen.append((q_.shape[2], k_.shape[2], mask))
        return a.sdpa_small_q_emulated(q_, k_, v_, scale, mask)

    verifier = KernelVerifier(KernelsConfig(max_rows=8), kernel=q.qmm_small_m_emulated,
                              attention_kernel=attention)  # fmt: skip
    recipe = _recipe({"kind": "lookup"}, limit=16)
    spec = Pipeline.from_dict(recipe, target=tiny_quantized, verifier=verifier).warm_up()
    attn = [v for v in verifier.verdicts if v["kernel"] == "sdpa_small_q"]
    assert len(attn) == 8 * len(probe.KEY_BUCKETS)
    assert all(v["enabled"] == (2 <= v["rows"] <= 8) for v in attn)
    assert llama.scaled_dot_product_attention is not original  # wrapped
    model = tiny_quantized[0]
    assert type(model.model.layers[0].mlp.up_proj) is nn.QuantizedLinear  # no matmul won
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}, limit=16), target=tiny_quantized)
    prompt = [504, 2365, 6354, 504, 2365, 6354, 504, 2365]
    seen.clear()
    want = greedy.generate(prompt).token_ids  # another pipeline's verifier: stock attention
    assert not seen
    got = spec.generate(prompt)
    assert got.token_ids == want and verifier.attention_calls == len(seen) > 0
    assert all(2 <= rows <= 8 and mask == "causal" for rows, _, mask in seen)
    verifier.restore()
    assert llama.scaled_dot_product_attention is original


def test_compiled_layers_keep_the_routes_of_the_kernels_verifier(monkeypatch, tiny_quantized):
    """With `compile_layers` the routed matmuls are traced into the compiled layers (the kernel
    runs at trace time, once per module and row count) and the attention, left outside the
    compiled parts, still reaches its route on every forward; output = greedy's."""
    from mlx_lm.models import llama

    original = llama.scaled_dot_product_attention

    def timer(kernel, twin, inputs, **_):  # both "win" for 2..4 rows
        rows = inputs[0].shape[2] if isinstance(inputs[3], float) else inputs[0].shape[0]
        return (1.0, 2.0) if 2 <= rows <= 4 else (2.0, 1.0)

    monkeypatch.setattr(probe, "time_pair", timer)
    traced, seen = [], []

    def kernel(*args):
        if args[1].shape[0] < 1000:  # the layers' matmuls; the tied head (49,152 rows) is not
            traced.append(args[0].size // args[0].shape[-1])  # in a compiled part
        return q.qmm_small_m_emulated(*args)

    def attention(q_, k_, v_, scale, mask=None):
        seen.append(q_.shape[2])
        return a.sdpa_small_q_emulated(q_, k_, v_, scale, mask)

    verifier = KernelVerifier(
        KernelsConfig(max_rows=4, compile_layers=True), kernel=kernel, attention_kernel=attention
    )
    recipe = _recipe({"kind": "lookup"}, limit=16)
    spec = Pipeline.from_dict(recipe, target=tiny_quantized, verifier=verifier).warm_up()
    try:
        assert verifier.compiled is not None and verifier.compiled.mlp_layers == 1
        attn = tiny_quantized[0].model.layers[0].self_attn
        assert type(attn).__name__ == "CompiledAttention"
        assert type(attn.q_proj).__name__ == "RoutedQuantizedLinear"
        greedy = Pipeline.from_dict(_recipe({"kind": "none"}, limit=16), target=tiny_quantized)
        prompt = [504, 2365, 6354, 504, 2365, 6354, 504, 2365]
        want = greedy.generate(prompt).token_ids
        verifier.compiled.reset()  # trace again while decoding, to watch what a trace runs
        traced.clear()
        assert spec.generate(prompt).token_ids == want
        assert traced and set(traced) <= {2, 3, 4}  # the routed row counts, while tracing
        traced.clear()
        seen.clear()
        assert spec.generate(prompt).token_ids == want
        assert not traced  # replayed from the traces: the kernel is in them, not called again
        assert seen and all(2 <= rows <= 4 for rows in seen)  # attention: routed per call
    finally:
        verifier.restore()
    assert type(attn).__name__ == "Attention" and llama.scaled_dot_product_attention is original


def _matmul_routes(verifier: KernelVerifier) -> set[tuple[str, ...]]:
    """The distinct routes of the verifier's routed layers (what rows 1..max_rows run)."""
    return {tuple(names) for names in verifier.matmul_routes().values()}


@cpu_only
def test_invariant_mode_takes_the_stock_matmul_where_it_is_invariant_and_cheaper(
    monkeypatch, tiny_quantized
):
    # The kernels are correct but slower; MLX's CPU matmul computes 1..4 rows alike at this
    # model's shapes (measured by the probe), and its attention is taken to (the measured span
    # depends on the CPU: 4 on one CI machine, 2-3 on another), so both stay stock.
    monkeypatch.setattr(probe, "time_pair", _fake_timer(2.0, 1.0))
    span_four = probe.Verdict(True, "query rows 1..4", extra={"span": 4}, correct=True)
    monkeypatch.setattr(probe, "probe_sdpa_stock_span", lambda *a, **k: span_four)
    verifier = _emulated_verifier(max_rows=4, invariant=True)
    spec = Pipeline.from_dict(_recipe({"kind": "lookup"}), target=tiny_quantized, verifier=verifier)
    spec.warm_up()
    spans = [v for v in verifier.verdicts if v["kernel"] == "stock_row_span"]
    assert spans and all(v["extra"]["span"] == 4 for v in spans)
    matmuls = [v for v in verifier.verdicts if v["kernel"] == "qmm_small_m"]
    assert matmuls and all(v["correct"] and not v["enabled"] for v in matmuls)
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}), target=tiny_quantized)
    prompt = [504, 2365, 6354, 504, 2365]
    assert spec.generate(prompt).token_ids == greedy.generate(prompt).token_ids
    assert verifier.kernel_calls == 0 and verifier.attention_calls == 0
    verifier.restore()


@cpu_only
def test_invariant_mode_chunks_the_stock_matmul_past_its_span(monkeypatch, tiny_quantized):
    # A stock matmul that computes only 1..2 rows alike: 3 and 4 rows run as chunks of 2, which
    # the (fake) timings make cheaper than the slower kernel at every row count (judged by the
    # probes alone: `prefer_stock` off).
    monkeypatch.setattr(probe, "time_pair", _fake_timer(2.0, 1.0))
    span_two = probe.Verdict(True, "rows 1..2", extra={"span": 2}, correct=True)
    monkeypatch.setattr(probe, "probe_stock_span", lambda *a, **k: span_two)
    verifier = _emulated_verifier(max_rows=4, invariant=True, prefer_stock=False)
    spec = Pipeline.from_dict(_recipe({"kind": "lookup"}), target=tiny_quantized, verifier=verifier)
    spec.warm_up()
    assert _matmul_routes(verifier) == {("stock", "stock", "qmm_stock_chunks", "qmm_stock_chunks")}
    chunks = [v for v in verifier.verdicts if v["kernel"] == "qmm_stock_chunks"]
    assert chunks and {v["rows"] for v in chunks} == {3, 4}
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}), target=tiny_quantized)
    prompt = [504, 2365, 6354, 504, 2365]
    assert spec.generate(prompt).token_ids == greedy.generate(prompt).token_ids
    verifier.restore()


@cpu_only
def test_invariant_mode_keeps_every_verify_within_the_rows_it_routes(monkeypatch, tiny_quantized):
    # Past max_rows a forward runs MLX's own layers, which round differently: drafts are capped
    # at max_rows - 1 (the drafter here offers 16 tokens a round and the cap asks for 8), and
    # the cap is told so. A drafter without a block keeps its cap's own bound (unbounded_k).
    from dspark_flow.strategy import Draft, Drafter, StrategyConfig

    class OffersConfig(StrategyConfig):
        kind: str = "offers"

    class Offers(Drafter):
        Config = OffersConfig

        def __init__(self, block: int | None):
            super().__init__()
            self.block = block

        @property
        def max_draft(self) -> int | None:
            return self.block

        def propose(self, history: list[int], k: int) -> Draft:
            return Draft(tokens=[42] * k)

    monkeypatch.setattr(probe, "time_pair", _fake_timer(2.0, 1.0))
    verifier = _emulated_verifier(max_rows=4, invariant=True)
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}, limit=12), target=tiny_quantized)
    prompt = [504, 2365, 6354, 504, 2365]
    want = greedy.generate(prompt).token_ids
    rows: list[int] = []
    forward = verifier.forward
    monkeypatch.setattr(
        verifier, "forward", lambda m, t, c: rows.append(len(t)) or forward(m, t, c)
    )
    for block, cap, most in [(16, {"kind": "fixed", "k": 8}, 4),
                             (None, {"kind": "full_block", "unbounded_k": 2}, 3)]:  # fmt: skip
        recipe = {**_recipe({"kind": "lookup"}, limit=12), "draft_cap": cap}
        spec = Pipeline.from_dict(
            recipe, target=tiny_quantized, verifier=verifier, drafter=Offers(block)
        ).warm_up()
        assert verifier.exact_rows == 4
        told: list[int | None] = []
        choose = spec.draft_cap.choose
        spec.draft_cap.choose = lambda m, source="drafter", told=told, choose=choose: (
            told.append(m) or choose(m, source)
        )
        rows.clear()
        assert spec.generate(prompt).token_ids == want
        # after the prefill a verify holds `most` - 1 drafts (fewer near the token budget)
        assert max(rows[1:]) == most and rows.count(most) >= 2, block
        assert set(told) == {3 if block else None}, block
    verifier.restore()
    assert verifier.exact_rows is None
    plain = _emulated_verifier(max_rows=4)
    Pipeline.from_dict(_recipe({"kind": "lookup"}), target=tiny_quantized, verifier=plain).warm_up()
    assert plain.exact_rows is None  # not invariant: promises nothing
    plain.restore()


@cpu_only
def test_invariant_mode_takes_qmv_rows_past_the_span_only_where_it_is_bitwise(
    monkeypatch, tiny_quantized
):
    # Past a stock span of 2, a rows kernel that reproduces MLX's one-row results bit for bit
    # (here: MLX's matmul one row at a time) and is timed cheapest takes rows 3..4; one that
    # is only close (the emulation: another summation order) is refused in both variants.
    def exact_rows(*a):
        return qmv.qmv_rows_reference(*a)

    def timer(kernel, twin, inputs, **_):
        return (0.5, 1.0) if kernel is exact_rows else (2.0, 1.0)

    monkeypatch.setattr(probe, "time_pair", timer)
    span_two = probe.Verdict(True, "rows 1..2", extra={"span": 2}, correct=True)
    monkeypatch.setattr(probe, "probe_stock_span", lambda *a, **k: span_two)
    prompt = [504, 2365, 6354, 504, 2365]
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}), target=tiny_quantized)
    for rows_kernel, route in [
        (exact_rows, "exact_rows"),
        (qmv.qmv_rows_emulated, "qmm_stock_chunks"),
    ]:
        verifier = KernelVerifier(KernelsConfig(max_rows=4, invariant=True),
                                  kernel=q.qmm_small_m_emulated,
                                  attention_kernel=a.sdpa_small_q_emulated,
                                  rows_kernel=rows_kernel)  # fmt: skip
        spec = Pipeline.from_dict(_recipe({"kind": "lookup"}), target=tiny_quantized,
                                  verifier=verifier).warm_up()  # fmt: skip
        assert _matmul_routes(verifier) == {("stock", "stock", route, route)}
        tried = {(v["fused"], v["extra"].get("bitwise")) for v in verifier.verdicts
                 if v["kernel"] == "qmv_rows"}  # fmt: skip
        assert tried == ({(1, True)} if rows_kernel is exact_rows else {(1, False), (0, False)})
        assert spec.generate(prompt).token_ids == greedy.generate(prompt).token_ids
        verifier.restore()


def test_qmv_rows_emulation_agrees_with_mlx_one_row_at_a_time():
    for n, k, bits in [(1536, 576, 4), (576, 1536, 4), (192, 576, 8)]:
        x, w, s_, b, gs, bits = _inputs(n, k, bits, rows=5)
        ref = qmv.qmv_rows_reference(x, w, s_, b, gs, bits)
        assert probe.relative_error(qmv.qmv_rows_emulated(x, w, s_, b, gs, bits), ref) < 1e-5
        assert qmv.qmv_rows(x, w, s_, b, gs, bits) is None  # no CUDA here: declined
        assert "no qmv_rows kernel" in qmv.shape_reason(5, n, k, bits, gs, mx.float32, mx.float32)


@pytest.mark.parametrize(("dtype", "tol"), [(mx.bfloat16, 1e-2), (mx.float16, 2e-3)])
def test_qmv_rows_emulation_in_16_bit_agrees_with_the_exact_product(dtype, tol):
    # 16-bit activations: 16 elements a lane with 4-bit weights (8 with 8-bit), sums kept in the
    # activation type with 4-bit weights; K = 1,152 leaves a partial last step either way. The
    # yardstick is the float32 product: MLX's CPU matmul in bfloat16 (the twin here) sums in
    # bfloat16 over all of K and strays further (4-7% of the largest output in these shapes)
    for n, k, bits in [(384, 1152, 4), (256, 1152, 8), (192, 576, 4)]:
        x, w, s_, b, gs, bits = probe.qmm_inputs(5, n, k, bits, 64, dtype, dtype)(3)
        out = qmv.qmv_rows_emulated(x, w, s_, b, gs, bits)
        assert out.dtype == qmv.qmv_rows_reference(x, w, s_, b, gs, bits).dtype == dtype
        deq = mx.dequantize(w, s_.astype(mx.float32), b.astype(mx.float32), group_size=gs,
                            bits=bits)  # fmt: skip
        exact = x.astype(mx.float32) @ deq.T
        assert 0 < probe.relative_error(out.astype(mx.float32), exact) < tol
    assert qmv.elems_per_lane(dtype, 4) == 16 and qmv.elems_per_lane(dtype, 8) == 8
    assert qmv.elems_per_lane(mx.float32, 4) == 8
    # rows per pass: at most 64 partial sums a lane (16-bit with 4-bit weights: 16 a row)
    assert [qmv.rows_per_pass(r, dtype, 4) for r in (1, 3, 5, 16)] == [1, 4, 4, 4]
    assert qmv.rows_per_pass(16, dtype, 8) == qmv.rows_per_pass(16, mx.float32, 4) == 8
    # float32 activations take any scales (MLX casts them up exactly); 16-bit ones their own
    assert qmv.shape_reason(9, 384, 1152, 4, 64, mx.float32, dtype, backend="cuda") is None
    assert qmv.shape_reason(9, 384, 1152, 4, 64, dtype, dtype, backend="cuda") is None
    mixed = qmv.shape_reason(9, 384, 1152, 4, 64, dtype, mx.float32, backend="cuda")
    assert "qmv's arithmetic is in one type" in mixed


@cpu_only
def test_invariant_mode_takes_a_kernel_for_every_row_count_when_that_is_cheaper(
    monkeypatch, tiny_quantized
):
    # The kernel is slower for one row, faster from two: summed over the row counts it wins,
    # so it takes all of them (a faster-only choice would mix kernel and stock rows).
    def timer(kernel, twin, inputs, **_):
        return (2.0, 1.0) if inputs[0].shape[0] == 1 else (0.5, 3.0)

    monkeypatch.setattr(probe, "time_pair", timer)
    verifier = _emulated_verifier(max_rows=4, invariant=True, prefer_stock=False)
    spec = Pipeline.from_dict(_recipe({"kind": "lookup"}), target=tiny_quantized, verifier=verifier)
    spec.warm_up()
    assert _matmul_routes(verifier) == {("qmm_small_m_emulated",) * 4}
    verifier.restore()


@cpu_only
@pytest.mark.parametrize("many_rows, stock_kept", [((0.5, 3.0), True), ((0.2, 9.0), False)])
def test_prefer_stock_keeps_mlx_own_routes_unless_far_dearer(
    monkeypatch, tiny_quantized, many_rows, stock_kept
):
    # The kernels are slower for one row, faster from two. With `prefer_stock` (the default)
    # MLX's own matmul (its CPU span covers 1..4 rows, measured) and its own attention within a
    # stubbed span of 4 keep every row count while the probes time them at most
    # PREFER_STOCK_LIMIT times the kernels' cost per token (1.7x here), so a forward never calls
    # a kernel; at 4.8x the kernels take over.
    def timer(kernel, twin, inputs, **_):
        rows = inputs[0].shape[0] if inputs[0].ndim == 2 else inputs[0].shape[2]  # x or q
        return (2.0, 1.0) if rows == 1 else many_rows

    monkeypatch.setattr(probe, "time_pair", timer)
    span_four = probe.Verdict(True, "query rows 1..4", extra={"span": 4}, correct=True)
    monkeypatch.setattr(probe, "probe_sdpa_stock_span", lambda *a, **k: span_four)
    verifier = _emulated_verifier(max_rows=4, invariant=True)
    spec = Pipeline.from_dict(_recipe({"kind": "lookup"}), target=tiny_quantized, verifier=verifier)
    spec.warm_up()
    attention = verifier._router.attention if verifier._router is not None else None
    attention_routed = attention is not None and any(any(f) for f in attention.by_rows.values())
    if stock_kept:
        assert verifier.matmul_routes() == {}  # every row count stock: no layer needs a route
        assert not attention_routed
    else:
        assert _matmul_routes(verifier) == {("qmm_small_m_emulated",) * 4}
        assert attention_routed
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}), target=tiny_quantized)
    prompt = [504, 2365, 6354, 504, 2365]
    assert spec.generate(prompt).token_ids == greedy.generate(prompt).token_ids
    assert (verifier.kernel_calls == 0 and verifier.attention_calls == 0) == stock_kept
    verifier.restore()


@cpu_only
def test_invariant_attention_takes_vector_rows_only_where_bitwise(monkeypatch, tiny_quantized):
    # Route (b): MLX's own attention for the query counts it computes as one (its span: one
    # or two here, stubbed), a vector-rows kernel past them where it reproduced MLX's one-row
    # results bit for bit (here: MLX one row at a time) and is cheaper per token; an inexact one
    # (another summation order) leaves route (a). Judged by the probes alone (`prefer_stock` off).
    def exact_rows(q_, k_, v_, scale, mask=None):
        return sv.sdpa_vector_rows_reference(q_, k_, v_, scale, mask)

    def timer(kernel, twin, inputs, **_):
        return (0.5, 1.0) if getattr(kernel, "__wrapped_fn__", None) is exact_rows else (2.0, 1.0)

    real_fresh = probe.fresh_key_lengths

    def fresh(fn, keys):  # keep a handle on the function the timing wraps
        call = real_fresh(fn, keys)
        call.__wrapped_fn__ = fn
        return call

    monkeypatch.setattr(probe, "fresh_key_lengths", fresh)
    monkeypatch.setattr(probe, "time_pair", timer)
    span = {"span": 1}  # how many query rows MLX's attention computes as one (measured on CUDA)
    monkeypatch.setattr(probe, "probe_sdpa_stock_span", lambda *a_, **k_: probe.Verdict(
        True, "stubbed", extra=dict(span), correct=True))  # fmt: skip
    prompt = [504, 2365, 6354, 504, 2365]
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}), target=tiny_quantized)
    for rows_kernel, want, stock_rows in [
        (exact_rows, ("exact_rows",) * 3, 1),
        (a.sdpa_small_q_emulated, ("sdpa_small_q_emulated",) * 3, 1),
        (exact_rows, (None, "exact_rows", "exact_rows"), 2),  # MLX's own for 1..2 queries
    ]:
        span["span"] = stock_rows
        verifier = KernelVerifier(KernelsConfig(max_rows=4, invariant=True, prefer_stock=False),
                                  kernel=q.qmm_small_m_emulated,
                                  attention_kernel=a.sdpa_small_q_emulated,
                                  vector_rows_kernel=rows_kernel)  # fmt: skip
        spec = Pipeline.from_dict(_recipe({"kind": "lookup"}), target=tiny_quantized,
                                  verifier=verifier).warm_up()  # fmt: skip
        routes = verifier._router.attention.by_rows
        first = None if rows_kernel is exact_rows else "sdpa_small_q_emulated"
        assert {tuple(fn and fn.__name__ for fn in fns[1:]) for fns in routes.values()} == {
            (first, *want)
        }
        assert spec.generate(prompt).token_ids == greedy.generate(prompt).token_ids
        verifier.restore()


def test_attention_stock_span_finds_where_query_rows_start_to_differ(monkeypatch):
    q_, k_, v_, scale, _ = a.attention_inputs(6, 300, *HEADS, mx.float32)(0)
    mlx = a.sdpa_small_q_reference
    row_by_row = sv.sdpa_vector_rows_reference  # every query count computed as one row is

    def composite_from_three(q_, k_, v_, scale, mask):  # another sum order from 3 queries on
        out = row_by_row(q_, k_, v_, scale, mask)
        return out * (1 + 1e-6) if q_.shape[2] >= 3 else out

    calls = iter(range(10**6))

    def not_deterministic(q_, k_, v_, scale, mask):
        return row_by_row(q_, k_, v_, scale, mask) + next(calls) * 1e-7

    assert sv.stock_span(q_, k_, v_, scale, row_by_row) == 6
    assert sv.stock_span(q_, k_, v_, scale, composite_from_three) == 2
    assert sv.stock_span(q_, k_, v_, scale, not_deterministic) == 0
    span = sv.stock_span(q_, k_, v_, scale)  # MLX's own, on this machine
    assert 1 <= span <= 6
    # Its meaning, checked independently: any `span` consecutive causal rows in one call equal
    # the one-row calls.
    ones = sv.sdpa_vector_rows_reference(q_, k_, v_, scale, "causal")
    for start in range(6 - span + 1):
        seen = 300 - 6 + start + span
        many = mlx(q_[:, :, start : start + span], k_[:, :, :seen], v_[:, :, :seen], scale,
                   "causal" if span > 1 else None)  # fmt: skip
        assert mx.array_equal(many, ones[:, :, start : start + span]).item(), start
    # Cached per bucket like the matmul's span.
    v1 = probe.probe_sdpa_stock_span(6, 512, *HEADS, mx.float32)
    assert v1.correct and v1.extra["span"] >= 1 and not v1.cached
    monkeypatch.setattr(sv, "stock_span", lambda *a_, **k_: pytest.fail("measured again"))
    assert probe.probe_sdpa_stock_span(6, 512, *HEADS, mx.float32).cached


def test_attention_stock_span_checks_every_window_of_rows_not_only_the_first():
    # Found on an AVX-512 CPU (MLX 0.32.4): 2- and 3-query calls matched one-query calls at
    # some key counts and not at others, so a chunk starting at a later row of the verify could
    # differ where the first rows matched. Stand-in: several queries sum another way when the
    # call holds 3 keys modulo 4. The first rows alone would claim 4 (294 + m keys for m <= 4).
    q_, k_, v_, scale, _ = a.attention_inputs(6, 300, *HEADS, mx.float32)(0)
    row_by_row = sv.sdpa_vector_rows_reference

    def off_at_some_key_counts(q_, k_, v_, scale, mask):
        out = row_by_row(q_, k_, v_, scale, mask)
        return out * (1 + 1e-6) if q_.shape[2] > 1 and k_.shape[2] % 4 == 3 else out

    assert sv.stock_span(q_, k_, v_, scale, off_at_some_key_counts) == 1


def test_attention_stock_span_sees_calls_straddling_the_one_pass_limit(monkeypatch):
    # MLX picks one pass or two by the call's key count: a call over 1,025 keys whose first row
    # alone sees 1,024 sums that row another way. Only the 2,048-key bucket holds such calls.
    mlx = sv._mlx_attention

    def two_pass_past_limit(q_, k_, v_, scale, mask):  # every row as one, but passes differ
        out = sv.sdpa_vector_rows_reference(q_, k_, v_, scale, mask, attention=mlx)
        return out * (1 + 1e-6) if k_.shape[2] > sv.ONE_PASS_KEYS else out

    monkeypatch.setattr(sv, "_mlx_attention", two_pass_past_limit)
    spans = {b: probe.probe_sdpa_stock_span(4, b, *HEADS, mx.float32) for b in probe.KEY_BUCKETS}
    assert {b: v.extra["span"] for b, v in spans.items()} == {512: 4, 2048: 1, 8192: 4}


def test_vector_rows_split_causal_rows_at_the_one_pass_limit(monkeypatch):
    # MLX picks one pass or two by the key count of the call, so a causal verify whose rows see
    # 1,021..1,028 keys goes in two calls: rows seeing <= 1,024 keys, then the rest.
    calls = []

    def one_call(q_, k_, v_, scale, causal):
        calls.append((q_.shape[2], k_.shape[2]))
        return sv.sdpa_vector_rows_reference(q_, k_, v_, scale, "causal" if causal else None)

    monkeypatch.setattr(sv, "_one_call", one_call)
    q_, k_, v_, scale, _ = a.attention_inputs(8, 1028, *HEADS, mx.float32)(0)
    out = sv.sdpa_vector_rows_trusted(q_, k_, v_, scale, "causal")
    assert calls == [(4, 1024), (4, 1028)]
    assert mx.array_equal(out, sv.sdpa_vector_rows_reference(q_, k_, v_, scale, "causal")).item()
    calls.clear()
    sv.sdpa_vector_rows_trusted(q_[:, :, :3], k_[:, :, :900], v_[:, :, :900], scale, "causal")
    sv.sdpa_vector_rows_trusted(q_, k_, v_, scale, None)  # no mask: every row sees all keys
    assert calls == [(3, 900), (8, 1028)]
    assert sv.sdpa_vector_rows(q_, k_, v_, scale, "causal") is None  # no CUDA here


def test_attention_is_timed_over_fresh_key_lengths(monkeypatch, kernel_cache):
    # Decoding meets a new key length every step; a twin caching per shape must pay for it.
    seen = []

    def record(q_, k_, v_, scale, mask=None):
        seen.append(k_.shape[2])
        return a.sdpa_small_q_emulated(q_, k_, v_, scale, mask)

    timed = probe.fresh_key_lengths(record, 512)
    inputs = a.attention_inputs(4, 512, *HEADS, mx.float32)(0)
    for _ in range(300):
        timed(*inputs)
    assert seen[:3] == [512, 511, 510] and len(set(seen[:256])) == 256 and min(seen) == 257
    timings = []

    def timer(kernel, twin, inputs_, **_):
        timings.append((kernel, twin))
        return 1.0, 2.0

    monkeypatch.setattr(probe, "time_pair", timer)
    v = probe.probe_sdpa(4, 512, *HEADS, mx.float32, kernel=record)
    assert v.enabled and v.max_rel_err < 1e-5  # values checked at the bucket's full length
    assert timings[0][0] is not record  # the timed pair is the fresh-length wrapper


@cpu_only
def test_failed_warm_up_leaves_nothing_routed_and_can_be_retried(monkeypatch, tiny_quantized):
    from mlx_lm.models import llama

    model, _ = tiny_quantized
    original = llama.scaled_dot_product_attention
    monkeypatch.setattr(probe, "time_pair", _fake_timer(1.0, 2.0))
    verifier = _emulated_verifier(max_rows=2)
    ctx = Pipeline.from_dict(_recipe({"kind": "lookup"}), target=tiny_quantized)
    from dspark_flow.strategy import BuildContext

    build = BuildContext(model=model, tokenizer=tiny_quantized[1], recipe=ctx.recipe)

    def broken(*a_, **k_):
        raise OSError("verdict file unwritable")

    monkeypatch.setattr(probe, "probe_sdpa", broken)
    with pytest.raises(OSError):
        verifier.warm_up(build)
    assert type(model.model.layers[0].mlp.up_proj) is nn.QuantizedLinear
    assert llama.scaled_dot_product_attention is original and verifier.kernel_calls == 0
    monkeypatch.undo()
    monkeypatch.setattr(probe, "time_pair", _fake_timer(1.0, 2.0))
    verifier.warm_up(build)  # a retry does the whole warm-up
    assert verifier.kernel_calls == 0 and verifier._router is not None
    verifier.restore()
    assert llama.scaled_dot_product_attention is original


@cpu_only
def test_invariant_mode_holds_for_plain_greedy_too(monkeypatch, tiny_quantized):
    # Plain greedy through an invariant verifier computes what its speculation computes, so its
    # one-token forwards take the kernel where the route chosen over all rows is the kernel's,
    # although the kernel is the slower one for one row (the probe-cost choice,
    # `prefer_stock: false`).
    def timer(kernel, twin, inputs, **_):
        rows = inputs[0].shape[0] if inputs[0].ndim == 2 else inputs[0].shape[2]  # x or q
        return (2.0, 1.0) if rows == 1 else (0.5, 3.0)

    monkeypatch.setattr(probe, "time_pair", timer)
    verifier = _emulated_verifier(max_rows=2, invariant=True, prefer_stock=False)
    greedy = Pipeline.from_dict(_recipe({"kind": "none"}), target=tiny_quantized, verifier=verifier)
    greedy.generate([504, 2365, 6354])
    assert verifier.kernel_calls > 0 and verifier.attention_calls > 0
    verifier.restore()


def test_verifier_probes_only_the_rows_its_drafter_can_ask_for(monkeypatch, tiny_quantized):
    # A first GPU warm-up pays for every probed shape: by default the verifier probes the verify
    # forwards the pipeline's drafter can make (largest draft + 1 rows), and a pipeline with a
    # longer drafter sharing it probes the rest.
    monkeypatch.setattr(probe, "time_pair", _fake_timer(1.0, 2.0))
    verifier = _emulated_verifier()

    def probed_rows() -> set[int]:
        return {v["rows"] for v in verifier.verdicts if v["kernel"] == "qmm_small_m"}

    greedy = Pipeline.from_dict(_recipe({"kind": "none"}), target=tiny_quantized, verifier=verifier)
    greedy.warm_up()
    assert probed_rows() == {1}
    short = _recipe({"kind": "lookup", "max_draft": 3})
    spec = Pipeline.from_dict(short, target=tiny_quantized, verifier=verifier).warm_up()
    assert probed_rows() == {1, 2, 3, 4}
    prompt = [504, 2365, 6354, 504, 2365, 6354, 504, 2365]
    assert spec.generate(prompt).token_ids == greedy.generate(prompt).token_ids
    Pipeline.from_dict(
        _recipe({"kind": "none"}), target=tiny_quantized, verifier=verifier
    ).warm_up()
    assert probed_rows() == {1, 2, 3, 4}  # fewer rows wanted: the warm state stands
    verifier.restore()
    pinned = _emulated_verifier(max_rows=2)
    Pipeline.from_dict(short, target=tiny_quantized, verifier=pinned).warm_up()
    assert {v["rows"] for v in pinned.verdicts if v["kernel"] == "qmm_small_m"} == {1, 2}
    pinned.restore()
    # Invariant mode routes all 16 whatever the drafter: plain greedy on the same target, and
    # every short prefill, must take the same kernels as speculation does.
    invariant = _emulated_verifier(invariant=True)
    Pipeline.from_dict(
        _recipe({"kind": "none"}), target=tiny_quantized, verifier=invariant
    ).warm_up()
    assert {v["rows"] for v in invariant.verdicts if v["kernel"] == "qmm_small_m"} == set(
        range(1, 17)
    )
    invariant.restore()


def test_bench_baseline_routes_every_verify_shape():
    # The baseline has no drafter but times the verify curve for K = 1..16 and must compute as
    # the compared pipelines do: its kernels verifier is pinned to 16 rows.
    from dspark_flow.bench.plan import greedy_pipeline
    from dspark_flow.recipe.load import loads_recipe

    recipe = loads_recipe("verifier: {kind: kernels}\ndrafter: {kind: lookup}\n")
    assert greedy_pipeline(recipe, target=None).recipe.verifier.max_rows == 16
    recipe = loads_recipe("verifier: {kind: kernels, max_rows: 4}\n")
    assert greedy_pipeline(recipe, target=None).recipe.verifier.max_rows == 4


def test_a_verdict_cache_that_cannot_be_written_says_so_once(monkeypatch, kernel_cache):
    # A directory where the lock file belongs used to disable saving without a word.
    (kernel_cache / (probe.CACHE_FILE + ".lock")).mkdir(parents=True)
    warnings = []
    monkeypatch.setattr(probe, "log", SimpleNamespace(warning=lambda *a, **kw: warnings.append(kw)))
    monkeypatch.setattr(probe, "time_pair", _fake_timer(1.0, 2.0))
    for rows in (2, 3):
        v = probe.probe_qmm(
            rows, 192, 576, 4, 32, mx.float32, mx.float32, kernel=q.qmm_small_m_reference
        )
        assert v.enabled and not v.cached  # the verdict still serves this process
    assert len(warnings) == 1 and warnings[0]["path"] == str(kernel_cache / probe.CACHE_FILE)
    assert not (kernel_cache / probe.CACHE_FILE).exists()
