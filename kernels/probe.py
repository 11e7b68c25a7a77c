"""Probe before enable: a kernel runs for a shape only after it was timed against its twin and
gave the same values there, on this machine.

A verdict is keyed by everything that can change the answer (kernel name and source version,
weight format, rows, N, K, dtypes, backend, device name, MLX version) and cached as JSON under
`cache_root()/kernels/` (or `$DSPARK_FLOW_KERNEL_CACHE`), so each shape is probed once per
machine and software stack. Correctness is checked on two random draws (never zeros) with a
tolerance relative to the output's scale; a kernel that is wrong is refused however fast it is.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

from dspark_flow.arrays import as_float
from dspark_flow.files import write_text_atomic
from dspark_flow.log import get_logger

log = get_logger()

CACHE_ENV = "DSPARK_FLOW_KERNEL_CACHE"
CACHE_VERSION = 2  # 2: verdicts record `correct` apart from `enabled`
CACHE_FILE = "verdicts.json"
MIN_GAIN = 0.05  # the kernel must be at least 5% faster than its twin
# Largest error allowed, as a fraction of the twin's largest |output|. The twins themselves
# accumulate in half precision on some backends, hence the looser half-precision bounds.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}

Op = Callable[..., Any]


def cache_dir() -> Path:
    """$DSPARK_FLOW_KERNEL_CACHE, else `cache_root()/kernels`."""
    from dspark_flow.models.embedded import cache_subdir

    return cache_subdir(CACHE_ENV, "kernels")


@cache
def environment() -> dict[str, str]:
    """What a verdict depends on besides the shape: backend, device name, MLX version, and the
    CPU's BLAS (which library, how many threads: its blocking decides the CPU's row-invariant
    spans, and co-prefill runs on it)."""
    from dspark_flow.models.backend import backend_name, blas_status, mlx_version

    try:
        device = str(mx.device_info().get("device_name", "unknown"))
    except Exception:  # older MLX or a backend without device_info
        device = "unknown"
    status = blas_status()
    library = str(status.get("openblas")) if status.get("active") else "reference"
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or str(os.cpu_count())
    blas = f"{library}|threads={threads}"
    return {"backend": backend_name(), "device": device, "mlx": mlx_version(), "blas": blas}


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class ProbeKey:
    kernel: str  # e.g. "qmm_small_m"
    version: str  # the kernel source hash: editing the kernel re-probes
    fmt: str  # weight format, e.g. "affine-b4-g32-float16"
    rows: int
    n: int
    k: int
    dtype: str  # activations
    backend: str
    device: str
    mlx: str
    blas: str

    @classmethod
    def make(cls, kernel: str, version: str, fmt: str, rows: int, n: int, k: int, dtype: str):
        return cls(kernel, version, fmt, rows, n, k, dtype, **environment())

    def id(self) -> str:
        return "|".join(str(v) for v in asdict(self).values())


@dataclass
class Verdict:
    enabled: bool
    reason: str
    kernel_ms: float | None = None
    twin_ms: float | None = None
    max_rel_err: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the co-prefill share
    correct: bool = False  # values checked and within tolerance (enabled also needs "faster")
    cached: bool = False  # came from the cache file (not stored)

    @property
    def speedup(self) -> float | None:
        if self.kernel_ms and self.twin_ms:
            return self.twin_ms / self.kernel_ms
        return None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("cached")
        return data


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# What probes write into `extra`: a span is a row count, a share a fraction, bitwise a flag.
_EXTRA_CHECKS: dict[str, Callable[[Any], bool]] = {
    "span": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "share": lambda v: _is_number(v) and 0.0 <= v <= 1.0,
    "bitwise": lambda v: isinstance(v, bool),
}


def _well_typed(v: Verdict) -> bool:
    """A cached verdict is trusted only with the types a probe writes: "false" (a string) would
    read as true, a corrupt "enabled" must not switch a kernel on, and a span of "abc" must not
    fail every later run. No probe enables a kernel it found wrong: such an entry is damage."""
    timings = (v.kernel_ms, v.twin_ms, v.max_rel_err)
    return (
        isinstance(v.enabled, bool)
        and (v.correct is True or v.enabled is False)
        and isinstance(v.correct, bool)
        and isinstance(v.reason, str)
        and isinstance(v.extra, dict)
        and all(t is None or _is_number(t) for t in timings)
        and all(check(v.extra[name]) for name, check in _EXTRA_CHECKS.items() if name in v.extra)
    )


_UNWRITABLE: set[Path] = set()  # verdict files this process could not write (warned once)


class VerdictCache:
    """The verdict file: a version field and one entry per key id. Writes are atomic (temp
    file + rename) and re-read the file under a lock first, so concurrent probers merge."""

    def __init__(self, directory: Path | None = None):
        self.path = (directory or cache_dir()) / CACHE_FILE
        self._entries: dict[str, dict[str, Any]] | None = None

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError, RecursionError):  # unreadable, not JSON, nested too deep
            return {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return {}  # another layout: ignore it (it is replaced on the next write)
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def get(self, key: ProbeKey) -> Verdict | None:
        if self._entries is None:
            self._entries = self._read()
        raw = self._entries.get(key.id())
        if raw is None:
            return None
        try:
            verdict = Verdict(**raw, cached=True)
        except TypeError:  # an entry written by other code: probe again
            return None
        return verdict if _well_typed(verdict) else None  # a damaged entry: probe again

    def put(self, key: ProbeKey, verdict: Verdict) -> None:
        from filelock import FileLock  # a huggingface_hub dependency, so always present

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock"):
                entries = self._read()
                entries[key.id()] = verdict.to_json()
                text = json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1)
                write_text_atomic(text, self.path)
            self._entries = entries
        except OSError as exc:  # a read-only cache only costs re-probing next time
            if self.path not in _UNWRITABLE:  # once a process, never silently (a directory
                _UNWRITABLE.add(self.path)  # where the lock file belongs, a read-only home)
                log.warning(
                    "kernel verdicts not saved; shapes will be probed again next run",
                    path=str(self.path),
                    error=str(exc),
                )
            if self._entries is not None:
                self._entries[key.id()] = verdict.to_json()


def _sync(outputs: Any) -> None:
    mx.eval(outputs)
    mx.synchronize()


def time_pair(
    kernel: Op,
    twin: Op,
    inputs: Sequence[Any],
    warmup: int = 3,
    trials: int = 7,
    reps: int | None = None,
) -> tuple[float, float]:
    """Median milliseconds per call of kernel and twin. Each trial queues `reps` calls and
    evaluates them together (launch cost included, the per-eval overhead spread thin: by
    default enough calls for ~2 ms of the faster one's work, 4 to 50); kernel and twin
    alternate so that clock or thermal drift hits both alike. Sized by the faster of the two:
    sized by a slow twin, a fast kernel's few calls would carry the evaluation's own overhead
    (on the H200: qmv_rows, 20 calls against a 0.1-0.3 ms twin, read 40-80 us)."""
    _sync(list(inputs))
    for _ in range(warmup):
        _sync([kernel(*inputs), twin(*inputs)])
    if reps is None:
        per_call = []
        for fn in (kernel, twin):
            t0 = time.perf_counter()
            _sync([fn(*inputs) for _ in range(16)])
            per_call.append((time.perf_counter() - t0) / 16)
        reps = max(4, min(50, int(2e-3 / max(min(per_call), 1e-9))))
    samples: dict[int, list[float]] = {0: [], 1: []}
    for t in range(trials):
        order = (0, 1) if t % 2 == 0 else (1, 0)
        for which in order:
            fn = kernel if which == 0 else twin
            mx.synchronize()
            t0 = time.perf_counter()
            _sync([fn(*inputs) for _ in range(reps)])
            samples[which].append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(samples[0]), statistics.median(samples[1])


def relative_error(out: Any, ref: mx.array) -> float:
    """max |out - ref| / max |ref|; inf when shapes or dtypes differ or values are not finite."""
    if not isinstance(out, mx.array) or out.shape != ref.shape or out.dtype != ref.dtype:
        return float("inf")
    diff = as_float(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max())
    scale = as_float(mx.abs(ref.astype(mx.float32)).max())
    err = diff / max(scale, 1e-30)
    return err if err == err else float("inf")  # NaN -> inf


def rejudged(verdict: Verdict, min_gain: float) -> Verdict:
    """A cached verdict judged against this caller's `min_gain`: the cache stores what was
    measured (timings, correctness), and the speedup a caller demands is not part of its key."""
    if not verdict.correct or not verdict.kernel_ms or not verdict.twin_ms:
        return verdict
    faster = verdict.twin_ms >= verdict.kernel_ms * (1.0 + min_gain)
    if faster == verdict.enabled:
        return verdict
    reason = _speed_reason(
        faster, verdict.kernel_ms, verdict.twin_ms, verdict.max_rel_err, min_gain
    )
    return replace(verdict, enabled=faster, reason=reason)


def _speed_reason(
    faster: bool, kernel_ms: float, twin_ms: float, err: float | None, min_gain: float
) -> str:
    if faster:
        return f"{twin_ms / kernel_ms:.2f}x faster, error {err or 0.0:.2g}"
    return f"not faster by {min_gain:.0%}: {kernel_ms:.4f} ms vs twin {twin_ms:.4f} ms"


def probe(
    key: ProbeKey,
    kernel: Op,
    twin: Op,
    make_inputs: Callable[[int], Sequence[Any]],
    tol: float,
    min_gain: float = MIN_GAIN,
    store: VerdictCache | None = None,
    force: bool = False,
    exact: Op | None = None,
    timing: tuple[Op, Op] | None = None,
    bitwise: bool = False,
) -> Verdict:
    """The verdict for `key`: from the cache, else measured (and cached).

    `make_inputs(seed)` draws random inputs; `kernel(*inputs)` returns the output, or None
    where it has no implementation (declined, not cached: nothing was measured).
    `exact`, where given, computes the values on the host in float64 and both kernel and twin
    are measured against it: the kernel passes if its error is within `tol` or no larger than
    the twin's own (MLX's CUDA float32 matmuls use TF32 by default, so a twin can be further
    from the true values than `tol`).
    `timing`, where given, is the (kernel, twin) pair that is timed instead of the two above
    (same work, called the way the caller's workload calls them).
    `bitwise` also records whether the kernel reproduced the twin bit for bit on both draws
    (`extra["bitwise"]`), for callers that need exactly the twin's values.
    """
    store = store if store is not None else VerdictCache()
    if not force and (hit := store.get(key)) is not None:
        return rejudged(hit, min_gain)
    draws = [make_inputs(0), make_inputs(1)]
    try:
        outs = [kernel(*inputs) for inputs in draws]
        if any(out is None for out in outs):
            return Verdict(False, "no kernel for these inputs on this backend")
        bar = tol
        same = None
        if exact is None:
            twins = [twin(*inputs) for inputs in draws]
            errs = [relative_error(out, ref) for out, ref in zip(outs, twins)]
            if bitwise:
                same = all(mx.array_equal(o, t).item() for o, t in zip(outs, twins))
        else:
            refs = [exact(*inputs) for inputs in draws]
            errs = [relative_error(out, ref) for out, ref in zip(outs, refs)]
            twin_err = max(relative_error(twin(*d), ref) for d, ref in zip(draws, refs))
            # The twin's own error raises the bar (TF32), within reason: never past 10x tol,
            # and a twin that is not even finite sets nothing.
            bar = min(max(tol, twin_err), 10 * tol) if math.isfinite(twin_err) else tol
        kernel_ms, twin_ms = time_pair(*(timing or (kernel, twin)), draws[0])
    except Exception as e:  # a kernel that fails to compile or launch is refused, not fatal
        verdict = Verdict(False, f"kernel failed: {type(e).__name__}: {str(e)[:300]}")
        store.put(key, verdict)
        return verdict
    err = max(errs)  # inf where not finite (relative_error), so never within a finite bar
    faster = twin_ms >= kernel_ms * (1.0 + min_gain)
    if err > bar:
        reason = f"wrong values: error {err:.3g} of output scale > tolerance {bar:g}"
    else:
        reason = _speed_reason(faster, kernel_ms, twin_ms, err, min_gain)
    extra: dict[str, Any] = {} if exact is None else {"twin_err": twin_err}
    if same is not None:
        extra["bitwise"] = same
    verdict = Verdict(err <= bar and faster, reason, kernel_ms, twin_ms, err, extra, err <= bar)
    store.put(key, verdict)
    return verdict


def _identity(kernel: Op | None, real: tuple[str, str, Op]) -> tuple[str, str, Op]:
    """Key name, version and function of what is probed: the real kernel, or an injected one
    (tests inject fakes), keyed by its own name."""
    if kernel is None:
        return real
    return f"injected:{getattr(kernel, '__name__', 'kernel')}", "injected", kernel


# -- the qmm_small_m probe -----------------------------------------------------------------


# A quantized matmul's arguments: x, w, scales, biases, group_size, bits.
QmmArgs = tuple[mx.array, mx.array, mx.array, mx.array | None, int, int]


def qmm_inputs(
    rows: int, n: int, k: int, bits: int, group_size: int, x_dtype: mx.Dtype, s_dtype: mx.Dtype
) -> Callable[[int], QmmArgs]:
    """Random (x, w, scales, biases, group_size, bits) for one verify shape."""

    def make(seed: int) -> QmmArgs:
        kx, kw = mx.random.split(mx.random.key(seed))
        x = mx.random.normal((rows, k), key=kx).astype(x_dtype)
        w, s, b = mx.quantize(
            mx.random.normal((n, k), key=kw) * 0.05, group_size=group_size, bits=bits
        )
        s, b = s.astype(s_dtype), b.astype(s_dtype)
        mx.eval(x, w, s, b)
        return x, w, s, b, group_size, bits

    return make


def affine_format(bits: int, group_size: int, s_dtype: mx.Dtype) -> str:
    """The weight-format part of a probe key, e.g. "affine-b4-g32-float16"."""
    return f"affine-b{bits}-g{group_size}-{dtype_name(s_dtype)}"


def probe_qmm(
    rows: int,
    n: int,
    k: int,
    bits: int,
    group_size: int,
    x_dtype: mx.Dtype,
    s_dtype: mx.Dtype,
    kernel: Op | None = None,
    min_gain: float = MIN_GAIN,
    store: VerdictCache | None = None,
    force: bool = False,
) -> Verdict:
    """Whether `qmm_small_m` should replace the stock quantized matmul for this shape.

    `kernel` replaces the real kernel (tests inject fakes); it is keyed by its own name."""
    from dspark_flow.kernels import qmm_small_m as q

    make = qmm_inputs(rows, n, k, bits, group_size, x_dtype, s_dtype)
    if (
        kernel is None
        and (why := q.shape_reason(rows, n, k, bits, group_size, x_dtype, s_dtype)) is not None
    ):
        return Verdict(False, why)  # declined before any timing; not cached
    name, version, fn = _identity(kernel, (q.KERNEL_NAME, q.KERNEL_VERSION, q.qmm_small_m))
    fmt = affine_format(bits, group_size, s_dtype)
    key = ProbeKey.make(name, version, fmt, rows, n, k, dtype_name(x_dtype))
    out_dtype = dtype_name(q.output_dtype(x_dtype, s_dtype))
    tol = TOLERANCE.get(out_dtype, 1e-2)
    return probe(key, fn, q.qmm_small_m_reference, make, tol, min_gain, store, force)


def probe_stock_span(
    max_rows: int,
    n: int,
    k: int,
    bits: int,
    group_size: int,
    x_dtype: mx.Dtype,
    s_dtype: mx.Dtype,
    store: VerdictCache | None = None,
    force: bool = False,
) -> Verdict:
    """How many rows (of 1..max_rows) MLX's own quantized matmul computes exactly as it computes
    one row, for this shape on this machine: `extra["span"]` (kernels/stock_rows.py). Checked
    on two random draws (the smaller span counts); cached like the kernels' verdicts."""
    from dspark_flow.kernels import stock_rows as sr

    fmt = affine_format(bits, group_size, s_dtype)
    key = ProbeKey.make("stock_row_span", "1", fmt, max_rows, n, k, dtype_name(x_dtype))
    make = qmm_inputs(max_rows, n, k, bits, group_size, x_dtype, s_dtype)

    def measure() -> int:
        return min(sr.invariant_span(*make(seed)) for seed in (0, 1))

    return _span_verdict(key, "matmul", "rows", measure, store, force)


def probe_dense_span(
    max_rows: int,
    n: int,
    k: int,
    dtype: mx.Dtype,
    store: VerdictCache | None = None,
    force: bool = False,
    w_dtype: mx.Dtype | None = None,
) -> Verdict:
    """How many rows (of 1..max_rows) MLX's own dense matmul `x @ w.T` computes exactly as it
    computes one row, for this shape on this machine: `extra["span"]`; two random draws (the
    smaller span counts), cached like the kernels' verdicts. Activations in `dtype`, weights
    in `w_dtype` (default the same)."""
    from dspark_flow.kernels import stock_rows as sr

    key, make = _dense_probe("dense_row_span", max_rows, n, k, dtype, w_dtype)

    def measure() -> int:
        return min(sr.invariant_span(*make(seed), matmul=sr.dense_reference) for seed in (0, 1))

    return _span_verdict(key, "dense matmul", "rows", measure, store, force)


def probe_dense_floor(
    max_rows: int,
    n: int,
    k: int,
    dtype: mx.Dtype,
    store: VerdictCache | None = None,
    force: bool = False,
    w_dtype: mx.Dtype | None = None,
) -> Verdict:
    """From how many rows (of 1..max_rows) MLX's own dense matmul computes every row as its
    product of max_rows rows does, fewer rows padded with zero rows to that count:
    `extra["floor"]` (`stock_rows.padded_floor`; 0: none). Two random draws (the larger floor
    counts), cached like the spans."""
    from dspark_flow.kernels import stock_rows as sr

    key, make = _dense_probe("dense_row_floor", max_rows, n, k, dtype, w_dtype)

    def measure() -> int:
        floors = [sr.padded_floor(*make(seed)[:2]) for seed in (0, 1)]
        return 0 if 0 in floors else max(floors)

    return _span_verdict(key, "dense matmul", "rows", measure, store, force, "floor")


def _dense_probe(
    name: str, rows: int, n: int, k: int, dtype: mx.Dtype, w_dtype: mx.Dtype | None
) -> tuple[ProbeKey, Callable[[int], tuple[mx.array, mx.array, None, None, int, int]]]:
    """A dense layer probe's cache key and its random (x, w) draws (in the quantized calling
    convention): activations in `dtype`, weights in `w_dtype` (default the same)."""
    w_dtype = w_dtype or dtype
    key = ProbeKey.make(name, "1", f"dense-{dtype_name(w_dtype)}", rows, n, k, dtype_name(dtype))

    def make(seed: int) -> tuple[mx.array, mx.array, None, None, int, int]:
        kx, kw = mx.random.split(mx.random.key(seed))
        x = mx.random.normal((rows, k), key=kx).astype(dtype)
        w = (mx.random.normal((n, k), key=kw) * 0.05).astype(w_dtype)
        mx.eval(x, w)
        return x, w, None, None, 0, 0

    return key, make


def _span_verdict(
    key: ProbeKey,
    what: str,
    unit: str,
    measure: Callable[[], int],
    store: VerdictCache | None,
    force: bool,
    field: Literal["span", "floor"] = "span",
) -> Verdict:
    """A stock op's span (`extra["span"]`: rows 1..span computed as one row is) or floor
    (`extra["floor"]`: from that many rows on, fewer padded, every row computed as all rows
    compute it), measured once and cached like the kernels' verdicts. An op that fails here
    refuses the route, not the warm-up."""
    store = store if store is not None else VerdictCache()
    if not force and (hit := store.get(key)) is not None:
        return hit
    try:
        count = measure()
    except Exception as e:
        verdict = Verdict(False, f"stock {what} failed: {type(e).__name__}: {str(e)[:300]}")
    else:
        if not count:
            reason = (
                "not deterministic" if field == "span" else "no row count from which rows agree"
            )
        elif field == "span":
            reason = f"{unit} 1..{count} computed as one row is"
        else:
            reason = f"{unit} {count}.. computed alike (fewer padded to {count})"
        verdict = Verdict(count > 0, reason, extra={field: count}, correct=count > 0)
    store.put(key, verdict)
    return verdict


def probe_qmm_chunks(
    rows: int,
    n: int,
    k: int,
    bits: int,
    group_size: int,
    x_dtype: mx.Dtype,
    s_dtype: mx.Dtype,
    chunk: int,
    min_gain: float = MIN_GAIN,
    store: VerdictCache | None = None,
    force: bool = False,
) -> Verdict:
    """MLX's quantized matmul over chunks of at most `chunk` rows, timed against the same matmul
    over all rows at once (`kernel_ms`: what the chunks cost; the invariant mode's alternative
    to a kernel past the stock matmul's invariant span)."""
    from dspark_flow.kernels import qmm_small_m as q
    from dspark_flow.kernels import stock_rows as sr

    make = qmm_inputs(rows, n, k, bits, group_size, x_dtype, s_dtype)
    fmt = affine_format(bits, group_size, s_dtype)
    key = ProbeKey.make(sr.NAME, f"chunk{chunk}", fmt, rows, n, k, dtype_name(x_dtype))
    tol = TOLERANCE.get(dtype_name(q.output_dtype(x_dtype, s_dtype)), 1e-2)
    return probe(key, sr.chunked(chunk), sr.qmm_stock_reference, make, tol, min_gain, store, force)


def probe_qmv_rows(
    rows: int,
    n: int,
    k: int,
    bits: int,
    group_size: int,
    x_dtype: mx.Dtype,
    s_dtype: mx.Dtype,
    fused: int,
    kernel: Op | None = None,
    min_gain: float = MIN_GAIN,
    store: VerdictCache | None = None,
    force: bool = False,
) -> Verdict:
    """`qmv_rows` (dequantization variant `fused`) against MLX's one-row matmul, row by row:
    correct to the tolerance, and `extra["bitwise"]` where it reproduced MLX bit for bit.
    `kernel` replaces the real kernel (tests inject fakes); it is keyed by its own name."""
    from dspark_flow.kernels import qmv_rows as qr

    make = qmm_inputs(rows, n, k, bits, group_size, x_dtype, s_dtype)
    if (
        kernel is None
        and (why := qr.shape_reason(rows, n, k, bits, group_size, x_dtype, s_dtype)) is not None
    ):
        return Verdict(False, why)  # declined before any timing; not cached
    name, version, fn = _identity(kernel, (qr.KERNEL_NAME, qr.KERNEL_VERSION, qr.variant(fused)))
    fmt = f"{affine_format(bits, group_size, s_dtype)}-fused{fused}"
    key = ProbeKey.make(name, version, fmt, rows, n, k, dtype_name(x_dtype))
    tol = TOLERANCE.get(dtype_name(x_dtype), 1e-2)
    return probe(key, fn, qr.qmv_rows_reference, make, tol, min_gain, store, force, bitwise=True)


# -- the sdpa_small_q probe ----------------------------------------------------------------

# Key-length buckets: a verify over T cached keys uses the verdict of the smallest bucket >= T
# (the probe checks values at the bucket's largest T and times lengths from there down to half
# of it); longer contexts take the stock path, except in the verifier's invariant mode.
KEY_BUCKETS = (512, 2048, 8192)


def key_bucket(keys: int) -> int | None:
    """The probed bucket whose verdict applies to attention over `keys` keys (None: too long)."""
    return next((b for b in KEY_BUCKETS if keys <= b), None)


def fresh_key_lengths(fn: Op, keys: int) -> Op:
    """`fn` called as decoding calls attention: each call over a key length the previous calls
    did not use (walking down from `keys` through keys // 2 lengths, then round again). A twin
    that caches work per shape (cuDNN graphs) pays for it here as it does in decoding, where
    the key length grows every step; timed at one repeated length it would not."""
    calls = itertools.count()
    span = max(1, keys // 2)

    def call(q: Any, k: Any, v: Any, scale: float, mask: Any = None) -> Any:
        t = max(keys - next(calls) % span, q.shape[2])  # causal needs keys >= queries
        return fn(q, k[:, :, :t], v[:, :, :t], scale, mask)

    return call


def _attention_draws(
    queries: int, keys: int, second: int, q_heads: int, kv_heads: int, head_dim: int,
    dtype: mx.Dtype,
) -> Callable[[int], tuple[Any, ...]]:  # fmt: skip
    """make(seed): draw 0 (also timed) over `keys` keys, draw 1 over min(keys, `second`); one
    query goes without a mask, as mlx-lm calls it."""
    from dspark_flow.kernels import sdpa_small_q as a

    draws = [a.attention_inputs(queries, n, q_heads, kv_heads, head_dim, dtype)
             for n in (keys, min(keys, second))]  # fmt: skip

    def make(seed: int) -> tuple[Any, ...]:
        q, k, v, scale, mask = draws[seed](seed)
        return q, k, v, scale, mask if queries > 1 else None

    return make


def probe_sdpa(
    queries: int,
    keys: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: mx.Dtype,
    kernel: Op | None = None,
    min_gain: float = MIN_GAIN,
    store: VerdictCache | None = None,
    force: bool = False,
) -> Verdict:
    """Whether `sdpa_small_q` should replace MLX's attention for `queries` causal queries over
    `keys` cached keys (the key/value slices strided as mlx-lm's cache hands them over).
    Values are checked at `keys`; the timing walks over fresh key lengths (`fresh_key_lengths`)."""
    from dspark_flow.kernels import sdpa_small_q as a

    # Draw 1 at a few keys, where some warps of the kernel have no key at all.
    make = _attention_draws(queries, keys, queries + 19, q_heads, kv_heads, head_dim, dtype)
    why = a.shape_reason(queries, q_heads, kv_heads, head_dim, dtype, True, keys)
    if kernel is None and why is not None:
        return Verdict(False, why)  # declined before any timing; not cached
    name, version, fn = _identity(kernel, (a.KERNEL_NAME, a.KERNEL_VERSION, a.sdpa_small_q))
    fmt = f"attention-hq{q_heads}-hkv{kv_heads}-causal-fresh-lengths"
    key = ProbeKey.make(name, version, fmt, queries, keys, head_dim, dtype_name(dtype))
    tol = TOLERANCE.get(dtype_name(dtype), 1e-2)
    twin, exact = a.sdpa_small_q_reference, a.sdpa_small_q_float64
    timing = (fresh_key_lengths(fn, keys), fresh_key_lengths(twin, keys))
    return probe(key, fn, twin, make, tol, min_gain, store, force, exact, timing)


def _rows_draw_keys(queries: int, keys: int) -> int:
    """The second draw's key count for the probes of MLX's one-query arithmetic: a few keys,
    or for buckets past MLX's one-pass limit across it (rows on both sides)."""
    from dspark_flow.kernels import sdpa_vector_rows as sv

    return queries + 19 if keys <= sv.ONE_PASS_KEYS else sv.ONE_PASS_KEYS + max(1, queries // 2)


def probe_sdpa_stock_span(
    max_queries: int,
    keys: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: mx.Dtype,
    store: VerdictCache | None = None,
    force: bool = False,
) -> Verdict:
    """How many causal query rows (of 1..max_queries) MLX's own attention computes exactly as
    it computes one, for every call of this key bucket on this machine: `extra["span"]`
    (`sdpa_vector_rows.stock_span`, the smaller over the two draws); cached like the kernels'
    verdicts."""
    from dspark_flow.kernels import sdpa_vector_rows as sv

    fmt = f"attention-hq{q_heads}-hkv{kv_heads}-causal"
    # Version 2: the straddling draw below (version 1 missed it and claimed 3 rows at 2,048).
    # Version 3: every window of rows, not only the first (2 missed key counts where 2- and
    # 3-row calls round differently on AVX-512 CPUs).
    key = ProbeKey.make("sdpa_stock_span", "3", fmt, max_queries, keys, head_dim, dtype_name(dtype))
    lower = max((b for b in KEY_BUCKETS if b < keys), default=0)
    if lower < sv.ONE_PASS_KEYS < keys:
        # MLX picks one pass or two by the call's key count, so a call of this bucket can hold
        # more keys than the one-pass limit while its first row alone holds fewer: draw 1's
        # m-row calls (limit - 1 + m keys) straddle the limit for every m >= 2.
        second = sv.ONE_PASS_KEYS - 1 + max_queries
    else:
        second = max_queries + 19
    make = _attention_draws(max_queries, keys, second, q_heads, kv_heads, head_dim, dtype)

    def measure() -> int:
        return min(sv.stock_span(*make(seed)[:4]) for seed in (0, 1))

    return _span_verdict(key, "attention", "query rows", measure, store, force)


def probe_sdpa_rows(
    queries: int,
    keys: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: mx.Dtype,
    kernel: Op | None = None,
    min_gain: float = MIN_GAIN,
    store: VerdictCache | None = None,
    force: bool = False,
) -> Verdict:
    """`sdpa_vector_rows` against MLX's attention one query row at a time: correct to the
    tolerance, and `extra["bitwise"]` where every row reproduced MLX bit for bit. Draw 0 at the
    bucket's key count; draw 1 at a few keys, or for buckets past MLX's one-pass limit across
    it (rows on both sides, the kernel's split). Timed at fresh key lengths, as decoding calls
    it. `kernel` replaces the real kernel (tests inject fakes)."""
    from dspark_flow.kernels import sdpa_vector_rows as sv

    make = _attention_draws(
        queries, keys, _rows_draw_keys(queries, keys), q_heads, kv_heads, head_dim, dtype
    )
    if (
        kernel is None
        and (why := sv.shape_reason(queries, q_heads, kv_heads, head_dim, dtype)) is not None
    ):
        return Verdict(False, why)  # declined before any timing; not cached
    name, version, fn = _identity(
        kernel, (sv.KERNEL_NAME, sv.KERNEL_VERSION, sv.sdpa_vector_rows_trusted)
    )
    fmt = f"attention-hq{q_heads}-hkv{kv_heads}-causal-fresh-lengths"
    key = ProbeKey.make(name, version, fmt, queries, keys, head_dim, dtype_name(dtype))
    tol = TOLERANCE.get(dtype_name(dtype), 1e-2)
    twin = sv.sdpa_vector_rows_reference
    timing = (fresh_key_lengths(fn, keys), fresh_key_lengths(twin, keys))
    return probe(key, fn, twin, make, tol, min_gain, store, force, timing=timing, bitwise=True)
