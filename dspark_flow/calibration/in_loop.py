"""What decoding rounds really cost, against what the curves say they cost.

The curves (`curves.py`) time verify forwards in a tight loop of their own. The decode loop
times every round it runs (`DraftCap.observe`'s `seconds`: drafting, the verify forward, the
host sync, the cache trim), so a benchmark can check the curves against the loop itself: on
the H200 the lookup sweep of 2026-11-30 23:10 UTC found the curves' one-row cost 1.5x the
loop's plain decoding step in the call that measured them and up to 2.2x in later calls
(docs/benchmarks.md §3). These helpers record the rounds, summarise them per row count, and
turn them into `Curves` that a replay can charge instead of the measured ones.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark_flow.calibration.curves import Curves
from dspark_flow.strategy import COPY_SOURCE, DRAFTER_SOURCE

# Fewer rounds than this at one row count are too few for a median that decides anything.
MIN_ROUNDS = 5


@dataclass(frozen=True)
class Round:
    rows: int  # verified rows: the tokens proposed + 1
    depth: int  # context length when the round started
    seconds: float


def record_rounds(cap: Any) -> list[tuple[int, int, float, str]]:
    """Log (proposed, accepted, seconds, source) of every round `cap` observes; the list is
    live."""
    log: list[tuple[int, int, float, str]] = []
    observe = cap.observe

    def recorded(
        proposed: int, accepted: int, seconds: float, source: str = DRAFTER_SOURCE
    ) -> None:
        log.append((proposed, accepted, seconds, source))
        observe(proposed, accepted, seconds, source)

    cap.observe = recorded
    return log


def rounds_of(log: Iterable[tuple[int, int, float, str]], prompt_len: int) -> list[Round]:
    """One generation's logged rounds with the depth each started at: the prompt plus the
    prefill's token, then what every earlier round committed (its accepted drafts + 1). Rounds
    that drafted a copied run are left out (they ran no drafter pass, so their times are not
    what the curves charge a round of that many rows); their tokens still count for depth."""
    depth = prompt_len + 1
    out = []
    for proposed, accepted, seconds, source in log:
        if not (source == COPY_SOURCE and proposed > 0):
            out.append(Round(rows=proposed + 1, depth=depth, seconds=seconds))
        depth += accepted + 1
    return out


@dataclass(frozen=True)
class RowCost:
    rows: int
    rounds: int
    seconds: float  # median round time
    depth: float  # median depth of those rounds


def summarize_rounds(rounds: Iterable[Round]) -> list[RowCost]:
    """Median round time and depth per row count, ascending."""
    by_rows: dict[int, list[Round]] = defaultdict(list)
    for r in rounds:
        by_rows[r.rows].append(r)
    return [
        RowCost(
            rows=n,
            rounds=len(rs),
            seconds=statistics.median(r.seconds for r in rs),
            depth=statistics.median(r.depth for r in rs),
        )
        for n, rs in sorted(by_rows.items())
    ]


def comparison_table(costs: list[RowCost], curves: Curves, plain: float | None = None) -> str:
    """Markdown: per row count, the loop's median round time against the curves' figure at
    the same depth. `plain`: plain greedy decoding's seconds per token, for the one-row line."""
    lines = [
        "| rows | rounds | in loop (ms) | curves (ms) | loop / curves |",
        "|---|---|---|---|---|",
    ]
    if plain is not None:
        depth = costs[0].depth if costs else curves.depths[0]
        model = curves.round_cost(0, depth)
        lines.append(
            f"| 1 (greedy) | per token | {plain * 1e3:.2f} | {model * 1e3:.2f} | "
            f"{plain / model:.2f} |"
        )
    for c in costs:
        model = curves.round_cost(c.rows - 1, c.depth)
        lines.append(
            f"| {c.rows} | {c.rounds} | {c.seconds * 1e3:.2f} | {model * 1e3:.2f} | "
            f"{c.seconds / model:.2f} |"
        )
    return "\n".join(lines)


def in_loop_curves(costs: list[RowCost], curves: Curves, min_rounds: int = MIN_ROUNDS) -> Curves:
    """`curves` rescaled to what the loop measured, for replays: each row count with at least
    `min_rounds` rounds takes the ratio of its median to the curves' figure at that depth;
    row counts in between interpolate the ratios, those outside take the nearest one. The
    ratio applies at every depth (the loop's rounds cover too few depths to fit their own).
    Raises ValueError when no row count has enough rounds."""
    known = {
        c.rows: c.seconds / curves.round_cost(c.rows - 1, c.depth)
        for c in costs
        if c.rounds >= min_rounds
    }
    if not known:
        raise ValueError(f"no row count has {min_rounds} rounds or more")
    xs = sorted(known)
    # Linear between measured row counts, the nearest one's ratio outside them.
    ratios = np.interp(np.arange(1, len(curves.verify[0]) + 1), xs, [known[x] for x in xs])

    # The drafter's cost stays as measured; the ratio lands on the verify part (a round's
    # drafting is small next to its forward, and the loop times both together).
    verify = [
        [
            max(0.0, float(r) * (t + curves.drafter_cost(k - 1)) - curves.drafter_cost(k - 1))
            for k, (t, r) in enumerate(zip(row, ratios, strict=True), start=1)
        ]
        for row in curves.verify
    ]
    meta = {**curves.meta, "rescaled_to_loop": {str(k): round(v, 4) for k, v in known.items()}}
    return Curves(
        depths=list(curves.depths), verify=verify, drafter=list(curves.drafter), meta=meta
    )
