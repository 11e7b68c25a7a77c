"""`sdpa_vector_rows`: MLX's CUDA "vector" attention arithmetic for any number of query rows, so
that each row comes out bit for bit as MLX computes it for that row alone.

Why: for float32 (the embedded model's native 4-bit form computes in float32) MLX's CUDA
attention runs its fused vector kernel for fewer than 4 queries and an unfused composite in
TF32 from 4 on, so on the stock path a verify of 4 or more tokens gives logits that differ from
one-token decoding. (Half precision goes to cuDNN first, even for one query over a cache
slice, so this kernel is for float32 only: there the stock path is not the vector kernel.) The vector kernel
itself computes every query row independently (grid.y is the row); only its dispatch stops at
3. This module repeats its arithmetic for 1..16 rows: one pass (a block of 32 warps per head
and row, warp w taking keys w, w+32, ...; an online softmax per warp in base 2; the warps
merged through shared memory) where the row's own key count is at most 1024, and MLX's two
passes beyond (32 blocks of 8 warps per row writing partial sums, then a merge). Since MLX picks
the pass by the call's key count and a row of a causal verify sees fewer keys than the call
holds, rows on either side of 1024 keys are split into two calls, so that each row takes the
pass its one-row call would take.

Equality with MLX is measured, not assumed: the probe compares each row with MLX's one-query
call over that row's keys, bit for bit (`bitwise` in the verdict), and the verifier's invariant
mode takes this kernel only where it is exact. Written against MLX 0.32's CUDA source; on the
H200 (2026-11-30, benchmarks §4) bitwise equal to MLX at 2..16 rows in every key bucket. Up
to the rows MLX's own attention computes as one (`stock_span`; on the H200 with every window
checked, 2026-12-02: 3 at the 512- and 8,192-key buckets, 1 at 2,048) the invariant mode keeps
MLX's kernel and runs this one past them.

Implementations: `sdpa_vector_rows_reference` (the twin: MLX's attention one query row at a time,
over that row's causal keys), `sdpa_vector_rows` (the dispatcher: CUDA and float32 only, else
None); `stock_span` measures how many rows MLX's own call computes as one. No plain-MLX emulation of this summation order: the twin is the exact reference, and the
CPU tests check the Python side (the pass split) against it.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import mlx.core as mx

from dspark_flow.kernels.cuda_common import CUDA_FLOAT_CONVERSIONS, cuda_backend

KERNEL_NAME = "sdpa_vector_rows"
ONE_PASS_KEYS = 1024  # MLX: more keys than this take the two-pass kernels

_CUDA_HEADER = CUDA_FLOAT_CONVERSIONS + "#include <cooperative_groups/reduce.h>\n"

# The per-key update both passes share (a warp, one key): the score reduced over the lanes, the
# running max and sum in base 2, the output rescaled. Written as MLX writes it, so that the
# compiler contracts the same multiply-adds.
_KEY_UPDATE = r"""
      float kk[VPT];
#pragma unroll
      for (int j = 0; j < VPT; ++j) kk[j] = df_to_f(kp[(VPT * lane + j) * k_strides[3]]);
      float score = 0.f;
#pragma unroll
      for (int j = 0; j < VPT; ++j) score += qs[j] * kk[j];
      score = cg::reduce(warp, score, cg::plus<float>());
      const float new_max = max(max_score, score);
      const float factor = exp2f(max_score - new_max);
      const float exp_score = exp2f(score - new_max);
      max_score = new_max;
      sum_exp_score = sum_exp_score * factor + exp_score;
#pragma unroll
      for (int j = 0; j < VPT; ++j) o[j] = o[j] * factor + exp_score * df_to_f(vp[(VPT * lane + j) * v_strides[3]]);
"""

# What both passes begin with: sizes, the warp and lane, then (after the pointers) the scaled
# query in registers and an empty accumulator.
_PROLOGUE = r"""
  constexpr int VPT = D / 32;
  const int H = q_shape[1];
  const int L = q_shape[2];
  const int kL = k_shape[2];
  const int gqa = H / k_shape[1];
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane = warp.thread_rank();
  const int w = warp.meta_group_rank();
"""
_QUERY_INIT = r"""
  float qs[VPT], o[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    qs[j] = scale_log2 * df_to_f(qp[(VPT * lane + j) * q_strides[3]]);
    o[j] = 0.f;
  }
  float max_score = -3.402823466e+38f;
  float sum_exp_score = 0.f;
"""

# Template constants: T (q, k, v and output dtype), D (head dim), CAUSAL. One block of 32 warps
# per (head, query row, batch): grid (H * 1024, L, B).
_ONE_PASS = (
    _PROLOGUE
    + r"""
  const int h = blockIdx.x, row = blockIdx.y, b = blockIdx.z;
  __shared__ float outputs[32][33];
  __shared__ float max_scores[32];
  __shared__ float sum_exp_scores[32];
  const float scale_log2 = float(double(scale[0]) * 1.44269504088896340736);
  const T* qp = q + b * q_strides[0] + h * q_strides[1] + row * q_strides[2];
  const T* kp = k + b * k_strides[0] + (h / gqa) * k_strides[1] + w * k_strides[2];
  const T* vp = v + b * v_strides[0] + (h / gqa) * v_strides[1] + w * v_strides[2];
"""
    + _QUERY_INIT
    + r"""
  for (int i = w; i < kL; i += 32) {
    if (!CAUSAL || i <= kL - L + row) {
"""
    + _KEY_UPDATE
    + r"""
    }
    kp += 32 * k_strides[2];
    vp += 32 * v_strides[2];
  }
  if (lane == 0) {
    max_scores[w] = max_score;
    sum_exp_scores[w] = sum_exp_score;
  }
  block.sync();
  max_score = max_scores[lane];
  const float new_max = cg::reduce(warp, max_score, cg::greater<float>());
  const float factor = exp2f(max_score - new_max);
  sum_exp_score = cg::reduce(warp, sum_exp_scores[lane] * factor, cg::plus<float>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    outputs[lane][w] = o[j];
    block.sync();
    const float ot = outputs[w][lane] * factor;
    o[j] = cg::reduce(warp, ot, cg::plus<float>()) * sum_exp_score;
    block.sync();
  }
  if (lane == 0) {
    T* op = out + ((size_t(b) * H + h) * L + row) * D;
#pragma unroll
    for (int j = 0; j < VPT; ++j) op[VPT * w + j] = df_from_f<T>(o[j]);
  }
"""
)

# Pass 1 of 2: 32 blocks of 8 warps per (head, row, batch), grid (H * 256, L, B * 32); block c
# takes keys c*8 + w, then every 256th. Writes its partial output, sum and max.
_TWO_PASS_1 = (
    _PROLOGUE
    + r"""
  const int h = blockIdx.x, row = blockIdx.y, b = blockIdx.z / 32, c = blockIdx.z % 32;
  __shared__ float outputs[8][33];
  __shared__ float max_scores[8];
  __shared__ float sum_exp_scores[8];
  const float scale_log2 = scale[0] * 1.44269504089f;
  const int first = c * 8 + w;
  const T* qp = q + b * q_strides[0] + h * q_strides[1] + row * q_strides[2];
  const T* kp = k + b * k_strides[0] + (h / gqa) * k_strides[1] + first * k_strides[2];
  const T* vp = v + b * v_strides[0] + (h / gqa) * v_strides[1] + first * v_strides[2];
  const size_t p = ((size_t(b) * H + h) * L + row) * 32 + c;
"""
    + _QUERY_INIT
    + r"""
  for (int i = first; i < kL; i += 256) {
    if (!CAUSAL || i <= kL - L + row) {
"""
    + _KEY_UPDATE
    + r"""
    }
    kp += 256 * k_strides[2];
    vp += 256 * v_strides[2];
  }
  if (lane == 0) {
    max_scores[w] = max_score;
    sum_exp_scores[w] = sum_exp_score;
  }
  block.sync();
  max_score = lane < 8 ? max_scores[lane] : -1e9f;
  const float new_max = cg::reduce(warp, max_score, cg::greater<float>());
  const float factor = exp2f(max_score - new_max);
  sum_exp_score = lane < 8 ? sum_exp_scores[lane] : 0.f;
  sum_exp_score = cg::reduce(warp, sum_exp_score * factor, cg::plus<float>());
  if (w == 0 && lane == 0) {
    sums[p] = sum_exp_score;
    maxs[p] = new_max;
  }
  const float ff = exp2f(max_scores[w] - new_max);
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    outputs[w][lane] = o[j] * ff;
    block.sync();
    if (w == 0) {
      float ot = outputs[0][lane];
#pragma unroll
      for (int r = 1; r < 8; ++r) ot += outputs[r][lane];
      o[j] = ot;
    }
    block.sync();
  }
  if (w == 0) {
#pragma unroll
    for (int j = 0; j < VPT; ++j) partials[p * D + VPT * lane + j] = o[j];
  }
"""
)

# Pass 2 of 2: one block of 32 warps per (head, row, batch) merges the 32 partials.
_TWO_PASS_2 = r"""
  constexpr int VPT = D / 32;
  const int H = partials_shape[1];
  const int L = partials_shape[2];
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane = warp.thread_rank();
  const int w = warp.meta_group_rank();
  const int h = blockIdx.x, row = blockIdx.y, b = blockIdx.z;
  __shared__ float outputs[32][33];
  const size_t p = ((size_t(b) * H + h) * L + row) * 32;
  const float max_score = maxs[p + lane];
  const float new_max = cg::reduce(warp, max_score, cg::greater<float>());
  const float factor = exp2f(max_score - new_max);
  float sum_exp_score = cg::reduce(warp, sums[p + lane] * factor, cg::plus<float>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);
  float o[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) o[j] = partials[(p + w) * D + VPT * lane + j];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    outputs[lane][w] = o[j];
    block.sync();
    const float ot = outputs[w][lane] * factor;
    o[j] = cg::reduce(warp, ot, cg::plus<float>()) * sum_exp_score;
    block.sync();
  }
  if (lane == 0) {
    T* op = out + ((size_t(b) * H + h) * L + row) * D;
#pragma unroll
    for (int j = 0; j < VPT; ++j) op[VPT * w + j] = df_from_f<T>(o[j]);
  }
"""


_kernels: dict[str, Any] = {}
_scales: dict[float, mx.array] = {}


# 'cuda' where this module has a kernel for the default device, else None.
kernel_backend = cuda_backend


def shape_reason(
    queries: int, q_heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype,
    backend: str | None = None,
) -> str | None:  # fmt: skip
    """Why `sdpa_vector_rows` would decline this shape, or None when the kernel would run: CUDA
    and float32 only, else `sdpa_small_q`'s limits (queries, head dim, head grouping)."""
    from dspark_flow.kernels import sdpa_small_q

    backend = backend if backend is not None else kernel_backend()
    if backend is None:
        from dspark_flow.models.backend import backend_name

        return f"no {KERNEL_NAME} kernel for the {backend_name()} backend"
    if dtype != mx.float32:
        return f"{dtype}: MLX's stock attention is cuDNN there, not the vector kernel"
    return sdpa_small_q.shape_reason(queries, q_heads, kv_heads, head_dim, dtype, False, None,
                                     backend)  # fmt: skip


def _kernel(name: str) -> Any:
    if name not in _kernels:
        specs = {
            "one": (["q", "k", "v", "scale"], ["out"], _ONE_PASS),
            "two_1": (["q", "k", "v", "scale"], ["partials", "sums", "maxs"], _TWO_PASS_1),
            "two_2": (["partials", "sums", "maxs"], ["out"], _TWO_PASS_2),
        }
        inputs, outputs, source = specs[name]
        _kernels[name] = mx.fast.cuda_kernel(
            name=f"{KERNEL_NAME}_{name}",
            input_names=inputs,
            output_names=outputs,
            source=source,
            header=_CUDA_HEADER,
            ensure_row_contiguous=False,  # q, k, v through their strides (the cache's slices)
        )
    return _kernels[name]


def _scale(scale: float) -> mx.array:
    if (arr := _scales.get(scale)) is None:
        arr = _scales[scale] = mx.array([scale], dtype=mx.float32)
    return arr


def _one_call(q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool) -> mx.array:
    """One launch (or one pair) for all rows: the pass MLX picks for k's key count."""
    b, h, rows, d = q.shape
    template = [("T", q.dtype), ("D", d), ("CAUSAL", causal)]
    if k.shape[2] <= ONE_PASS_KEYS:
        return _kernel("one")(
            inputs=[q, k, v, _scale(scale)], template=template,
            grid=(h * 1024, rows, b), threadgroup=(1024, 1, 1),
            output_shapes=[(b, h, rows, d)], output_dtypes=[q.dtype],
        )[0]  # fmt: skip
    partials, sums, maxs = _kernel("two_1")(
        inputs=[q, k, v, _scale(scale)], template=template,
        grid=(h * 256, rows, b * 32), threadgroup=(256, 1, 1),
        output_shapes=[(b, h, rows, 32, d), (b, h, rows, 32), (b, h, rows, 32)],
        output_dtypes=[mx.float32] * 3,
    )  # fmt: skip
    return _kernel("two_2")(
        inputs=[partials, sums, maxs], template=[("T", q.dtype), ("D", d)],
        grid=(h * 1024, rows, b), threadgroup=(1024, 1, 1),
        output_shapes=[(b, h, rows, d)], output_dtypes=[q.dtype],
    )[0]  # fmt: skip


def sdpa_vector_rows_trusted(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None
) -> mx.array:
    """For a caller that probed the shape: `mask` None or "causal", q/k/v (B, H, L, D), read
    through their strides. Causal rows on both sides of 1024 keys go in two calls (see the module)."""
    causal = mask is not None
    rows, keys = q.shape[2], k.shape[2]
    # Row i sees keys - rows + i + 1 keys: the first row past the one-pass limit.
    split = ONE_PASS_KEYS - (keys - rows) if causal else rows
    if not causal or split <= 0 or split >= rows or keys <= ONE_PASS_KEYS:
        return _one_call(q, k, v, scale, causal)
    head_keys = keys - rows + split  # the first `split` rows as a call of their own
    first = _one_call(q[:, :, :split], k[:, :, :head_keys], v[:, :, :head_keys], scale, True)
    rest = _one_call(q[:, :, split:], k, v, scale, True)
    return mx.concatenate([first, rest], axis=2)


def sdpa_vector_rows(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None
) -> mx.array | None:
    """Attention through the CUDA kernel, or None where it has none or the inputs do not fit
    (a mask other than None/"causal", fewer keys than queries)."""
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return None
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or not q.dtype == k.dtype == v.dtype:
        return None
    if k.shape[2] < q.shape[2]:
        return None
    b, hq, lq, d = q.shape
    if shape_reason(lq, hq, k.shape[1], d, q.dtype) is not None:
        return None
    return sdpa_vector_rows_trusted(q, k, v, scale, mask)


def _mlx_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def sdpa_vector_rows_reference(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None, attention=None
) -> mx.array:
    """The twin: MLX's attention for one query row at a time, over the keys that row sees (all
    of them without a mask; the first keys - rows + i + 1 with the causal mask). `attention`
    replaces MLX's (tests)."""
    attention = attention or _mlx_attention
    rows, keys = q.shape[2], k.shape[2]
    outs = []
    for i in range(rows):
        seen = keys - rows + i + 1 if mask is not None else keys
        outs.append(attention(q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], scale, None))
    return mx.concatenate(outs, axis=2)


def stock_span(q: mx.array, k: mx.array, v: mx.array, scale: float, attention=None) -> int:
    """The largest M (0..rows of q) such that for every M' <= M MLX's attention over any M'
    consecutive query rows, causal over the keys those rows see, equals MLX's one-query calls
    (the twin) bit for bit. Up to that count the invariant mode needs no kernel: on CUDA MLX
    computes a few float32 query rows with its vector kernel, one row as it computes one
    (benchmarks §4: stock forwards of 2 and 3 tokens were bitwise equal to one-token ones).

    Every window, not only the first M' rows: a chunk of the verify starts at any row, and
    whether MLX's multi-query result matches can depend on the number of keys the chunk
    holds (this repo's CPU with AVX-512, MLX 0.32.4: 2- and 3-row calls matched at some key
    counts and not at others, in a period of 4 keys). Row i of a window [s, s + M') is query i
    over keys - rows + s + M' keys, so it sees the keys it sees in the full problem: the twin's
    rows, computed once, serve every window. `attention` replaces MLX's (tests)."""
    attention = attention or _mlx_attention
    rows, keys = q.shape[2], k.shape[2]
    singles = sdpa_vector_rows_reference(q, k, v, scale, "causal", attention)
    mx.eval(singles)
    span = 0
    for m in range(1, rows + 1):
        mask = "causal" if m > 1 else None  # one query goes without a mask, as in mlx-lm
        for start in range(rows - m + 1):
            seen = keys - rows + start + m
            window = attention(q[:, :, start : start + m], k[:, :, :seen], v[:, :, :seen], scale,
                               mask)  # fmt: skip
            if not mx.array_equal(window, singles[:, :, start : start + m]).item():
                return span  # 0: not even one row repeats (a non-deterministic kernel)
        span = m
    return span


# Part of every probe key: editing the kernels, their launch or the pass split invalidates the
# cached verdicts (a stale "bitwise" would be trusted by the invariant mode).
KERNEL_VERSION = hashlib.sha256(
    "".join(
        [_CUDA_HEADER, _ONE_PASS, _TWO_PASS_1, _TWO_PASS_2, str(ONE_PASS_KEYS)]
        + [inspect.getsource(f) for f in (_one_call, sdpa_vector_rows_trusted)]
    ).encode()
).hexdigest()[:12]
