"""`qmv_rows` against MLX's one-row quantized matmul: bit for bit, and what one call costs.

The invariant verifier takes `qmv_rows` for a layer shape only where its probe found the kernel
bitwise equal to MLX's one-row results; this script shows the same check and the timings over
many shapes at once, for each activation dtype and dequantization variant. Per case (dtype,
N x K, bits, rows): whether each variant reproduced MLX bit for bit and its relative error,
then ms per call of the kernel (in the exact variant), of MLX's matmul one row at a time (its
twin) and of MLX's matmul over all rows (not row-invariant), timed as the probes time them
(`probe.time_pair`: calls batched per evaluation, alternating with a partner). Random inputs,
as the probes draw them.

    python benchmarks/qmv_rows_check.py --out qmv_rows_check.json   # on a CUDA machine

Default shapes: Llama-3-8B's body and two of a 2,048-wide model (bfloat16 and float16, 4- and
8-bit, group 64) and the embedded model's three float32 shapes. Exits 1 when a case is bit for
bit in no variant, 2 on a backend without the kernel (it says so).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import dspark_flow  # noqa: F401  (first: OpenBLAS must bind before mlx.core)
from dspark_flow.kernels import probe
from dspark_flow.kernels import qmv_rows as qr

HALF_SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (2048, 2048), (6144, 2048)]
EMBEDDED = [(1536, 576, 4, 32), (576, 1536, 4, 32), (49152, 576, 8, 32)]


def cases(dtypes: list[str]) -> list[tuple[str, int, int, int, int]]:
    out = []
    for name in dtypes:
        if name == "float32":
            out += [(name, n, k, bits, gs) for n, k, bits, gs in EMBEDDED]
        else:
            out += [(name, n, k, bits, 64) for n, k in HALF_SHAPES for bits in (4, 8)]
    return out


def check(name: str, n: int, k: int, bits: int, gs: int, rows: int, trials: int) -> dict:
    import mlx.core as mx

    dtype = getattr(mx, name)
    inputs = probe.qmm_inputs(rows, n, k, bits, gs, dtype, dtype)(rows)
    x, w, s, b, gs, bits = inputs
    ref = qr.qmv_rows_reference(*inputs)
    row = {"dtype": name, "n": n, "k": k, "bits": bits, "group_size": gs, "rows": rows}
    exact = None
    for fused in qr.VARIANTS:
        out = qr.qmv_rows_trusted(x, w, s, b, gs, bits, fused)
        row[f"bitwise_variant{fused}"] = bool(mx.array_equal(out, ref).item())
        row[f"error_variant{fused}"] = probe.relative_error(out, ref)
        if exact is None and row[f"bitwise_variant{fused}"]:
            exact = fused
    row["exact_variant"] = exact
    kernel = qr.variant(exact if exact is not None else qr.VARIANTS[0])

    def stock(x, w, s, b, gs, bits):
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)

    row["kernel_ms"], row["per_row_ms"] = probe.time_pair(
        kernel, qr.qmv_rows_reference, inputs, trials=trials
    )
    row["stock_ms"], _ = probe.time_pair(stock, kernel, inputs, trials=trials)  # a partner
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--trials", type=int, default=7, help="timing trials per case (medians)")
    ap.add_argument("--out", type=Path, default=Path("qmv_rows_check.json"))
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    if unknown := sorted(set(dtypes) - {"float32", "float16", "bfloat16"}):
        ap.error(f"unknown dtypes {unknown}: float32, float16, bfloat16")
    if qr.kernel_backend() is None:
        import mlx.core as mx

        print(f"qmv_rows_check: {qr.shape_reason(2, 64, 64, 4, 32, mx.float32, mx.float32)}")
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name, n, k, bits, gs in cases(dtypes):
        for r in rows:
            row = check(name, n, k, bits, gs, r, args.trials)
            results.append(row)
            print(
                f"{name:8} {n:6}x{k:<6} b{bits} rows {r:2}  exact variant {row['exact_variant']}"
                f"  kernel {row['kernel_ms']:.3f}  per row {row['per_row_ms']:.3f}"
                f"  stock {row['stock_ms']:.3f} ms",
                flush=True,
            )
    args.out.write_text(json.dumps(results, indent=1))
    inexact = [r for r in results if r["exact_variant"] is None]
    print(f"{len(results) - len(inexact)} of {len(results)} cases bit for bit; wrote {args.out}")
    return 1 if inexact else 0


if __name__ == "__main__":
    sys.exit(main())
