"""Small-M quantized matmul `y = x @ dequant(W).T` for the verify shapes (M = 1..16 rows).

Stock MLX picks a per-row kernel (qmv) for a few rows and a tiled GEMM above that; on the H200
the forward cost steps up at 4 rows although the work is tiny (../shared/device/README.md).
Here one group of TPC lanes owns one output column: each lane loads a packed uint32 once,
dequantizes its values into registers and reuses them for all M rows, so weight traffic and
dequantization do not grow with M and the cost stays nearly flat up to 16 rows.

Weights are MLX's affine layout: `w` uint32 (N, K*bits/32), value j of a word in bits
[bits*j, bits*(j+1)) (low bits first), `scales`/`biases` (N, K/group_size), w = q*scale + bias.
Accumulation is float32; the output dtype is what `mx.quantized_matmul` returns
(`result_type(x, scales)`).

Three implementations share one contract:
  * `qmm_small_m_reference`: the twin, `mx.quantized_matmul` (what the stock layer runs);
  * `qmm_small_m_emulated`: the kernels' arithmetic in plain MLX ops (unpack, scale, float32
    dot), which checks the bit layout the kernels assume on any backend, the CPU included;
  * `qmm_small_m`: the dispatcher: the CUDA kernel on CUDA, the Metal kernel on Apple GPUs,
    None (with `unsupported_reason` saying why) anywhere else or for shapes out of range.
The Metal kernel has never run: it is written to the same design but untested (docs/kernels.md).
"""

from __future__ import annotations

import hashlib
import inspect
import math
from functools import cache
from typing import Any

import mlx.core as mx

from dspark_flow.kernels.cuda_common import CUDA_FLOAT_CONVERSIONS

KERNEL_NAME = "qmm_small_m"
MAX_ROWS = 16
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_BLOCK = 128  # threads per block / threadgroup: 4 warps (or simdgroups)


_CUDA_HEADER = (
    CUDA_FLOAT_CONVERSIONS
    + r"""
// V consecutive activations as floats; one or two 16-byte loads when aligned.
template <typename T, int V>
__device__ __forceinline__ void df_load(const T* p, float* out, bool vec) {
  constexpr int kBytes = int(sizeof(T)) * V;
  if constexpr (kBytes % 16 == 0) {
    if (vec) {
      uint4 raw[kBytes / 16];
#pragma unroll
      for (int i = 0; i < kBytes / 16; ++i) raw[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
      const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = df_to_f(e[j]);
      return;
    }
  } else if constexpr (kBytes == 8) {
    if (vec) {
      uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = df_to_f(e[j]);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = df_to_f(p[j]);
}
"""
)

# Template constants (set per launch): T activations, U output, BITS, GS, MB (rows bucket, a
# power of two >= M so acc[] stays in registers), TPC (lanes per output column).
_CUDA_SOURCE = r"""
  constexpr int kVpw = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[0];
  const int wpr = K / kVpw;
  const int gpr = K / GS;
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % TPC;
  const int col = tid / TPC;
  // No early return: every lane must reach the shuffles below.
  const int colr = col < N ? col : N - 1;
  const uint32_t* wrow = w + size_t(colr) * wpr;
  const auto* srow = scales + size_t(colr) * gpr;
  const auto* brow = biases + size_t(colr) * gpr;
  constexpr int kAlign = int(sizeof(T)) * kVpw >= 16 ? 16 : int(sizeof(T)) * kVpw;
  const bool vec = (reinterpret_cast<uintptr_t>(x) % kAlign) == 0;
  float acc[MB];
#pragma unroll
  for (int m = 0; m < MB; ++m) acc[m] = 0.0f;
  for (int wi = lane; wi < wpr; wi += TPC) {
    const uint32_t packed = __ldg(wrow + wi);
    const int k0 = wi * kVpw;
    const float s = df_to_f(srow[k0 / GS]);
    const float b = df_to_f(brow[k0 / GS]);
    float wv[kVpw];
#pragma unroll
    for (int j = 0; j < kVpw; ++j) wv[j] = fmaf(float((packed >> (BITS * j)) & kMask), s, b);
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (MB == 1 || m < M) {
        float xv[kVpw];
        df_load<T, kVpw>(x + size_t(m) * K + k0, xv, vec);
        float a = acc[m];
#pragma unroll
        for (int j = 0; j < kVpw; ++j) a = fmaf(xv[j], wv[j], a);
        acc[m] = a;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MB; ++m) {
#pragma unroll
    for (int off = TPC / 2; off > 0; off /= 2) {
      acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off, TPC);
    }
  }
  if (col < N && lane == 0) {
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (MB == 1 || m < M) out[size_t(m) * N + col] = df_from_f<U>(acc[m]);
    }
  }
"""

# UNTESTED (never run: no Apple GPU here). One simdgroup (32 lanes) per output column.
_METAL_SOURCE = r"""
  constexpr int kVpw = 32 / BITS;
  constexpr uint kMask = (1u << BITS) - 1u;
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[0];
  const int wpr = K / kVpw;
  const int gpr = K / GS;
  const uint lane = thread_index_in_simdgroup;
  const int col = int(thread_position_in_grid.x / 32);
  const int colr = min(col, N - 1);
  float acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = 0.0f;
  for (int wi = int(lane); wi < wpr; wi += 32) {
    const uint packed = w[colr * wpr + wi];
    const int k0 = wi * kVpw;
    const float s = float(scales[colr * gpr + k0 / GS]);
    const float b = float(biases[colr * gpr + k0 / GS]);
    float wv[kVpw];
    for (int j = 0; j < kVpw; ++j) wv[j] = fma(float((packed >> (BITS * j)) & kMask), s, b);
    for (int m = 0; m < MB; ++m) {
      if (MB == 1 || m < M) {
        float a = acc[m];
        for (int j = 0; j < kVpw; ++j) a = fma(float(x[m * K + k0 + j]), wv[j], a);
        acc[m] = a;
      }
    }
  }
  for (int m = 0; m < MB; ++m) acc[m] = simd_sum(acc[m]);
  if (col < N && lane == 0) {
    for (int m = 0; m < MB; ++m) {
      if (MB == 1 || m < M) out[m * N + col] = static_cast<U>(acc[m]);
    }
  }
"""

_kernels: dict[str, Any] = {}


@cache
def _gpu_backend() -> str | None:
    from dspark_flow.models.backend import backend_name

    name = backend_name()
    return name if name in ("cuda", "metal") else None


def kernel_backend() -> str | None:
    """'cuda' or 'metal' where this module has a kernel for the default device, else None."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return None
    return _gpu_backend()


def rows_bucket(m: int) -> int:
    """The compiled row count for m rows: the next power of two (1, 2, 4, 8, 16)."""
    return 1 << max(0, math.ceil(math.log2(m)))


def lanes_per_column(words_per_row: int) -> int:
    """Lanes sharing one output column: enough that each does about two words or more."""
    tpc = 32
    while tpc > 1 and words_per_row < 2 * tpc:
        tpc //= 2
    return tpc


@cache
def output_dtype(x_dtype: mx.Dtype, scales_dtype: mx.Dtype) -> mx.Dtype:
    """What `mx.quantized_matmul` returns for these inputs."""
    return mx.result_type(mx.array(0, x_dtype), mx.array(0, scales_dtype))


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
    """Why `qmm_small_m` would decline this shape, or None when a kernel would run."""
    backend = backend if backend is not None else kernel_backend()
    if backend is None:
        from dspark_flow.models.backend import backend_name

        return f"no {KERNEL_NAME} kernel for the {backend_name()} backend (the twin runs)"
    if bits not in BITS or group_size not in GROUP_SIZES:
        return f"unsupported format: bits={bits}, group_size={group_size}"
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows is outside 1..{MAX_ROWS}"
    if k % group_size or n < 1:
        return f"K={k} is not a multiple of the group size {group_size}"
    if x_dtype not in FLOAT_DTYPES or s_dtype not in FLOAT_DTYPES:
        return f"unsupported dtypes x={x_dtype}, scales={s_dtype}"
    return None


def unsupported_reason(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    backend: str | None = None,
) -> str | None:
    """Why `qmm_small_m` would decline these inputs, or None when a kernel would run."""
    why = layout_reason(x, w, scales, biases, group_size, bits)
    if why is not None:
        return why
    n, k = w.shape[0], x.shape[-1]
    return shape_reason(x.size // k, n, k, bits, group_size, x.dtype, scales.dtype, backend)


def layout_reason(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
) -> str | None:
    """Why these arrays are not an affine-quantized product the kernels take (biases present,
    packed weights matching K, scales and biases per group), or None. Each kernel's
    `shape_reason` then says whether it runs that shape."""
    if biases is None:
        return "affine weights need biases"
    if w.ndim != 2 or w.dtype != mx.uint32 or x.ndim < 1 or x.shape[-1] == 0:
        return "weights must be a 2-D uint32 array, x at least 1-D"
    n, k = w.shape[0], x.shape[-1]
    if bits in BITS and w.shape[1] * 32 // bits != k:
        return f"K={k} does not match the packed weights {tuple(w.shape)} at {bits} bits"
    if scales.shape != biases.shape or scales.shape != (n, k // group_size):
        return f"scales/biases shapes {tuple(scales.shape)} != {(n, k // group_size)}"
    if biases.dtype != scales.dtype:
        return "biases and scales differ in dtype"
    return None


def _kernel(backend: str) -> Any:
    if backend not in _kernels:
        inputs, outputs = ["x", "w", "scales", "biases"], ["out"]
        if backend == "cuda":
            _kernels[backend] = mx.fast.cuda_kernel(
                name=KERNEL_NAME,
                input_names=inputs,
                output_names=outputs,
                source=_CUDA_SOURCE,
                header=_CUDA_HEADER,
            )
        else:
            _kernels[backend] = mx.fast.metal_kernel(
                name=KERNEL_NAME, input_names=inputs, output_names=outputs, source=_METAL_SOURCE
            )
    return _kernels[backend]


def _launch(backend: str, x2: mx.array, w, scales, biases, group_size: int, bits: int) -> mx.array:
    m, _k = x2.shape
    n, wpr = w.shape
    tpc = 32 if backend == "metal" else lanes_per_column(wpr)
    threads = -(-n * tpc // _BLOCK) * _BLOCK  # whole blocks, so every warp is full
    out_dtype = output_dtype(x2.dtype, scales.dtype)
    return _kernel(backend)(
        inputs=[x2, w, scales, biases],
        template=[
            ("T", x2.dtype),
            ("U", out_dtype),
            ("BITS", bits),
            ("GS", group_size),
            ("MB", rows_bucket(m)),
            ("TPC", tpc),
        ],
        grid=(threads if backend == "cuda" else n * 32, 1, 1),
        threadgroup=(_BLOCK, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[out_dtype],
    )[0]


def qmm_small_m(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
) -> mx.array | None:
    """`x @ dequant(w).T` through this backend's kernel, or None where it has none (then
    `unsupported_reason` says why and the caller runs the twin). x: (..., K), 1..16 rows."""
    backend = kernel_backend()
    if unsupported_reason(x, w, scales, biases, group_size, bits, backend) is not None:
        return None
    assert backend is not None and biases is not None
    lead, k = x.shape[:-1], x.shape[-1]
    y = _launch(backend, x.reshape(-1, k), w, scales, biases, group_size, bits)
    return y.reshape(*lead, w.shape[0])


def qmm_small_m_trusted(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
) -> mx.array:
    """`qmm_small_m` without the per-call checks, for a caller that probed this layer's shape
    and dtypes already (the `kernels` verifier): ~200 calls per forward add up."""
    backend = _gpu_backend()
    assert backend is not None
    lead, k = x.shape[:-1], x.shape[-1]
    y = _launch(backend, x.reshape(-1, k), w, scales, biases, group_size, bits)
    return y.reshape(*lead, w.shape[0])


def qmm_small_m_reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
) -> mx.array:
    """The twin: MLX's own quantized matmul, exactly what `nn.QuantizedLinear` runs."""
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=True, group_size=group_size, bits=bits
    )


def qmm_small_m_emulated(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
) -> mx.array:
    """The kernels' arithmetic in plain MLX: unpack low bits first, q*scale + bias in float32,
    float32 dot. Slow; it exists to check the layout assumptions where no kernel runs."""
    n, k = w.shape[0], x.shape[-1]
    shifts = mx.arange(32 // bits, dtype=mx.uint32) * bits
    q = ((w[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(n, k).astype(mx.float32)
    s = mx.repeat(scales.astype(mx.float32), group_size, axis=1)
    b = 0.0 if biases is None else mx.repeat(biases.astype(mx.float32), group_size, axis=1)
    y = x.astype(mx.float32) @ (q * s + b).T
    return y.astype(output_dtype(x.dtype, scales.dtype))


# Part of every probe key: editing the kernel, its launch or its launch constants invalidates
# the cached verdicts.
KERNEL_VERSION = hashlib.sha256(
    (
        _CUDA_HEADER
        + _CUDA_SOURCE
        + _METAL_SOURCE
        + inspect.getsource(rows_bucket)
        + inspect.getsource(lanes_per_column)
        + inspect.getsource(_kernel)
        + inspect.getsource(_launch)
        + repr(_BLOCK)
    ).encode()
).hexdigest()[:12]
