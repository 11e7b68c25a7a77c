"""What calibration charges a drafting round, with and without the drafter's context growth.

The decode loop's proposal first takes the rows committed since the last one into the
drafter's context (`extend_context`); calibration used to time proposals on one unchanged
history, which leaves that out. This builds the shipped recipe (`recipes/<drafter>.yaml`) as
`dspark-flow run` does, times its drafter's proposals both ways and prints, per k, the drafter's cost and what a drafting
round is charged over a plain step (verify of k + 1 rows plus the drafter, over verify of one
row), to set beside the loop's own ratio (`off_rounds.py --rounds`: a drafting round's ms over
an off round's).

    python benchmarks/drafter_context_cost.py [--drafter dflash] [--repeats 7] [--plain-verifier]

On a fresh H200 the warm-up (the kernels verifier's probes, the calibration) took over 110 s
before the first line; `--plain-verifier` skips the probes (the drafter's cost does not depend
on the verifier, the plain-step ratio does a little).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import dspark_flow  # noqa: F401  (loads OpenBLAS before mlx.core)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", choices=("dspark", "dflash"), default="dspark")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--plain-verifier", action="store_true", help="the reference verifier (a shorter warm-up)"
    )
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)

    from dspark_flow.calibration import curves as curves_mod
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.recipe.schema import TOOL_DEFAULTS
    from dspark_flow.strategies.samplers.greedy import GreedySampler

    recipe = Path(__file__).resolve().parent.parent / "recipes" / f"{args.drafter}.yaml"
    overrides = ["verifier={kind: reference}"] if args.plain_verifier else []
    print(f"warming up {recipe.name} (overrides: {overrides or 'none'})", flush=True)
    pipe = Pipeline.from_yaml(recipe, overrides, defaults=TOOL_DEFAULTS).warm_up()
    c = pipe.components
    assert c is not None
    drafter, curves = c.drafter, c.draft_cap.curves
    block = curves.block
    history = curves_mod.sample_history(c.tokenizer)

    def forward(m: Any, tokens: list[int], cache: list[Any]) -> Any:
        return c.verifier.forward(m, tokens, cache)

    def timed(grow: bool) -> list[float]:
        return curves_mod.measure_drafter(
            drafter, history, block, GreedySampler(), model=c.model, forward=forward,
            repeats=args.repeats, warmup=2, grow_context=grow,
        )  # fmt: skip

    rows: dict[str, list[float]] = {}
    for trial in range(2):  # interleaved: a slow phase hits both alike
        for grow in (False, True):
            name = "with one new row" if grow else "unchanged history"
            found = timed(grow)
            rows[name] = found if trial == 0 else [min(a, b) for a, b in zip(rows[name], found)]
    depth = len(history)
    plain = curves.verify_cost(1, depth)
    print(f"{args.drafter}: verify of one row {1000 * plain:.3f} ms at depth {depth}", flush=True)
    print("k | drafter ms, unchanged | with one new row | round / plain step, unchanged | new")
    for k in range(1, block + 1):
        verify = curves.verify_cost(k + 1, depth)
        old, new = rows["unchanged history"][k], rows["with one new row"][k]
        print(f"{k} | {1000 * old:.3f} | {1000 * new:.3f} | {(verify + old) / plain:.2f} | "
              f"{(verify + new) / plain:.2f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"drafter": args.drafter, "depth": depth, "plain": plain, **rows}, f)


if __name__ == "__main__":
    main()
