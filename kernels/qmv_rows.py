"""`qmv_rows`: MLX's per-row quantized matmul (qmv) arithmetic for up to 16 rows in one launch,
so that each row comes out bit for bit as MLX computes it for a single row.

Why: the verifier's invariant mode needs a token's logits not to depend on how many tokens one
forward holds. On CUDA, MLX computes a few rows with its qmv kernel, which is row-invariant and
cheaper per call than any custom kernel (benchmarks §4), and switches to a tiled GEMM from some
row count on, which rounds differently: 8 rows for float32 activations where K is a multiple
of max(64, group size) (the embedded model's shapes), and 8 rows for bfloat16 at Llama-3-8B's
shapes on the H200 (MLX 0.32.4, measured). kernels/stock_rows.py measures where, per shape.
Past that point this kernel repeats qmv's arithmetic for every row, loading each weight once
for the rows of a pass (at most 64 partial sums a lane: `rows_per_pass`). Lane l of the warp
that owns an output column takes elements l*E .. l*E+E-1 of every 32*E-element step (E = 16
for 16-bit activations with 4-bit weights, else 8, as qmv), and:
  * float32 activations: dequantizes in float (`q * scale + bias`) and keeps a float partial
    sum per element (`fma(x, w, sum)`);
  * 16-bit activations: dequantizes in the activation type (`q * scale + bias` rounded to it
    once in the variant that reproduced MLX 0.32.4 on the H200, twice in the other); with
    4-bit weights the partial sums stay in the activation type (a fused multiply-add rounded
    once), with 8-bit weights they are float, as qmv keeps them;
then adds the E partial sums in order in float, reduces across the warp with `cg::reduce` and
rounds the result to the activation type. Equality with MLX is measured, not assumed: the
probe compares the kernel with MLX's one-row results bit for bit (`bitwise` in the verdict),
in two rounding variants of the dequantization (one rounding, as nvcc contracts float32's
`w * scale + bias` into a fused multiply-add, or two), and the verifier takes it only where
one of them is exact.

Three implementations share one contract (float32, float16 or bfloat16 activations with
scales of the same type or float32 activations with any scales, affine 4- or 8-bit weights):
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
from dspark_flow.kernels.qmm_small_m import rows_bucket

KERNEL_NAME = "qmv_rows"
VARIANTS = (1, 0)  # dequantization rounded once (fused multiply-add) or twice (product, sum)
HALF_DTYPES = (mx.float16, mx.bfloat16)
_WARPS = 4  # per block; one warp per output column
_SUMS_PER_LANE = 64  # partial sums a lane keeps in registers (rows per pass x elements)


def elems_per_lane(x_dtype: mx.Dtype, bits: int) -> int:
    """qmv's elements per thread and step: 16 for 16-bit activations with weights of at most
    4 bits, else 8."""
    return 16 if x_dtype in HALF_DTYPES and bits <= 4 else 8


def rows_per_pass(rows: int, x_dtype: mx.Dtype, bits: int) -> int:
    """Rows one warp computes per pass (a power of two): at most 64 partial sums a lane, so
    that 16 rows of 16-bit activations do not spill registers; more rows run as more passes
    (block rows), each reading the weights again."""
    return min(rows_bucket(rows), _SUMS_PER_LANE // elems_per_lane(x_dtype, bits))


# fma in each accumulation type: one rounding (float: fmaf; 16-bit: the hardware's fma.rn).
_CUDA_HEADER = (
    CUDA_FLOAT_CONVERSIONS
    + r"""#include <cooperative_groups/reduce.h>
template <bool B, typename A, typename C> struct qr_pick { using type = A; };
template <typename A, typename C> struct qr_pick<false, A, C> { using type = C; };
__device__ __forceinline__ float qr_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ __half qr_fma(__half a, __half b, __half c) { return __hfma(a, b, c); }
__device__ __forceinline__ __nv_bfloat16 qr_fma(__nv_bfloat16 a, __nv_bfloat16 b,
                                                __nv_bfloat16 c) { return __hfma(a, b, c); }
"""
)

# For 16-bit activations the dequantization is computed in float and rounded to T: the same as
# MLX's arithmetic in T wherever the float result is exact (a 16-bit product always is, and so
# is `q * scale + bias` for weights MLX's quantizer made, the probes' inputs). Other biases could
# round twice here; the probe's bitwise check is measured on MLX-quantized inputs only.
# Template constants: T (activation and output type), BITS, GS, RB (rows per pass: block row y
# computes rows y*RB .. y*RB+RB-1), EPL (elements per lane and step), FUSED (dequantization
# variant).
_CUDA_SOURCE = r"""
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  constexpr bool kWide = sizeof(T) == 4;
  // qmv's per-element sums: in the activation type for 16-bit activations and sub-byte
  // weights, else float
  using Acc = typename qr_pick<!kWide && BITS < 8, T, float>::type;
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
  const int m0 = blockIdx.y * RB;
  Acc sums[RB][EPL];
#pragma unroll
  for (int m = 0; m < RB; ++m) {
#pragma unroll
    for (int j = 0; j < EPL; ++j) sums[m][j] = df_from_f<Acc>(0.0f);
  }
  // idx is a multiple of EPL, so a tile's weights are whole words and its activations 16-byte
  // vectors where the row pointer is aligned (loads only: the sums are qmv's).
  constexpr int kVecs = EPL * int(sizeof(T)) / 16;
  const bool vec = (reinterpret_cast<uintptr_t>(x) % 16) == 0 && (K * sizeof(T)) % 16 == 0;
  auto tile = [&](int idx) {
    const float s = df_to_f(srow[idx / GS]);
    const float b = df_to_f(brow[idx / GS]);
    uint32_t words[EPL * BITS / 32];
#pragma unroll
    for (int i = 0; i < EPL * BITS / 32; ++i) words[i] = __ldg(wrow + idx * BITS / 32 + i);
    Acc wd[EPL];
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const float q = float((words[j * BITS / 32] >> ((j * BITS) % 32)) & kMask);
      float v;
      if constexpr (kWide) {
        v = FUSED ? fmaf(q, s, b) : __fadd_rn(__fmul_rn(q, s), b);
      } else {  // in T, rounded once or after each operation (a 16-bit product is exact)
        v = FUSED ? df_to_f(df_from_f<T>(fmaf(q, s, b)))
                  : df_to_f(df_from_f<T>(__fadd_rn(df_to_f(df_from_f<T>(__fmul_rn(q, s))), b)));
      }
      wd[j] = df_from_f<Acc>(v);
    }
#pragma unroll
    for (int m = 0; m < RB; ++m) {
      if (m0 + m < M) {
        const T* xm = x + size_t(m0 + m) * K + idx;
        alignas(16) T xv[EPL];
        if (vec) {
#pragma unroll
          for (int i = 0; i < kVecs; ++i) {
            reinterpret_cast<uint4*>(xv)[i] = __ldg(reinterpret_cast<const uint4*>(xm) + i);
          }
        } else {
#pragma unroll
          for (int j = 0; j < EPL; ++j) xv[j] = xm[j];
        }
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
          sums[m][j] = qr_fma(df_from_f<Acc>(df_to_f(xv[j])), wd[j], sums[m][j]);
        }
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
  for (int m = 0; m < RB; ++m) {
    if (m0 + m < M) {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < EPL; ++j) sum += df_to_f(sums[m][j]);
      sum = cg::reduce(warp, sum, cg::plus<float>());
      if (lane == 0) out[size_t(m0 + m) * N + col] = df_from_f<T>(sum);
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
    """Why `qmv_rows` would decline this shape, or None when the kernel would run: CUDA only;
    16-bit activations with scales of their own type (qmv's arithmetic is in that type);
    else `qmm_small_m`'s limits (format, rows, K, dtypes)."""
    from dspark_flow.kernels import qmm_small_m

    backend = backend if backend is not None else kernel_backend()
    if backend is None:
        from dspark_flow.models.backend import backend_name

        return f"no {KERNEL_NAME} kernel for the {backend_name()} backend"
    if x_dtype in HALF_DTYPES and s_dtype != x_dtype:
        return f"activations {x_dtype} with scales {s_dtype}: qmv's arithmetic is in one type"
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
    m, n = x2.shape[0], w.shape[0]
    rb = rows_per_pass(m, x2.dtype, bits)
    return _kernel()(
        inputs=[x2, w, scales, biases],
        template=[
            ("T", x2.dtype),
            ("BITS", bits),
            ("GS", group_size),
            ("RB", rb),
            ("EPL", elems_per_lane(x2.dtype, bits)),
            ("FUSED", fused),
        ],  # fmt: skip
        grid=(-(-n // _WARPS) * _WARPS * 32, -(-m // rb), 1),
        threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x2.dtype],
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
    """The kernel's lane split and summation order in plain MLX (rounding aside): per lane
    and element a sum over the 32*E-element steps (kept in the activation type where the kernel
    keeps it there), then the E elements, then the lanes. Slow; it checks the layout where no
    kernel runs."""
    lead, k = x.shape[:-1], x.shape[-1]
    n, dtype = w.shape[0], x.dtype
    epl = elems_per_lane(dtype, bits)
    shifts = mx.arange(32 // bits, dtype=mx.uint32) * bits
    q = ((w[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(n, k).astype(mx.float32)
    s = mx.repeat(scales.astype(mx.float32), group_size, axis=1)
    b = 0.0 if biases is None else mx.repeat(biases.astype(mx.float32), group_size, axis=1)
    wd = q * s + b  # (n, k)
    if dtype in HALF_DTYPES:  # rounded once to the activation type: variant 1, MLX's
        wd = wd.astype(dtype).astype(mx.float32)
    step = 32 * epl
    pad = -k % step
    xs = mx.pad(x.reshape(-1, k).astype(mx.float32), [(0, 0), (0, pad)])
    wd = mx.pad(wd, [(0, 0), (0, pad)])
    m, steps = xs.shape[0], (k + pad) // step
    # products (m, n, steps, lanes, elements): element e = r*step + lane*E + j
    prod = xs.reshape(m, 1, steps, 32, epl) * wd.reshape(1, n, steps, 32, epl)
    if dtype in HALF_DTYPES and bits < 8:  # partial sums rounded to the type every step
        acc = mx.zeros((m, n, 32, epl), dtype=dtype)
        for r in range(steps):
            acc = (acc.astype(mx.float32) + prod[:, :, r]).astype(dtype)
        per_lane = acc.astype(mx.float32).sum(axis=-1)
    else:
        per_lane = prod.sum(axis=2).sum(axis=-1)  # over steps, then the E elements
    return per_lane.sum(axis=-1).astype(dtype).reshape(*lead, n)


# Part of every probe key: editing the kernel or its launch invalidates the cached verdicts (a
# stale "bitwise" would be trusted by the invariant mode).
KERNEL_VERSION = hashlib.sha256(
    (_CUDA_HEADER + _CUDA_SOURCE + inspect.getsource(_launch)).encode()
).hexdigest()[:12]
