#!/usr/bin/env python3
"""Does a verify forward of K rows compute each row's logits as a one-row forward does?

    python benchmarks/row_invariance.py                                  # the library's verifier
    python benchmarks/row_invariance.py --verifier "{kind: kernels, invariant: true, \\
        compile_layers: true, fuse_projections: true}" --weights native

After a context of `--context` tokens, runs 16 one-row forwards (the logits plain greedy decoding
would see), trims the cache back, then one forward of K rows for K = 2..16 over the same tokens,
and counts the rows whose logits differ from the one-row ones in any bit, with the largest
absolute difference. Speculation at temperature 0 equals greedy token for token only where the
count is 0 for every K it verifies (or where no argmax is that close to a tie).

With `--time-against VERIFIER` it also times one verify forward of K = 1, 2, 3, 4, 6, 8 and 16
rows (after the context, the cache trimmed back each time; median of `--repeats`) through
both verifiers on the same loaded target, interleaved: what invariance costs per verify size.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import dspark_flow  # noqa: F401  (first: OpenBLAS must bind before mlx.core)


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx
    import yaml

    from dspark_flow.models.row_invariance import row_differences, synthetic_tokens
    from dspark_flow.pipeline import Pipeline

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--verifier",
        default="{kind: reference, attention: fused}",
        help="the verifier section (YAML); the default is MLX's own forward",
    )
    p.add_argument("--weights", default="auto", help="the target's weight format")
    p.add_argument("--context", type=int, default=120, help="context tokens before the rows")
    p.add_argument("--json", metavar="FILE", help="also write the figures here")
    p.add_argument("--time-against", metavar="VERIFIER", help="also time both (YAML section)")
    p.add_argument("--repeats", type=int, default=9, help="timed forwards per K and verifier")
    args = p.parse_args(argv)

    recipe = {"verifier": yaml.safe_load(args.verifier), "target": {"weights": args.weights}}
    pipe = Pipeline.from_dict(recipe).warm_up()
    model, verifier = pipe.components.model, pipe.verifier
    context = synthetic_tokens(args.context)
    rows = synthetic_tokens(16, salt=1)
    figures = {
        "verifier": recipe["verifier"],
        "weights": args.weights,
        "device": str(mx.default_device()),
    }
    by_k = {}
    for k, d in row_differences(verifier, model, context, rows, range(2, 17)).items():
        differ, worst = d.rows_differing, d.max_abs_diff
        by_k[k] = {"rows_differing": differ, "max_abs_diff": worst}
        print(
            f"K={k:2d}: {differ:2d} of {k} rows differ from one-row logits, max |diff| {worst:.3g}"
        )
    figures["by_k"] = by_k
    invariant_to = max(
        [1] + [k for k in by_k if all(by_k[j]["rows_differing"] == 0 for j in range(2, k + 1))]
    )
    figures["invariant_up_to_rows"] = invariant_to
    print(f"rows computed alike: 1..{invariant_to}")
    if args.time_against:
        other = yaml.safe_load(args.time_against)
        base = Pipeline.from_dict(
            {**recipe, "verifier": other}, target=(model, pipe.components.tokenizer)
        )
        figures["ms"] = _time_forwards(
            {"verifier": verifier, "against": base.warm_up().verifier}, model, context, args.repeats
        )
        figures["against"] = other
        for k, (mine, theirs) in figures["ms"].items():
            print(f"K={k:2d}: {mine:6.1f} ms against {theirs:6.1f} ms ({mine / theirs:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


def _time_forwards(
    verifiers: dict[str, Any], model: Any, context: list[int], repeats: int
) -> dict[int, tuple[float, ...]]:
    """Median ms of one K-row verify forward per verifier, the two interleaved per repeat."""
    import statistics
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    caches = {}
    for name, v in verifiers.items():
        caches[name] = make_prompt_cache(model)
        mx.eval(v.forward(model, context, caches[name]))
    out = {}
    for k in (1, 2, 3, 4, 6, 8, 16):
        times: dict[str, list[float]] = {name: [] for name in verifiers}
        for i in range(repeats + 2):  # two untimed passes first
            for name, v in verifiers.items():
                start = time.perf_counter()
                mx.eval(v.forward(model, [7] * k, caches[name]))
                if i >= 2:
                    times[name].append((time.perf_counter() - start) * 1e3)
                trim_prompt_cache(caches[name], k)
        out[k] = tuple(round(statistics.median(times[n]), 2) for n in verifiers)
    return out


if __name__ == "__main__":
    sys.exit(main())
