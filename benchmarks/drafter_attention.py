"""A shipped drafter's pass (DSpark by default) at growing context lengths, with MLX's fused attention and
with `matmul_attention` (the drafter option `attention`).

On CUDA MLX's fused attention for several queries plans each new key length anew, and a
drafter's key length grows every round. This times one drafter pass (context extension, block
forward, Markov head; evaluated) per length: `cold` is each variant's first pass at a length,
`warm` the same lengths again. Random target features stand in for the target's (the cost does
not depend on their values), so no target forward and no verifier probe runs.

    python benchmarks/drafter_attention.py [--drafter dflash] --steps 40 --out drafter_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import dspark_flow  # noqa: F401  (loads OpenBLAS before mlx.core)


def passes(drafter: Any, start: int, steps: int, seed: int) -> list[float]:
    """ms of each pass over one growing context: `start` rows, then 1-8 more rows a step."""
    import mlx.core as mx
    import numpy as np

    from dspark_flow.strategies.samplers.greedy import GreedySampler

    rng = np.random.default_rng(seed)
    width = len(drafter.spec.target_layer_ids) * drafter.model.cfg.hidden_size
    history = rng.integers(100, 1000, start + 1).tolist()
    drafter.begin(history, GreedySampler())
    drafter._pending, drafter._rows = (
        [mx.array(rng.standard_normal((1, start, width)), mx.float32)],
        start,
    )
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        draft = drafter.propose_block(history, drafter.max_draft)
        mx.eval(draft.pending if draft.pending is not None else mx.array(draft.tokens))
        times.append(1000.0 * (time.perf_counter() - t))
        rows = int(rng.integers(1, 9))
        drafter._pending = [mx.array(rng.standard_normal((1, rows, width)), mx.float32)]
        drafter._rows += rows
        history += rng.integers(100, 1000, rows).tolist()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", choices=("dspark", "dflash"), default="dspark")
    p.add_argument("--start", type=int, default=64, help="context rows before the first pass")
    p.add_argument("--steps", type=int, default=40, help="passes, each at a longer context")
    p.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)

    from dspark_flow.api import load_target
    from dspark_flow.models.backend import backend_name
    from dspark_flow.pipeline import Pipeline

    model, tok = load_target("builtin:smollm2-135m")
    recipe = {
        "drafter": {
            "kind": args.drafter,
            "checkpoint": f"builtin:smollm2-135m-{args.drafter}",
            "draft_vocab": 8192,
        },
        "draft_cap": {"kind": "fixed", "k": 7},
    }
    drafter = Pipeline.from_dict(recipe, target=(model, tok)).warm_up().drafter
    passes(drafter, 8, 4, seed=0)  # compiles and first kernels, at lengths the runs never reach
    report: dict[str, Any] = {
        "backend": backend_name(),
        "drafter": args.drafter,
        "start": args.start,
        "steps": args.steps,
    }
    runs = {}
    # matmul first: it plans nothing, so it cannot warm the fused kernel's plans for lengths
    for name, matmul in (("matmul", True), ("fused", False)):
        drafter.model.use_matmul_attention(matmul)
        cold = passes(drafter, args.start, args.steps, seed=1)
        warm = passes(drafter, args.start, args.steps, seed=1)  # the same lengths again
        runs[name] = {"cold": cold, "warm": warm}
        report[name] = {
            "cold_ms_median": round(statistics.median(cold), 3),
            "warm_ms_median": round(statistics.median(warm), 3),
            "cold_ms_mean": round(statistics.fmean(cold), 3),
        }
        print(name, report[name])
    if args.out:
        args.out.write_text(json.dumps({**report, "passes_ms": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
