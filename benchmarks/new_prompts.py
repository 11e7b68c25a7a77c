"""Speculative decoding on prompts the process has not decoded before, then on the same again.

Every other benchmark here decodes its prompts once, untimed, before it times them, so a cost
paid only at a context length not seen before never shows (on CUDA, MLX's fused attention
plans each new key length: docs/benchmarks.md §6 "The drafter's attention"). This one times
that first pass too. Greedy (the quick-start recipe) and a speculative recipe (by default
recipes/dspark.yaml) once per drafter `attention` choice, all with the CLI's defaults, decode
each prompt in turn, in an order rotated per prompt; then a second pass does it again. Every
output must equal greedy's (exit 1 otherwise).

    python benchmarks/new_prompts.py --prompts held.jsonl --out new_prompts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import dspark_flow  # noqa: F401  (loads OpenBLAS before mlx.core)

REPO = Path(__file__).resolve().parent.parent


def _median_ratio(greedy: list[float], values: list[float]) -> float | None:
    ratios = [g / v for g, v in zip(greedy, values, strict=True) if v > 0]
    return round(statistics.median(ratios), 3) if ratios else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of {category, turns}")
    p.add_argument("--recipe", type=Path, default=REPO / "recipes" / "dspark.yaml")
    p.add_argument("--attentions", default="fused,matmul", help="drafter attention choices")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override the speculative recipe (as `dspark-flow run --set`)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)

    from dspark_flow.api import load_target
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.recipe.schema import TOOL_DEFAULTS

    model, tok = load_target("builtin:smollm2-135m")
    pipes: dict[str, Any] = {
        "greedy": Pipeline.from_yaml(
            REPO / "recipes" / "quickstart.yaml", target=(model, tok), defaults=TOOL_DEFAULTS
        ).warm_up()
    }
    for attention in args.attentions.split(","):
        overrides = [*args.overrides, f"drafter.attention={attention}"]
        pipes[attention] = Pipeline.from_yaml(
            args.recipe, overrides, target=(model, tok), defaults=TOOL_DEFAULTS
        ).warm_up()
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    names = list(pipes)
    report: dict[str, Any] = {"prompts": len(rows), "max_tokens": args.max_tokens}
    same = True
    for label in ("first pass", "second pass"):
        seconds: dict[str, list[float]] = {name: [] for name in names}  # decode time a prompt
        for i, row in enumerate(rows):
            tokens = {}
            for name in names[i % len(names) :] + names[: i % len(names)]:
                r = pipes[name].generate(row["turns"][0], max_new_tokens=args.max_tokens)
                tokens[name] = r.token_ids
                rate = r.decode_tokens_per_sec
                seconds[name].append((r.num_tokens - 1) / rate if rate > 0 else 0.0)
            same &= all(t == tokens["greedy"] for t in tokens.values())
        # The outputs are greedy's, so each prompt's tokens are the same in every pipeline:
        # the ratio of decode times is the speedup.
        report[label] = {
            name: {
                "decode_seconds": round(sum(values), 3),
                "speedup": round(sum(seconds["greedy"]) / sum(values), 3) if sum(values) else None,
                "speedup_median_per_prompt": _median_ratio(seconds["greedy"], values),
            }
            for name, values in seconds.items()
        }
        print(label, json.dumps(report[label]))
    report["same_tokens"] = same
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if not same:
        print("OUTPUT MISMATCH: a speculative output differs from greedy's")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
