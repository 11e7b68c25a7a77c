"""Does speculation's gain fade as an answer grows? Speed over greedy in each half of the answer.

On the H200 (docs/benchmarks.md §6, 2026-12-03) the shipped DFlash recipe ran at 1.85x greedy
for 128-token answers and 1.54x for 256-token ones, on different machines, greedy itself at 150
and 227 tok/s. This decodes the same prompts with greedy and with a shipped recipe in one
process, interleaved, for `--max-tokens` tokens, notes when every round commits its tokens (at
the sampler's verify, the round's one host sync; plain rounds are not overlapped, as on CUDA and
the CPU by default) and reports, for whole answers (after their first token) and for each half
of the answers that reach the full length (an answer ended by EOS has no second half of the same
length): ms per token, speed over greedy and tokens per round (`figures`). Both run the command
line's verifier stack (`TOOL_DEFAULTS`), as `dspark-flow bench` does.

    python -P benchmarks/depth_split.py --recipe recipes/dflash.yaml --prompts h4.jsonl \
        --trials 2 --max-tokens 256 [--out split.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import dspark_flow  # noqa: F401  (loads OpenBLAS before mlx.core)


def record_commits(pipe: Any, timeline: list[tuple[float, int]]) -> None:
    """Append (time, tokens committed so far) to `timeline` after each round's verify; the first
    entry (at the first verify's start) counts the prefill's token. Cleared per generation by
    the caller."""
    sampler = pipe.sampler
    verify = sampler.verify

    def timed(logits: Any, draft: Any) -> tuple[int, int]:
        if not timeline:
            timeline.append((time.perf_counter(), 1))
        accepted, token = verify(logits, draft)
        timeline.append((time.perf_counter(), timeline[-1][1] + accepted + 1))
        return accepted, token

    sampler.verify = timed


def halves(timeline: list[tuple[float, int]], length: int) -> list[tuple[float, int, int]]:
    """(seconds, tokens, rounds) from the first token to the round reaching length/2, and from
    there to the end."""
    mid = next(i for i, (_, n) in enumerate(timeline) if n >= length // 2)
    (t0, n0), (tm, nm), (te, ne) = timeline[0], timeline[mid], timeline[-1]
    return [(tm - t0, nm - n0, mid), (te - tm, ne - nm, len(timeline) - 1 - mid)]


def figures(runs: list[dict[str, Any]], part: str) -> dict[str, float]:
    """Greedy against speculative over `runs` for one part of the answers ('whole', 'half 1',
    'half 2'): medians of ms per token, the median of the per-run ratios, the ratio of the
    median ms per token (and, for whole answers, of the median times), and tokens per round
    (rounds that drafted nothing count)."""

    def side(run: dict[str, Any], name: str) -> tuple[float, int, int]:
        if part == "whole":
            return run[f"{name} whole"]
        return run[name][0 if part == "half 1" else 1]

    g = [side(r, "greedy") for r in runs]
    s = [side(r, "speculative") for r in runs]
    g_ms = [1000 * t / max(n, 1) for t, n, _ in g]
    s_ms = [1000 * t / max(n, 1) for t, n, _ in s]
    out = {
        "greedy_ms_per_token": round(statistics.median(g_ms), 3),
        "speculative_ms_per_token": round(statistics.median(s_ms), 3),
        "median_of_ratios": round(
            statistics.median(a / b for a, b in zip(g_ms, s_ms, strict=True)), 3
        ),
        "ratio_of_median_ms_per_token": round(statistics.median(g_ms) / statistics.median(s_ms), 3),
        "tokens_per_round": round(statistics.median(n / max(k, 1) for _, n, k in s), 3),
        "runs": len(runs),
    }
    if part == "whole":  # equal outputs, equal token counts: times compare directly (a half
        # ends at the round that passes the middle, a few tokens apart between the two)
        out["ratio_of_median_times"] = round(
            statistics.median(t for t, _, _ in g) / statistics.median(t for t, _, _ in s), 3
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=Path, required=True, help="a shipped recipe with a drafter")
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of {category, turns}")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)

    import yaml

    from dspark_flow.api import load_target
    from dspark_flow.engine import decode
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.recipe.schema import TOOL_DEFAULTS

    # Every round then ends at the sampler's verify (on Metal a plain round may otherwise read
    # its token ahead, through `sample`, and escape the timeline).
    decode.OVERLAP_PLAIN_ROUNDS = False

    recipe = yaml.safe_load(args.recipe.read_text())
    recipe.setdefault("verifier", TOOL_DEFAULTS["verifier"])
    recipe["stop"] = [{"kind": "eos"}, {"kind": "max_tokens", "limit": args.max_tokens}]
    greedy = {k: v for k, v in recipe.items() if k not in ("drafter", "draft_cap")}
    model, tok = load_target(recipe["target"]["model"])
    pipes = {
        "greedy": Pipeline.from_dict(greedy, target=(model, tok)).warm_up(),
        "speculative": Pipeline.from_dict(recipe, target=(model, tok)).warm_up(),
    }
    timelines: dict[str, list[tuple[float, int]]] = {name: [] for name in pipes}
    for name, pipe in pipes.items():
        record_commits(pipe, timelines[name])

    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    names = list(pipes)
    runs: list[dict[str, Any]] = []
    for trial in range(args.trials + 1):  # the first pass warms every shape up, untimed
        for i, row in enumerate(rows):
            got: dict[str, Any] = {}
            for name in names[(trial + i) % 2 :] + names[: (trial + i) % 2]:  # rotated
                timelines[name].clear()
                r = pipes[name].generate(row["turns"][0], max_new_tokens=args.max_tokens)
                got[name] = (r.token_ids, list(timelines[name]))
            if trial == 0:
                continue
            same = got["greedy"][0] == got["speculative"][0]
            full = len(got["greedy"][0]) >= args.max_tokens
            run = {"prompt": i, "category": row.get("category"), "same": same, "full": full}
            for name in names:  # the whole answer after its first token: seconds, tokens, rounds
                line = got[name][1] or [(0.0, 1)]  # a one-token answer has no round
                (t0, n0), (te, ne) = line[0], line[-1]
                run[f"{name} whole"] = (te - t0, ne - n0, len(line) - 1)
            if full:
                for name in names:
                    run[name] = halves(got[name][1], args.max_tokens)
            runs.append(run)

    report: dict[str, Any] = {
        "recipe": str(args.recipe),
        "max_tokens": args.max_tokens,
        "trials": args.trials,
        "prompts": len(rows),
        "outputs_equal_to_greedy": all(r["same"] for r in runs),
        "full_length_runs": sum(r["full"] for r in runs),
        "runs": runs,
    }
    print(
        f"{args.recipe} at {args.max_tokens} tokens, {len(rows)} prompts x {args.trials} trials; "
        f"outputs equal to greedy's: {'yes' if report['outputs_equal_to_greedy'] else 'NO'}; "
        f"{report['full_length_runs']} runs reached the full length"
    )
    categories = ["all", *sorted({str(r["category"]) for r in runs})]
    parts = [("whole", lambda r: True), ("half 1", lambda r: r["full"])]
    parts.append(("half 2", lambda r: r["full"]))
    for part, counted in parts:
        for cat in categories:
            sel = [r for r in runs if counted(r) and cat in ("all", str(r["category"]))]
            if sel:
                report.setdefault(part, {})[cat] = figures(sel, part)
                print(f"{part} {cat}: {report[part][cat]}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
