#!/usr/bin/env python3
"""A/B of lazy greedy drafts: the same pipeline with the draft's ids left on the device for the
verify (`Draft.pending`, the default) and synced first, interleaved in one process.

    python benchmarks/pending_ab.py --recipe recipes/dspark.yaml --cap "{kind: fixed, k: 5}"
    python3 -P benchmarks/pending_ab.py --set verifier="{kind: kernels, invariant: true}"  # GPU

Prints decode tok/s medians of both and the median of per-run ratios (pending / synced), and
checks that both committed the same tokens. Side by side in one run: these machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import dspark_flow  # noqa: F401  (first: OpenBLAS must bind before mlx.core)
from dspark_flow.bench.prompts import AB_PROMPTS

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [*AB_PROMPTS, "def fibonacci(n):"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "dspark.yaml"))
    p.add_argument("--cap", default="{kind: fixed, k: 5}", help="the draft_cap section")
    p.add_argument("--set", action="append", default=[], help="more recipe overrides")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = p.parse_args(argv)

    from dspark_flow import Pipeline
    from dspark_flow.strategies.samplers.greedy import GreedySampler

    overrides = [f"draft_cap={args.cap}", f"stop.1.limit={args.max_tokens}", *args.set]
    pipeline = Pipeline.from_yaml(args.recipe, overrides=overrides).warm_up()
    speed: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {True: [], False: []}
    for trial in range(args.trials + 1):  # trial 0 warms every shape up, unrecorded
        for prompt in PROMPTS:
            order = (True, False) if trial % 2 == 0 else (False, True)  # drift hits both alike
            for pending in order:
                GreedySampler.resolves_pending = pending
                result = pipeline.generate(prompt)
                if trial:
                    speed[pending].append(result.decode_tokens_per_sec)
                    tokens[pending].append(result.token_ids)
        print(f"trial {trial} done", file=sys.stderr, flush=True)
    ratios = [a / b for a, b in zip(speed[True], speed[False], strict=True)]
    figures = {
        "cap": args.cap,
        "overrides": args.set,
        "pending_tok_s": statistics.median(speed[True]),
        "synced_tok_s": statistics.median(speed[False]),
        "median_ratio": statistics.median(ratios),
        "runs": len(ratios),
        "same_tokens": tokens[True] == tokens[False],
    }
    print(
        f"pending {figures['pending_tok_s']:.2f} tok/s, synced {figures['synced_tok_s']:.2f}; "
        f"median per-run ratio {figures['median_ratio']:.3f} over {len(ratios)} runs; "
        f"same tokens: {figures['same_tokens']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if figures["same_tokens"] else 3


if __name__ == "__main__":
    sys.exit(main())
