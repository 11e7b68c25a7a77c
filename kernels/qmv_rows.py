"""`qmv_rows`: MLX's per-row quantized matmul (qmv) arithmetic for up to 16 rows in one launch,
so that each row comes out bit for bit as MLX computes it for a single row.

Why: the verifier's invariant mode needs a token's logits not to depend on how many tokens one
forward holds. On CUDA, MLX computes 1..7 float32 rows with its qmv kernel, which is
row-invariant and cheaper per call than any custom kernel (benchmarks §4), and switches to a
tiled GEMM at 8 rows where K is a multiple of max(64, group size) (the embedded model's
shapes), which rounds differently; kernels/stock_rows.py measures where, per shape. Past that
point this kernel repeats qmv's arithmetic for every row, loading each weight once for all of
them: lane l of the warp that owns an output column takes elements l*8 .. l*8+7 of every
256-element step, dequantizes them as `q * scale + bias`, keeps one float32 partial sum per
element (`fma(x, w, sum)`), adds the eight in order and reduces across the warp with
`cg::reduce`. Equality with MLX is measured, not assumed: the probe compares the kernel with
MLX's one-row results bit for bit (`bitwise` in the verdict), in two rounding variants of the
dequantization (fused multiply-add, as nvcc contracts qmv's `w * scale + bias`, or not), and
the verifier takes it only where one of them is exact.

Three implementations share one contract (float32 activations, affine 4- or 8-bit weights):
  * `qmv_rows_reference`: the twin, MLX's quantized matmul one row at a time (the values the
    kernel must reproduce);
  * `qmv_rows_emulated`: the kernel's summation order in plain MLX ops (checks the layout and
    the lane split on any backend, to rounding);
  * `qmv_rows`: the dispatcher: the CUDA kernel on CUDA, None elsewhere (with a reason).
No Metal kernel: MLX's Metal qmv is another algorithm, whose rounding this one does not match.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import mlx.core as mx

from dspark_flow.kernels.cuda_common import CUDA_FLOAT_CONVERSIONS, cuda_backend

KERNEL_NAME = "qmv_rows"
ELEMS_PER_LANE = 8  # qmv's elems_per_thread for float32 activations
VARIANTS = (1, 0)  # 1: dequantize with a fused multiply-add (what nvcc makes of qmv's), 0: not
_WARPS = 4  # per block; one warp per output column

_CUDA_HEADER = CUDA_FLOAT_CONVERSIONS + "#include <cooperative_groups/reduce.h>\n"

# Template constants: BITS, GS, MB (rows bucket: a power of two >= M), EPL (elements per lane
# and step), FUSED (dequantization variant).
_CUDA_SOURCE = r"""
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[0];
  auto warp = cg::tiled_partition<32>(cg::this_thread_block());
  const int col = blockIdx.x * (blockDim.x / 32) + warp.meta_group_rank();
  if (col >= N) return;  // a whole warp at once: its reduction below is not split
  const int lane = warp.thread_rank();
  const uint32_t* wrow = w + size_t(col) * (K * BITS / 32);
  const auto* srow = scales + size_t(col) * (K / GS);
  const auto* brow = biases + size_t(col) * (K / GS);
  float sums[MB][EPL];
#pragma unroll
  for (int m = 0; m < MB; ++m) {
#pragma unroll
    for (int j = 0; j < EPL; ++j) sums[m][j] = 0.0f;
  }
  // idx is a multiple of EPL = 8, so a tile's weights are whole words and its activations
  // two 16-byte vectors where the row pointer is aligned (loads only: the sums are qmv's).
  const bool vec = (reinterpret_cast<uintptr_t>(x) % 16) == 0 && K % 4 == 0;
  auto tile = [&](int idx) {
    const float s = df_to_f(srow[idx / GS]);
    const float b = df_to_f(brow[idx / GS]);
    uint32_t words[EPL * BITS / 32];
#pragma unroll
    for (int i = 0; i < EPL * BITS / 32; ++i) words[i] = __ldg(wrow + idx * BITS / 32 + i);
    float wd[EPL];
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const float q = float((words[j * BITS / 32] >> ((j * BITS) % 32)) & kMask);
      wd[j] = FUSED ? fmaf(q, s, b) : __fadd_rn(__fmul_rn(q, s), b);
    }
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (MB == 1 || m < M) {
        const float* xm = x + size_t(m) * K + idx;
        float xv[EPL];
        if (vec) {
          const float4 lo = __ldg(reinterpret_cast<const float4*>(xm));
          const float4 hi = __ldg(reinterpret_cast<const float4*>(xm) + 1);
          xv[0] = lo.x; xv[1] = lo.y; xv[2] = lo.z; xv[3] = lo.w;
          xv[4] = hi.x; xv[5] = hi.y; xv[6] = hi.z; xv[7] = hi.w;
        } else {
#pragma unroll
          for (int j = 0; j < EPL; ++j) xv[j] = xm[j];
        }
#pragma unroll
        for (int j = 0; j < EPL; ++j) sums[m][j] = fmaf(xv[j], wd[j], sums[m][j]);
      }
    }
  };
  constexpr int kStep = 32 * EPL;
  for (int r = 0; r < K / kStep; ++r) tile(lane * EPL + r * kStep);
  if (K % kStep) {
    const int idx = lane * EPL + K - K % kStep;
    if (idx < K) tile(idx);
  }
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    if (MB == 1 || m < M) {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < EPL; ++j) sum += sums[m][j];
      sum = cg::reduce(warp, sum, cg::plus<float>());
      if (lane == 0) out[size_t(m) * N + col] = sum;
    }
  }
"""


_kernels: dict[str, Any] = {}


# 'cuda' where this module has a kernel for the default device, else None.
kernel_backend = cuda_backend


def shape_reason(
    rows: int,
    n: int,
    k: int,
    bits: int,
    group_size: int,
    x_dtype: mx.Dtype,
    s_dtype: mx.Dtype,
    backend: str | None = None,
) -> str | None:
    """Why `qmv_rows` would decline this shape, or None when the kernel would run: CUDA and
    float32 activations only, else `qmm_small_m`'s limits (format, rows, K, dtypes)."""
    from dspark_flow.kernels import qmm_small_m

    backend = backend if backend is not None else kernel_backend()
    if backend is None:
        from dspark_flow.models.backend import backend_name

        return f"no {KERNEL_NAME} kernel for the {backend_name()} backend"
    if x_dtype != mx.float32:
        return f"activations {x_dtype}: the kernel repeats qmv's float32 arithmetic only"
    return qmm_small_m.shape_reason(rows, n, k, bits, group_size, x_dtype, s_dtype, backend)


def _kernel() -> Any:
    if "cuda" not in _kernels:
        _kernels["cuda"] = mx.fast.cuda_kernel(
            name=KERNEL_NAME,
            input_names=["x", "w", "scales", "biases"],
            output_names=["out"],
            source=_CUDA_SOURCE,
            header=_CUDA_HEADER,
        )
    return _kernels["cuda"]


def _launch(x2: mx.array, w, scales, biases, group_size: int, bits: int, fused: int) -> mx.array:
    from dspark_flow.kernels.qmm_small_m import rows_bucket

    m, n = x2.shape[0], w.shape[0]
    return _kernel()(
        inputs=[x2, w, scales, biases],
        template=[
            ("BITS", bits),
            ("GS", group_size),
            ("MB", rows_bucket(m)),
            ("EPL", ELEMS_PER_LANE),
            ("FUSED", fused),
        ],  # fmt: skip
        grid=(-(-n // _WARPS) * _WARPS * 32, 1, 1),
        threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[mx.float32],
    )[0]


def qmv_rows(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    fused: int = 1,
) -> mx.array | None:
    """`x @ dequant(w).T` through the CUDA kernel, or None where it has none. x: (..., K)."""
    from dspark_flow.kernels.qmm_small_m import layout_reason

    if layout_reason(x, w, scales, biases, group_size, bits) is not None:
        return None
    k = x.shape[-1]
    if shape_reason(x.size // k, w.shape[0], k, bits, group_size, x.dtype, scales.dtype):
        return None
    return qmv_rows_trusted(x, w, scales, biases, group_size, bits, fused)


def qmv_rows_trusted(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    fused: int = 1,
) -> mx.array:
    """`qmv_rows` without the per-call checks, for a caller that probed this layer's shape."""
    lead, k = x.shape[:-1], x.shape[-1]
    y = _launch(x.reshape(-1, k), w, scales, biases, group_size, bits, fused)
    return y.reshape(*lead, w.shape[0])


def variant(fused: int):
    """The trusted kernel with its dequantization variant bound (the verifier's calling
    convention: x, w, scales, biases, group_size, bits)."""

    def qmv_rows_kernel(x, w, scales, biases, group_size, bits):
        return qmv_rows_trusted(x, w, scales, biases, group_size, bits, fused)

    return qmv_rows_kernel


def qmv_rows_reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
) -> mx.array:
    """The twin: MLX's quantized matmul, one row at a time."""
    from dspark_flow.kernels.stock_rows import qmm_stock_chunked

    return qmm_stock_chunked(x, w, scales, biases, group_size, bits, chunk=1)


def qmv_rows_emulated(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
) -> mx.array:
    """The kernel's lane split and summation order in plain MLX (float32; rounding aside):
    per lane and element a sum over the 256-element steps, then the eight elements, then the
    lanes. Slow; it checks the layout where no kernel runs."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    shifts = mx.arange(32 // bits, dtype=mx.uint32) * bits
    q = ((w[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(n, k).astype(mx.float32)
    s = mx.repeat(scales.astype(mx.float32), group_size, axis=1)
    b = 0.0 if biases is None else mx.repeat(biases.astype(mx.float32), group_size, axis=1)
    wd = q * s + b  # (n, k)
    step = 32 * ELEMS_PER_LANE
    pad = -k % step
    xs = mx.pad(x.reshape(-1, k).astype(mx.float32), [(0, 0), (0, pad)])
    wd = mx.pad(wd, [(0, 0), (0, pad)])
    m, steps = xs.shape[0], (k + pad) // step
    # products (m, n, steps, lanes, elements): element e = r*step + lane*8 + j
    prod = xs.reshape(m, 1, steps, 32, ELEMS_PER_LANE) * wd.reshape(1, n, steps, 32, ELEMS_PER_LANE)
    per_lane = prod.sum(axis=2).sum(axis=-1)  # over steps, then the eight elements
    return per_lane.sum(axis=-1).reshape(*lead, n)


# Part of every probe key: editing the kernel or its launch invalidates the cached verdicts (a
# stale "bitwise" would be trusted by the invariant mode).
KERNEL_VERSION = hashlib.sha256(
    (_CUDA_HEADER + _CUDA_SOURCE + inspect.getsource(_launch)).encode()
).hexdigest()[:12]
