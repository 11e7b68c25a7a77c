"""MLX's own ops kept row-invariant: its quantized matmul, its dense matmul and its attention,
in chunks no larger than the row count up to which each computes every row alike.

Why: the verifier's invariant mode needs a token's logits not to depend on how many tokens
one forward holds. MLX's CUDA backend runs a per-row kernel (qmv) for a few rows and a tiled
GEMM from some row count on (8 rows for float32 activations in MLX 0.32), whose sums round
differently (where K is a multiple of max(64, group size); otherwise qmv runs for every row
count). Up to that count the stock matmul is invariant already, and cheaper per call
than a custom kernel (measured on the H200, benchmarks §4); past it, the rows are split into
chunks of that size, each run by the per-row kernel, so every row is computed exactly as in
a one-row forward.

The span is measured, not assumed: `invariant_span` compares each row of an M-row product
with the one-row product of that row, bit for bit, for M = 1..max_rows on random inputs.

The CPU (measured 2026-12-01, docs/kernels.md): MLX's float32 forward of the embedded target
computes 1..3 rows as one row and differs in the last bits from 4 rows on. Its attention is
what breaks first (3 query rows, and on an AVX-512 CPU fewer at some key counts: 2026-12-02);
its dense matmul keeps 12 rows alike there. `dense_chunked`
and `attention_chunked` give the invariant mode its CPU routes: the same ops, in chunks of
their spans. Where a dense span is a lone row because the BLAS takes another kernel for one
row (a Xeon, 2026-12-05), `dense_padded` pads a lone row instead, up to the row count
(`padded_floor`) from which every product computes its rows alike.

Twins: `mx.quantized_matmul` / `x @ w.T` / MLX's attention on all rows at once (the values
the chunks must match to within rounding; bitwise wherever the span holds).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from dspark_flow.kernels.qmm_small_m import qmm_small_m_reference as qmm_stock_reference

NAME = "qmm_stock_chunks"


def qmm_stock_chunked(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    chunk: int,
) -> mx.array:
    """`x @ dequant(w).T` by MLX's quantized matmul over chunks of at most `chunk` rows.
    x: (..., K); the leading dimensions are flattened into rows and restored."""
    return _in_row_chunks(
        x,
        chunk,
        w.shape[0],
        lambda rows: mx.quantized_matmul(
            rows, w, scales, biases, transpose=True, group_size=group_size, bits=bits
        ),
    )


def _in_row_chunks(
    x: mx.array, chunk: int, n: int, matmul: Callable[[mx.array], mx.array]
) -> mx.array:
    """`matmul` over chunks of at most `chunk` rows of x (..., K), its leading dimensions
    flattened into rows and restored around the n outputs."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    parts = [matmul(rows[i : i + chunk]) for i in range(0, rows.shape[0], chunk)]
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    return y.reshape(*lead, n)


def chunked(chunk: int):
    """`qmm_stock_chunked` with its chunk bound, in the kernels' calling convention."""

    def qmm_stock_chunks(x, w, scales, biases, group_size, bits):
        return qmm_stock_chunked(x, w, scales, biases, group_size, bits, chunk)

    return qmm_stock_chunks


def invariant_span(
    x: mx.array,
    w: mx.array,
    scales: mx.array | None,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    matmul: Callable[..., mx.array] = qmm_stock_reference,
) -> int:
    """The largest M (0..rows of x) such that for every M' <= M each row of `matmul` over the
    first M' rows of x equals, bit for bit, `matmul` over that row alone (computed again)."""
    singles = [matmul(x[i : i + 1], w, scales, biases, group_size, bits) for i in range(x.shape[0])]
    mx.eval(singles)
    span = 0
    for m in range(1, x.shape[0] + 1):
        many = matmul(x[:m], w, scales, biases, group_size, bits)
        if not mx.array_equal(many, mx.concatenate(singles[:m], axis=0)).item():
            break
        span = m
    return span  # 0: not even one row repeats (a non-deterministic kernel)


def dense_reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array | None = None,
    biases: mx.array | None = None,
    group_size: int = 0,
    bits: int = 0,
) -> mx.array:
    """MLX's dense matmul `x @ w.T`, in the quantized kernels' calling convention (the
    quantization arguments are ignored)."""
    return x @ w.T


def dense_chunked(chunk: int) -> Callable[..., mx.array]:
    """MLX's dense matmul over chunks of at most `chunk` rows, as a route."""

    def dense_stock_chunks(x: mx.array, w: mx.array, *quantization: object) -> mx.array:
        return _in_row_chunks(x, chunk, w.shape[0], lambda rows: rows @ w.T)

    return dense_stock_chunks


def dense_padded(floor: int) -> Callable[..., mx.array]:
    """MLX's dense matmul with fewer than `floor` rows padded with zero rows up to `floor`, as a
    route. Where MLX computes products of `floor` or more rows alike but a lone row otherwise
    (most likely OpenBLAS taking another kernel for one row: a 2-core Xeon, 2026-12-05), a
    one-row forward padded to `floor` rows computes its row as every verify does, and a verify
    then runs one matmul instead of one per chunk (`padded_floor` measures `floor`)."""

    padded = _padded(dense_reference, floor)

    def dense_stock_padded(x: mx.array, w: mx.array, *quantization: object) -> mx.array:
        lead, k = x.shape[:-1], x.shape[-1]
        return padded(x.reshape(-1, k), w).reshape(*lead, w.shape[0])

    return dense_stock_padded


def padded_floor(
    x: mx.array, w: mx.array, matmul: Callable[..., mx.array] = dense_reference
) -> int:
    """The smallest P (1..rows of x) such that the product of every M = P..rows leading rows of
    x, and of every fewer rows padded with zero rows to P, gives each row, bit for bit, what the
    product of all rows gives it; 0 where none (as where not even all rows repeat: a
    non-deterministic op)."""
    top = x.shape[0]
    whole = matmul(x, w)
    floor = 0
    for p in range(top, 0, -1):  # p = top: the whole product again, the determinism check
        if not mx.array_equal(matmul(x[:p], w), whole[:p]).item():
            break  # M = p breaks the run down from the top: no smaller floor either
        padded = _padded(matmul, p)
        if all(mx.array_equal(padded(x[:m], w), whole[:m]).item() for m in range(1, p)):
            floor = p
    return floor


def _padded(matmul: Callable[..., mx.array], floor: int) -> Callable[..., mx.array]:
    """`matmul` over (rows, K) x with fewer than `floor` rows padded with zero rows."""

    def call(x: mx.array, w: mx.array) -> mx.array:
        m = x.shape[0]
        if m >= floor:  # the common verify: nothing to pad, no zero block built per call
            return matmul(x, w)
        pad = mx.zeros((floor - m, x.shape[1]), dtype=x.dtype)
        return matmul(mx.concatenate([x, pad]), w)[:m]

    return call


def attention_chunked(chunk: int) -> Callable[..., mx.array]:
    """MLX's attention over causal query chunks of at most `chunk` rows, as a route: query row
    i of an M-row call over N keys sees the first N - M + i + 1 keys, in whichever chunk it
    falls (one query goes without a mask, as mlx-lm calls it)."""

    def attention_stock_chunks(
        q: mx.array, k: mx.array, v: mx.array, scale: float, mask: object = None
    ) -> mx.array:
        rows, keys = q.shape[2], k.shape[2]
        parts = []
        for start in range(0, rows, chunk):
            end = min(rows, start + chunk)
            seen = keys - rows + end
            parts.append(
                mx.fast.scaled_dot_product_attention(
                    q[:, :, start:end],
                    k[:, :, :seen],
                    v[:, :, :seen],
                    scale=scale,
                    mask="causal" if end - start > 1 else None,
                )  # fmt: skip
            )
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    return attention_stock_chunks
