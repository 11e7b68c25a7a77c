"""What evaluating drafts on a worker thread buys (`dspark_flow.engine.draft_worker`).

On CUDA MLX launches a graph's kernels from the evaluating thread, so the loop's `async_eval` of
a lazy draft does most of the drafter's launch work before it returns, and only then does the
loop build the verify graph. With `DRAFT_ON_WORKER` a worker thread evaluates the draft while
the loop's thread builds that graph. This decodes the same prompts with greedy and, for each
`--recipe`, the recipe without and with the worker, in one process, interleaved (the order
rotates per prompt and trial; a first pass is untimed), every pipeline on the command line's
verifier stack (`TOOL_DEFAULTS`), and reports per category: ms a token after the first (median),
speed over greedy (median of per-run ratios; ratio of median times) and the worker's speed over
no worker (median of per-run ratios). Every output must equal greedy's.

    python -P benchmarks/draft_worker.py --recipe recipes/dflash.yaml --recipe recipes/dspark.yaml \
        --prompts h4.jsonl --trials 2 --max-tokens 128 [--out worker.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import dspark_flow  # noqa: F401  (loads OpenBLAS before mlx.core)


def summarise(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode: median ms a token, and against greedy the median of per-run speed ratios and
    the ratio of the median total times; per recipe, the worker against none (paired)."""
    out: dict[str, Any] = {}
    g_ms = [r["ms"]["greedy"] for r in runs]
    g_s = [r["seconds"]["greedy"] for r in runs]
    for mode in modes:
        ms = [r["ms"][mode] for r in runs]
        s = [r["seconds"][mode] for r in runs]
        out[mode] = {
            "ms_per_token": round(statistics.median(ms), 3),
            "x_greedy_median_of_ratios": round(
                statistics.median(a / b for a, b in zip(g_ms, ms, strict=True)), 3
            ),
            "x_greedy_ratio_of_median_times": round(
                statistics.median(g_s) / statistics.median(s), 3
            ),
            "tau": round(statistics.median(r["tau"][mode] for r in runs), 3),
        }
    for mode in modes:
        if mode.endswith(", worker"):
            base = mode.removesuffix(", worker")
            out[mode]["x_no_worker_median_of_ratios"] = round(
                statistics.median(r["ms"][base] / r["ms"][mode] for r in runs), 3
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=Path, action="append", required=True, help="repeatable")
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of {category, turns}")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)

    import yaml

    from dspark_flow.api import load_target
    from dspark_flow.engine import draft_worker
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.recipe.schema import TOOL_DEFAULTS

    recipes = [yaml.safe_load(path.read_text()) for path in args.recipe]
    for recipe in recipes:
        recipe.setdefault("verifier", TOOL_DEFAULTS["verifier"])
        recipe["stop"] = [{"kind": "eos"}, {"kind": "max_tokens", "limit": args.max_tokens}]
    greedy = {k: v for k, v in recipes[0].items() if k not in ("drafter", "draft_cap")}
    model, tok = load_target(recipes[0]["target"]["model"])
    pipes: dict[str, Any] = {"greedy": Pipeline.from_dict(greedy, target=(model, tok)).warm_up()}
    for path, recipe in zip(args.recipe, recipes, strict=True):
        for mode in (path.stem, f"{path.stem}, worker"):  # apart: each `auto` learns its own
            pipes[mode] = Pipeline.from_dict(recipe, target=(model, tok)).warm_up()
    modes = list(pipes)

    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    runs: list[dict[str, Any]] = []
    for trial in range(args.trials + 1):  # the first pass warms every shape up, untimed
        for i, row in enumerate(rows):
            turn = (trial * len(rows) + i) % len(modes)
            got: dict[str, Any] = {}
            for mode in modes[turn:] + modes[:turn]:
                draft_worker.DRAFT_ON_WORKER = mode.endswith(", worker")
                got[mode] = pipes[mode].generate(row["turns"][0], max_new_tokens=args.max_tokens)
            draft_worker.DRAFT_ON_WORKER = None
            if trial == 0:
                continue
            ids = got["greedy"].token_ids
            runs.append(
                {
                    "prompt": i,
                    "category": row.get("category"),
                    "same": all(r.token_ids == ids for r in got.values()),
                    "ms": {m: 1000.0 / max(r.decode_tokens_per_sec, 1e-9) for m, r in got.items()},
                    "seconds": {
                        m: (r.num_tokens - 1) / max(r.decode_tokens_per_sec, 1e-9)
                        for m, r in got.items()
                    },
                    "tau": {m: r.mean_accept_len for m, r in got.items()},
                }
            )

    report: dict[str, Any] = {
        "recipes": [str(p) for p in args.recipe],
        "max_tokens": args.max_tokens,
        "trials": args.trials,
        "prompts": len(rows),
        "outputs_equal_to_greedy": all(r["same"] for r in runs),
        "runs": runs,
        "summary": {},
    }
    print(
        f"{len(rows)} prompts x {args.trials} trials, {args.max_tokens} tokens; outputs equal to "
        f"greedy's: {'yes' if report['outputs_equal_to_greedy'] else 'NO'}"
    )
    for cat in ["all", *sorted({str(r["category"]) for r in runs})]:
        sel = [r for r in runs if cat in ("all", str(r["category"]))]
        report["summary"][cat] = summarise(sel, modes)
        for mode, fig in report["summary"][cat].items():
            print(f"{cat:5} {mode:18} {fig}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if report["outputs_equal_to_greedy"] else 3


if __name__ == "__main__":
    raise SystemExit(main())
