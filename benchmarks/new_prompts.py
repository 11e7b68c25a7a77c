"""Speculative decoding on prompts the process has not decoded before, then on the same again.

Every other benchmark here decodes its prompts once, untimed, before it times them, so a cost
paid only at a context length not seen before never shows (on CUDA, MLX's fused attention
plans each new key length: docs/benchmarks.md §6 "The drafter's attention"). This one times
that first pass too. Greedy (the quick-start recipe) and a speculative recipe (by default
recipes/dspark.yaml) once per value of one setting (`--vary`, by default the drafter's
`attention`), all with the CLI's defaults (`--library`: the library's, whose verifier is
`reference`), decode each prompt in turn, in an order rotated per prompt; then later passes do
it again. Every output must equal greedy's (exit 1 otherwise; `differed_from_greedy` lists,
per value, the [prompt, pass] pairs that did not). Speedups are reported over all prompts and
per category (ratios of summed decode times).

    python benchmarks/new_prompts.py --prompts held.jsonl --out new_prompts.json
    python benchmarks/new_prompts.py --prompts held.jsonl --library \
        --recipe recipes/dflash.yaml --set draft_cap.kind=full_block \
        --vary verifier.attention          # `dflash_generate`'s verifies, each attention
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import dspark_flow  # noqa: F401  (loads OpenBLAS before mlx.core)

REPO = Path(__file__).resolve().parent.parent


PASS_LABELS = ("first pass", "second pass")


def _ratio(greedy: list[float], values: list[float]) -> float | None:
    return round(sum(greedy) / sum(values), 3) if sum(values) > 0 else None


def _by_category(
    greedy: list[float], values: list[float], categories: list[str]
) -> dict[str, float | None]:
    """Each category's speedup: its prompts' greedy seconds over their seconds here."""
    return {
        c: _ratio(*([x for x, c2 in zip(v, categories, strict=True) if c2 == c]
                    for v in (greedy, values)))
        for c in sorted(set(categories))
    }  # fmt: skip


def _median_ratio(greedy: list[float], values: list[float]) -> float | None:
    ratios = [g / v for g, v in zip(greedy, values, strict=True) if v > 0]
    return round(statistics.median(ratios), 3) if ratios else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of {category, turns}")
    p.add_argument("--recipe", type=Path, default=REPO / "recipes" / "dspark.yaml")
    p.add_argument("--vary", default="drafter.attention", help="the recipe setting to vary")
    p.add_argument("--values", default="fused,matmul", help="its values, comma-separated")
    p.add_argument("--library", action="store_true",
                   help="the library's defaults instead of the CLI's (verifier `reference`)")  # fmt: skip
    p.add_argument("--passes", type=int, default=2, help="passes over the prompts (first: new)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--weights", default="auto",
                   help="the target's weight format (auto, native, float32, bfloat16, float16)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override the speculative recipe (as `dspark-flow run --set`)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)
    values = args.values.split(",")
    if "greedy" in values or len(set(values)) != len(values):
        p.error(f"--values must be distinct and not 'greedy' (the baseline's name): {args.values}")

    from dspark_flow.api import load_target
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.recipe.schema import TOOL_DEFAULTS

    model, tok = load_target("builtin:smollm2-135m", weights=args.weights)
    defaults = None if args.library else TOOL_DEFAULTS
    pipes: dict[str, Any] = {
        "greedy": Pipeline.from_yaml(
            REPO / "recipes" / "quickstart.yaml", target=(model, tok), defaults=defaults
        ).warm_up()
    }
    for value in values:
        overrides = [*args.overrides, f"{args.vary}={value}"]
        pipes[value] = Pipeline.from_yaml(
            args.recipe, overrides, target=(model, tok), defaults=defaults
        ).warm_up()
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    names = list(pipes)
    report: dict[str, Any] = {
        "prompts": len(rows), "max_tokens": args.max_tokens, "vary": args.vary,
        "library": args.library, "recipe": str(args.recipe), "set": args.overrides,
        "weights": args.weights,
    }  # fmt: skip
    # per value, the prompts (index, pass) whose output differed from greedy's
    differed: dict[str, list[list[int]]] = {name: [] for name in names if name != "greedy"}
    for n in range(args.passes):
        label = PASS_LABELS[n] if n < len(PASS_LABELS) else f"pass {n + 1}"
        seconds: dict[str, list[float]] = {name: [] for name in names}  # decode time a prompt
        for i, row in enumerate(rows):
            tokens = {}
            for name in names[i % len(names) :] + names[: i % len(names)]:
                r = pipes[name].generate(row["turns"][0], max_new_tokens=args.max_tokens)
                tokens[name] = r.token_ids
                rate = r.decode_tokens_per_sec
                seconds[name].append((r.num_tokens - 1) / rate if rate > 0 else 0.0)
            for name in differed:
                if tokens[name] != tokens["greedy"]:
                    differed[name].append([i, n + 1])
        # The outputs are greedy's, so each prompt's tokens are the same in every pipeline:
        # the ratio of decode times is the speedup.
        categories = [row.get("category", "all") for row in rows]
        report[label] = {
            name: {
                "decode_seconds": round(sum(values), 3),
                "speedup": _ratio(seconds["greedy"], values),
                "speedup_median_per_prompt": _median_ratio(seconds["greedy"], values),
                "speedup_by_category": _by_category(seconds["greedy"], values, categories),
                "seconds": [round(x, 4) for x in values],
            }
            for name, values in seconds.items()
        }
        report[label]["greedy"]["categories"] = categories
        brief = {
            name: {k: v for k, v in row.items() if k not in ("seconds", "categories")}
            for name, row in report[label].items()
        }
        print(label, json.dumps(brief))
    same = not any(differed.values())
    report["same_tokens"] = same
    report["differed_from_greedy"] = differed
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if not same:
        where = "; ".join(f"{name}: {len(d)}" for name, d in differed.items() if d)
        print(f"OUTPUT MISMATCH: outputs differ from greedy's (prompt-passes per value: {where})")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
