"""MLX's fused attention at many new key lengths: what a new shape costs, and when MLX raises.

On CUDA, MLX 0.32 hands float16/bfloat16 attention over several queries to cuDNN, which plans
each shape anew and keeps the plans in a cache of 256 (`MLX_CUDA_SDPA_CACHE_SIZE`). With
`MLX_ENABLE_CACHE_THRASHING_CHECK` on (MLX's default) it raises "Cache thrashing is happening"
after 512 misses in a row; a hit resets the count (mlx/backend/cuda/lru_cache.h). A model's
forward calls attention once per layer at one shape, so only its first layer misses. This
script runs fused attention of `--queries` queries at `--lengths` new key lengths, each length
`--calls-per-shape` times in a row (1: MLX's worst case; 30: a 30-layer forward), in a fresh
process per setting, and reports ms per new length and the first error:

* the check on, 1 call per shape;
* the check on, `--calls-per-shape` calls per shape (default 30);
* the check off, 1 call per shape.

    python benchmarks/attention_plans.py --out attention_plans.json    # on a CUDA machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import dspark_flow  # noqa: F401  (first: OpenBLAS must bind before mlx.core)
from dspark_flow.bench.fresh_process import run_child

CHECK_ENV = "MLX_ENABLE_CACHE_THRASHING_CHECK"


def _child(queries: int, lengths: int, calls: int, dtype: str) -> dict[str, object]:
    """Attention at each new length `calls` times; the lengths done and the first error."""
    import mlx.core as mx

    kind = getattr(mx, dtype)
    q = mx.random.normal((1, 9, queries, 64)).astype(kind)
    done, error, start = 0, None, time.perf_counter()
    try:
        for n in range(queries, queries + lengths):
            k = mx.random.normal((1, 3, n, 64)).astype(kind)
            for _ in range(calls):
                mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal"))
            done += 1
    except RuntimeError as exc:  # MLX's "Cache thrashing is happening, ..."
        error = str(exc).splitlines()[0][:160]
    seconds = time.perf_counter() - start
    return {
        "check": os.environ.get(CHECK_ENV),
        "calls_per_shape": calls,
        "backend": "cuda" if mx.cuda.is_available() else "not cuda",
        "lengths_done": done,
        "ms_per_length": round(seconds / max(done, 1) * 1e3, 2),
        "error": error,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queries", type=int, default=3)
    p.add_argument("--lengths", type=int, default=700, help="new key lengths")
    p.add_argument("--calls-per-shape", type=int, default=30, help="for the second setting")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.queries, args.lengths, args.calls, args.dtype)))
        return 0
    rows = []
    for check, calls in (("1", 1), ("1", args.calls_per_shape), ("0", 1)):
        env = {**os.environ, CHECK_ENV: check}  # read as mlx.core loads: set per process
        child = ["--queries", str(args.queries), "--lengths", str(args.lengths),
                 "--calls", str(calls), "--dtype", args.dtype]  # fmt: skip
        rows.append(run_child(__file__, child, env, "the child"))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
