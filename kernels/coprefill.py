"""CPU co-prefill: split a wide prefill matmul's rows between the GPU stream and the CPU stream.

On unified-memory Macs the CPU cores sit idle while the GPU runs a long prefill; giving them a
share of the rows of each quantized matmul can shorten it, if the CPU's share finishes no later
than the GPU's. Whether it does depends on the chip, the shape and the format, so the share is
chosen by a probe (several shares timed against the GPU alone) and used only where the best one
is at least 5% faster and gives the same values. On CUDA the CPU reads the GPU's memory through
page migration and the probe is expected to decline; on a CPU-only backend there is nothing to
split with, so it declines without measuring. Verdicts are cached like the kernels'.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from dspark_flow.kernels.probe import (
    MIN_GAIN,
    TOLERANCE,
    ProbeKey,
    Verdict,
    VerdictCache,
    affine_format,
    dtype_name,
    qmm_inputs,
    rejudged,
    relative_error,
    time_pair,
)

NAME = "coprefill_qmm"
VERSION = "1"
SHARES = (0.125, 0.25, 0.375)  # fraction of rows the CPU takes
ROW_BUCKETS = (64, 128, 256, 512)  # probed row counts; a prefill uses its largest bucket <= rows


def unavailable_reason() -> str | None:
    from dspark_flow.models.backend import backend_name

    backend = backend_name()
    if backend == "cpu":
        return "co-prefill is meaningless on a CPU-only backend"
    return None


def row_bucket(rows: int) -> int | None:
    """The probed bucket whose verdict applies to a prefill of `rows` rows (None: too few)."""
    fitting = [b for b in ROW_BUCKETS if b <= rows]
    return fitting[-1] if fitting else None


def coprefill_qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    share: float,
) -> mx.array:
    """`quantized_matmul(x, w, ...)` with the last `share` of the rows on the CPU stream."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    m_cpu = min(m - 1, int(round(m * share)))
    args: dict[str, Any] = {"transpose": True, "group_size": group_size, "bits": bits}
    if m_cpu <= 0:
        return mx.quantized_matmul(x, w, scales, biases, **args)
    top = mx.quantized_matmul(x2[: m - m_cpu], w, scales, biases, **args, stream=mx.gpu)
    bottom = mx.quantized_matmul(x2[m - m_cpu :], w, scales, biases, **args, stream=mx.cpu)
    return mx.concatenate([top, bottom], axis=0, stream=mx.gpu).reshape(*lead, w.shape[0])


def probe_coprefill(
    rows: int,
    n: int,
    k: int,
    bits: int,
    group_size: int,
    x_dtype: mx.Dtype,
    s_dtype: mx.Dtype,
    min_gain: float = MIN_GAIN,
    store: VerdictCache | None = None,
    force: bool = False,
) -> Verdict:
    """Whether (and with which CPU share, `verdict.extra["share"]`) to co-prefill this shape."""
    if (why := unavailable_reason()) is not None:
        return Verdict(False, why)
    store = store if store is not None else VerdictCache()
    fmt = affine_format(bits, group_size, s_dtype)
    key = ProbeKey.make(NAME, VERSION, fmt, rows, n, k, dtype_name(x_dtype))
    hit = None if force else store.get(key)
    if hit is not None and ("share" in hit.extra or not hit.correct):  # to enable, its share
        return rejudged(hit, min_gain)
    draw = qmm_inputs(rows, n, k, bits, group_size, x_dtype, s_dtype)
    inputs = draw(0)

    def twin(x, w, s, b, gs, bits_):
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits_)

    try:
        timings = {}
        for share in SHARES:

            def split(x, w, s, b, gs, bits_, share=share):
                return coprefill_qmm(x, w, s, b, gs, bits_, share)

            timings[share] = time_pair(split, twin, inputs, warmup=2, trials=5, reps=3)
        share, (split_ms, twin_ms) = min(timings.items(), key=lambda kv: kv[1][0] / kv[1][1])
        # two draws, as the other probes: a split that is right on one may not be on another
        err = max(relative_error(coprefill_qmm(*xs, share), twin(*xs)) for xs in (inputs, draw(1)))
    except Exception as e:  # e.g. a backend whose CPU stream cannot read GPU memory
        verdict = Verdict(False, f"co-prefill failed: {type(e).__name__}: {str(e)[:300]}")
        store.put(key, verdict)
        return verdict
    tol = TOLERANCE.get(dtype_name(twin(*inputs).dtype), 1e-2)
    faster = twin_ms >= split_ms * (1.0 + min_gain)
    if err > tol:
        reason = f"wrong values: error {err:.3g} > tolerance {tol:g}"
    elif not faster:
        reason = f"no gain: best share {share} takes {split_ms:.3f} ms vs GPU alone {twin_ms:.3f}"
    else:
        reason = f"CPU share {share}: {twin_ms / split_ms:.2f}x faster"
    extra = {"share": share, "by_share_ms": {str(s): t[0] for s, t in timings.items()}}
    verdict = Verdict(err <= tol and faster, reason, split_ms, twin_ms, err, extra, err <= tol)
    store.put(key, verdict)
    return verdict
