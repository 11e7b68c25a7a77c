"""Verify-side attention for 1..16 queries: `softmax(q·kᵀ·scale + causal) · v` in one launch.

Why: MLX's CUDA attention uses cuDNN where it can (float16/bfloat16: from 2 queries, and for
one query over 256 or more cached keys) and otherwise its fused "vector" kernel for fewer than
4 queries; cuDNN takes only float16/bfloat16. The embedded model's
native 4-bit form computes in float32 (its GGUF norms are float32), so from 4 queries on every
layer falls back to the unfused composite (a matmul, a mask, a softmax, a matmul: several
launches and two cuBLAS calls per layer), which is where the 4-bit verify cost steps up at
K = 4. For half-precision models, cuDNN's graph cache is keyed by the full key length, which
grows every decoding step, so each verify builds a new graph.

Design (CUDA, `mx.fast.cuda_kernel`): one 256-thread block per (batch, query head, query row).
Each of its 8 warps walks every 8th group of 4 keys: lanes hold D/32 elements of the scaled
query, a key's dot product is reduced across the warp with shuffles (4 keys at once, so the
shuffle chains overlap), and each warp keeps an online softmax (running max, sum and weighted
sum of values). The warps' partial results are merged through shared memory. Query row i sees
keys 0 .. T - L + i (causal, aligned to the end as MLX's "causal" mask is), and grouped-query
heads share their key/value head. Inputs are read through their strides, so the key/value cache
slices that mlx-lm hands over are not copied. A row's result does not depend on how many query
rows are in the call: the same arithmetic runs for row i whatever L is.

Three implementations share one contract, as for `qmm_small_m`:
  * `sdpa_small_q_reference`: the twin, `mx.fast.scaled_dot_product_attention`;
  * `sdpa_small_q_emulated`: the kernel's arithmetic in plain MLX (float32 scores and softmax);
  * `sdpa_small_q_float64`: the true values on the host, the probe's yardstick;
  * `sdpa_small_q`: the dispatcher: the CUDA kernel under CUDA, else None with a reason.
There is no Metal kernel: MLX's Metal attention already has fused kernels for these shapes in
every dtype, so the dispatcher declines there (docs/kernels.md).
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import mlx.core as mx

from dspark_flow.kernels.cuda_common import CUDA_FLOAT_CONVERSIONS, cuda_backend

KERNEL_NAME = "sdpa_small_q"
MAX_QUERIES = 16
HEAD_DIMS = (64, 96, 128)
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_WARPS = 8  # per block: more warps walk the keys in parallel
_KEYS_PER_STEP = 4  # keys a warp reduces at once

_CUDA_HEADER = CUDA_FLOAT_CONVERSIONS

# Template constants: T (dtype of q, k, v and the output), D (head dim, a multiple of 32),
# NW (warps per block), KPS (keys per warp step), CAUSAL.
_CUDA_SOURCE = r"""
  constexpr int DPL = D / 32;
  const int Hq = q_shape[1];
  const int L = q_shape[2];
  const int Hkv = k_shape[1];
  const int n_all = k_shape[2];
  const int row = blockIdx.x;  // (b * Hq + h) * L + i
  const int i = row % L;
  const int h = (row / L) % Hq;
  const int b = row / (L * Hq);
  const int hk = h / (Hq / Hkv);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int n_keys = CAUSAL ? n_all - L + i + 1 : n_all;
  const float sc = scale[0];

  const T* qp = q + b * q_strides[0] + h * q_strides[1] + i * q_strides[2];
  float qv[DPL];
#pragma unroll
  for (int e = 0; e < DPL; ++e) qv[e] = df_to_f(qp[(lane + 32 * e) * q_strides[3]]) * sc;
  const T* kb = k + b * k_strides[0] + hk * k_strides[1];
  const T* vb = v + b * v_strides[0] + hk * v_strides[1];

  float m = -INFINITY, l = 0.0f, o[DPL];
#pragma unroll
  for (int e = 0; e < DPL; ++e) o[e] = 0.0f;
  for (int j0 = warp * KPS; j0 < n_keys; j0 += NW * KPS) {
    float s[KPS];
#pragma unroll
    for (int u = 0; u < KPS; ++u) {
      const int j = j0 + u;
      float a = 0.0f;
      if (j < n_keys) {
        const T* kp = kb + j * k_strides[2];
#pragma unroll
        for (int e = 0; e < DPL; ++e) a = fmaf(qv[e], df_to_f(kp[(lane + 32 * e) * k_strides[3]]), a);
      }
      s[u] = a;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
#pragma unroll
      for (int u = 0; u < KPS; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], off);
    }
#pragma unroll
    for (int u = 0; u < KPS; ++u) {
      const int j = j0 + u;
      if (j < n_keys) {  // the same for every lane of the warp
        const float mn = fmaxf(m, s[u]);
        const float f = expf(m - mn);
        const float p = expf(s[u] - mn);
        l = l * f + p;
        const T* vp = vb + j * v_strides[2];
#pragma unroll
        for (int e = 0; e < DPL; ++e) o[e] = fmaf(p, df_to_f(vp[(lane + 32 * e) * v_strides[3]]), o[e] * f);
        m = mn;
      }
    }
  }

  __shared__ float sm_m[NW];
  __shared__ float sm_l[NW];
  __shared__ float sm_o[NW][D];
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int e = 0; e < DPL; ++e) sm_o[warp][lane + 32 * e] = o[e];
  __syncthreads();
  if (warp == 0) {
    float mx_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx_all = fmaxf(mx_all, sm_m[w]);
    float total = 0.0f, acc[DPL];
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[e] = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = sm_l[w] > 0.0f ? expf(sm_m[w] - mx_all) : 0.0f;  // idle warps add 0
      total = fmaf(sm_l[w], f, total);
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[e] = fmaf(sm_o[w][lane + 32 * e], f, acc[e]);
    }
    T* op = out + size_t(row) * D;
#pragma unroll
    for (int e = 0; e < DPL; ++e) op[lane + 32 * e] = df_from_f<T>(acc[e] / total);
  }
"""

_kernel_cache: dict[str, Any] = {}
_scales: dict[float, mx.array] = {}  # one small array per softmax scale, not one per call


# 'cuda' where this module has a kernel for the default device, else None.
kernel_backend = cuda_backend


def shape_reason(
    queries: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: mx.Dtype,
    causal: bool,
    keys: int | None = None,
    backend: str | None = None,
) -> str | None:
    """Why `sdpa_small_q` would decline this shape, or None when the kernel would run."""
    backend = backend if backend is not None else kernel_backend()
    if backend is None:
        from dspark_flow.models.backend import backend_name

        return f"no {KERNEL_NAME} kernel for the {backend_name()} backend (the twin runs)"
    if not 1 <= queries <= MAX_QUERIES:
        return f"{queries} queries is outside 1..{MAX_QUERIES}"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} is not one of {HEAD_DIMS}"
    if kv_heads < 1 or q_heads % kv_heads:
        return f"{q_heads} query heads do not group over {kv_heads} key/value heads"
    if dtype not in FLOAT_DTYPES:
        return f"unsupported dtype {dtype}"
    if keys is not None and causal and keys < queries:
        return f"causal attention needs at least as many keys ({keys}) as queries ({queries})"
    return None


def unsupported_reason(
    q: mx.array, k: mx.array, v: mx.array, mask: Any, backend: str | None = None
) -> str | None:
    """Why `sdpa_small_q` would decline these inputs (the mask must be None or "causal")."""
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return "only no mask or the 'causal' mask"
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        return "q, k, v must be (batch, heads, length, head dim), k and v alike"
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        return "q and k differ in batch or head dim"
    if not q.dtype == k.dtype == v.dtype:
        return "q, k and v differ in dtype"
    b, hq, lq, d = q.shape
    return shape_reason(lq, hq, k.shape[1], d, q.dtype, mask is not None, k.shape[2], backend)


def _kernel() -> Any:
    if "cuda" not in _kernel_cache:
        _kernel_cache["cuda"] = mx.fast.cuda_kernel(
            name=KERNEL_NAME,
            input_names=["q", "k", "v", "scale"],
            output_names=["out"],
            source=_CUDA_SOURCE,
            header=_CUDA_HEADER,
            ensure_row_contiguous=False,  # read the cache slices through their strides
        )
    return _kernel_cache["cuda"]


def _launch(q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool) -> mx.array:
    b, hq, lq, d = q.shape
    threads = _WARPS * 32
    scale = float(scale)
    if (scale_arr := _scales.get(scale)) is None:
        scale_arr = _scales[scale] = mx.array([scale], dtype=mx.float32)
    return _kernel()(
        inputs=[q, k, v, scale_arr],
        template=[
            ("T", q.dtype),
            ("D", d),
            ("NW", _WARPS),
            ("KPS", _KEYS_PER_STEP),
            ("CAUSAL", causal),
        ],
        grid=(b * hq * lq * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(b, hq, lq, d)],
        output_dtypes=[q.dtype],
    )[0]


def sdpa_small_q(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None
) -> mx.array | None:
    """Attention through this backend's kernel, or None where it has none (then
    `unsupported_reason` says why and the caller runs the twin)."""
    if unsupported_reason(q, k, v, mask) is not None:
        return None
    return _launch(q, k, v, scale, mask is not None)


def sdpa_small_q_trusted(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None
) -> mx.array:
    """`sdpa_small_q` without the per-call checks, for a caller that probed the shape (the
    `kernels` verifier checks the query count, dtype and mask itself)."""
    return _launch(q, k, v, scale, mask is not None)


def sdpa_small_q_reference(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None
) -> mx.array:
    """The twin: MLX's fused attention, exactly what mlx-lm's models call."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def sdpa_small_q_emulated(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None
) -> mx.array:
    """The kernel's arithmetic in plain MLX: scaled query, float32 scores, causal alignment to
    the last key, float32 softmax and weighted sum. Slow; it pins down the contract anywhere."""
    b, hq, lq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    groups = hq // hkv
    qf = (q.astype(mx.float32) * scale).reshape(b, hkv, groups, lq, d)
    kf, vf = k.astype(mx.float32)[:, :, None], v.astype(mx.float32)[:, :, None]
    scores = qf @ kf.swapaxes(-1, -2)  # (b, hkv, groups, lq, t)
    if mask is not None:
        visible = mx.arange(t)[None, :] <= (mx.arange(lq)[:, None] + (t - lq))
        scores = mx.where(visible, scores, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ vf
    return out.reshape(b, hq, lq, d).astype(q.dtype)


def sdpa_small_q_float64(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None
) -> mx.array:
    """The true values, computed on the host in float64 (the probe's yardstick for kernel and
    twin alike: on CUDA MLX's float32 matmuls run in TF32, so the twin is not exact)."""
    import numpy as np

    def host(a: mx.array) -> np.ndarray:
        return np.array(a.astype(mx.float32), dtype=np.float64)

    qh, kh, vh = host(q), host(k), host(v)
    b, hq, lq, d = qh.shape
    hkv, t = kh.shape[1], kh.shape[2]
    qh = qh.reshape(b, hkv, hq // hkv, lq, d) * scale
    scores = qh @ kh[:, :, None].swapaxes(-1, -2)
    if mask is not None:
        visible = np.arange(t)[None, :] <= (np.arange(lq)[:, None] + (t - lq))
        scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    out = (weights @ vh[:, :, None]).reshape(b, hq, lq, d)
    return mx.array(out.astype(np.float32)).astype(q.dtype)


def attention_inputs(
    queries: int, keys: int, q_heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype
):
    """Random (q, k, v, scale, "causal") with k and v as slices of a larger cache buffer,
    as mlx-lm's KV cache hands them over (so the strided path is what gets probed)."""

    def make(seed: int) -> tuple[Any, ...]:
        kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
        q = mx.random.normal((1, q_heads, queries, head_dim), key=kq).astype(dtype)
        room = keys + 256 - keys % 256  # the cache grows in steps of 256
        kbuf = mx.random.normal((1, kv_heads, room, head_dim), key=kk).astype(dtype)
        vbuf = mx.random.normal((1, kv_heads, room, head_dim), key=kv).astype(dtype)
        k, v = kbuf[:, :, :keys, :], vbuf[:, :, :keys, :]
        mx.eval(q, k, v)
        return q, k, v, head_dim**-0.5, "causal"

    return make


# Part of every probe key: editing the kernel, its launch or its launch constants invalidates
# the cached verdicts.
KERNEL_VERSION = hashlib.sha256(
    (
        _CUDA_HEADER
        + _CUDA_SOURCE
        + inspect.getsource(_kernel)
        + inspect.getsource(_launch)
        + repr((_WARPS, _KEYS_PER_STEP))
    ).encode()
).hexdigest()[:12]
