"""Held-out acceptance (τ per category) of trained drafters side by side, from the
`train_summary.json` their `--stage eval` wrote: one bar group per category, one bar per drafter.

    python benchmarks/plot_acceptance.py \
        "DSpark, first data=old/smollm2-135m-dspark/train_summary.json" \
        "DSpark, 2.2x data=dspark_flow/data/drafters/smollm2-135m-dspark/train_summary.json" \
        --goal chat=3 --goal code=4 --goal math=4 --out docs/img/trained_drafters_acceptance.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CATEGORIES = ("chat", "code", "math", "all")


def read_tau(path: Path, label: str = "shipped") -> dict[str, float]:
    """τ per category of the summary's evaluation of the shipped (quantized) drafter."""
    try:
        rows = json.loads(path.read_text())["eval"][label]
        return {c: float(rows[c]["tau"]) for c in CATEGORIES if c in rows}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise SystemExit(f"{path}: no '{label}' evaluation with τ per category ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafters", nargs="+", metavar="LABEL=SUMMARY")
    p.add_argument("--goal", action="append", default=[], metavar="CATEGORY=TAU")
    p.add_argument("--title", default="Held-out acceptance, greedy, full block")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for item in args.drafters:
        label, _, path = item.rpartition("=")
        if not label:
            raise SystemExit(f"{item!r}: expected LABEL=SUMMARY")
        series.append((label, read_tau(Path(path))))
    goals: dict[str, float] = {}
    for goal in args.goal:
        name, _, value = goal.partition("=")
        try:
            goals[name] = float(value)
        except ValueError:
            raise SystemExit(f"--goal {goal!r}: expected CATEGORY=TAU, e.g. code=4") from None

    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for i, (label, tau) in enumerate(series):
        shown = [c for c, name in enumerate(CATEGORIES) if name in tau]  # no bar for no data
        xs = [c + (i - (len(series) - 1) / 2) * width for c in shown]
        ys = [tau[CATEGORIES[c]] for c in shown]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    for c, name in enumerate(CATEGORIES):
        if name in goals:
            ax.hlines(goals[name], c - 0.45, c + 0.45, colors="k", linestyles="dashed")
    ax.set_xticks(range(len(CATEGORIES)), CATEGORIES)
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title(args.title + ("  (dashed: goal)" if goals else ""))
    top = max([*goals.values(), *(t for _, tau in series for t in tau.values())])
    ax.set_ylim(0, top * 1.25)  # room for the legend above the bars and goals
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
