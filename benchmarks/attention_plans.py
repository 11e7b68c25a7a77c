"""MLX's fused attention at many new key lengths: what each costs, and whether MLX raises.

On CUDA, MLX 0.32 hands float16/bfloat16 attention over several queries to cuDNN, which plans
each shape anew and keeps the plans in a bounded cache (256 by default,
`MLX_CUDA_SDPA_CACHE_SIZE`); with `MLX_ENABLE_CACHE_THRASHING_CHECK` on, MLX raises once a
process has missed that cache twice its size. `import dspark_flow` turns the check off unless
the user set it (dspark_flow/models/backend.py `tolerate_cache_misses`). This script runs fused
attention of `--queries` queries at `--lengths` key lengths, each new, in a fresh process per
setting of the check, and reports ms per call and the first error.

    python benchmarks/attention_plans.py --out attention_plans.json    # on a CUDA machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import dspark_flow  # noqa: F401  (first: sets the check off unless the environment set it)

CHECK_ENV = "MLX_ENABLE_CACHE_THRASHING_CHECK"


def _child(queries: int, lengths: int, dtype: str) -> dict[str, object]:
    import mlx.core as mx

    kind = getattr(mx, dtype)
    q = mx.random.normal((1, 9, queries, 64)).astype(kind)
    done, error, start = 0, None, time.perf_counter()
    try:
        for n in range(queries, queries + lengths):
            k = mx.random.normal((1, 3, n, 64)).astype(kind)
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal"))
            done += 1
    except RuntimeError as exc:  # MLX's "Cache thrashing is happening, ..."
        error = str(exc).splitlines()[0][:160]
    seconds = time.perf_counter() - start
    return {
        "check": os.environ.get(CHECK_ENV),
        "backend": "cuda" if mx.cuda.is_available() else "other",
        "lengths_done": done,
        "ms_per_call": round(seconds / max(done, 1) * 1e3, 2),
        "error": error,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queries", type=int, default=3)
    p.add_argument("--lengths", type=int, default=700, help="new key lengths, one call each")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.queries, args.lengths, args.dtype)))
        return 0
    rows = []
    for check in ("dspark-flow's default", "1"):
        env = {k: v for k, v in os.environ.items() if k != CHECK_ENV}  # (ours set it here)
        if check == "1":
            env[CHECK_ENV] = "1"  # MLX's own default
        cmd = [sys.executable, "-P", __file__, "--child", "--queries", str(args.queries),
               "--lengths", str(args.lengths), "--dtype", args.dtype]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"attention_plans.py: the child failed: {tail[0]}")
        rows.append({"setting": check, **json.loads(proc.stdout.strip().splitlines()[-1])})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
