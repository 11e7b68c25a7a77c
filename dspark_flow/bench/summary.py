"""Per (target, mode, category) statistics over trials and prompts, and speedups over baselines.

Three speedup figures, because they answer different questions: the ratio of medians (typical
speed against typical speed), the median of per-prompt ratios (how a typical prompt fares,
robust to a few long or fast prompts dominating the pooled medians) and the ratio of total times
(how much sooner the whole prompt set is answered: where speeds fall in clusters, e.g. chat near
greedy's and code far above it, the pooled median jumps between the clusters and this does not).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

FIGURES = ("decode_tok_s", "e2e_tok_s", "ttft_s", "mean_accept_len", "num_tokens", "peak_memory_mb")
SPEEDUP_FIGURES = {"decode": "decode_tok_s", "e2e": "e2e_tok_s"}
# Tokens a rate leaves out of its count: decode speed starts after the first token (the prefill's).
_NOT_COUNTED = {"decode_tok_s": 1, "e2e_tok_s": 0}
ALL = "all"


def spread(values: Iterable[float | None]) -> dict[str, float | None]:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def _per_prompt(runs: list[dict[str, Any]], figure: str) -> dict[str, float]:
    """Median over trials of `figure`, per prompt."""
    by_prompt: dict[str, list[float]] = {}
    for r in runs:
        if r.get(figure) is not None:
            by_prompt.setdefault(r["prompt_id"], []).append(float(r[figure]))
    return {p: statistics.median(v) for p, v in by_prompt.items()}


def _run_key(run: dict[str, Any]) -> tuple[str, Any]:
    return run["prompt_id"], run.get("trial")


def _total_rate(
    runs: list[dict[str, Any]], figure: str, keys: set[tuple[str, Any]]
) -> float | None:
    """Tokens over seconds, summed over the runs in `keys` (None when none has a rate)."""
    tokens = seconds = 0.0
    for r in runs:
        counted = r["num_tokens"] - _NOT_COUNTED[figure]
        if _run_key(r) in keys and r.get(figure) and counted > 0:
            tokens += counted
            seconds += counted / float(r[figure])
    return tokens / seconds if seconds else None


def speedup(
    mode_runs: list[dict[str, Any]], base_runs: list[dict[str, Any]], figure: str
) -> dict[str, float | None]:
    mode_med = spread(r[figure] for r in mode_runs)["median"]
    base_med = spread(r[figure] for r in base_runs)["median"]
    ratio = mode_med / base_med if mode_med is not None and base_med else None
    mine, theirs = _per_prompt(mode_runs, figure), _per_prompt(base_runs, figure)
    ratios = [mine[p] / theirs[p] for p in mine if theirs.get(p)]
    # totals over the (prompt, trial) runs both modes made, so a missing run biases neither
    both = {_run_key(r) for r in mode_runs} & {_run_key(r) for r in base_runs}
    mode_total, base_total = (_total_rate(r, figure, both) for r in (mode_runs, base_runs))
    return {
        "ratio_of_medians": ratio,
        "median_of_ratios": statistics.median(ratios) if ratios else None,
        # None, like the other two, where either side has no rate (not 0.0: no run is not slow)
        "ratio_of_totals": mode_total / base_total if mode_total and base_total else None,
    }


def _ordered(values: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for v in values:
        seen.setdefault(v, None)
    return list(seen)


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (target, mode, category), plus category "all" when there are several."""
    rows: list[dict[str, Any]] = []
    categories = _ordered(r["category"] for r in runs)
    if len(categories) > 1:
        categories.append(ALL)
    for target in _ordered(r["target"] for r in runs):
        t_runs = [r for r in runs if r["target"] == target]
        modes = _ordered(r["mode"] for r in t_runs)
        baselines = _ordered(r["mode"] for r in t_runs if r["baseline"])
        for category in categories:
            c_runs = [r for r in t_runs if category in (ALL, r["category"])]
            by_mode = {m: [r for r in c_runs if r["mode"] == m] for m in modes}
            for mode in modes:
                mine = by_mode[mode]
                if not mine:
                    continue
                row: dict[str, Any] = {
                    "target": target,
                    "mode": mode,
                    "kind": mine[0]["kind"],
                    "baseline": mine[0]["baseline"],
                    "category": category,
                    "n_runs": len(mine),
                    "n_prompts": len({r["prompt_id"] for r in mine}),
                }
                for figure in FIGURES:
                    row[figure] = spread(r[figure] for r in mine)
                row["speedup"] = {
                    base: {
                        short: speedup(mine, by_mode[base], fig)
                        for short, fig in SPEEDUP_FIGURES.items()
                    }
                    for base in baselines
                    if base != mode and by_mode.get(base)
                }
                row["mismatches"] = sum(1 for r in mine if r.get("matches_greedy") is False)
                row["checked"] = sum(1 for r in mine if r.get("matches_greedy") is not None)
                rows.append(row)
    return rows
