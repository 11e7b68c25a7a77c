"""Real acceptance of a drafter directory, measured by the product's own speculative loop
(greedy, full block each round) on held-out prompts, per category.

τ = tokens committed per round (accepted drafts + the target's own token), pooled over every
round of every prompt of a category.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dspark_flow.training.recipe import PromptFile


def category_of(spec: PromptFile) -> str:
    return spec.category or Path(spec.path).stem


def evaluate_drafter(
    target: Any,
    tokenizer: Any,
    drafter_dir: Path,
    prompts: list[PromptFile],
    *,
    max_new_tokens: int = 128,
    progress: bool = True,
    system: str | None = None,
) -> dict[str, dict[str, float]]:
    """{category: {tau, prompts, tokens, rounds, seconds}} plus an 'all' row. `system`: the
    system message the training data was made with (the prompts are asked under it too)."""
    from tqdm import tqdm

    from dspark_flow.api import load_drafter, speculative_generate
    from dspark_flow.models.drafter_loading import quantize_as_stored
    from dspark_flow.training.data import read_prompts

    # as it ships: the 4-bit export stays 4-bit on GPUs, the float copy float
    drafter = load_drafter(str(drafter_dir), target, quantize=quantize_as_stored(drafter_dir))
    jobs = [(category_of(spec), p) for spec in prompts for p in read_prompts(spec)]
    totals: dict[str, dict[str, float]] = {}
    for cat, prompt in tqdm(
        jobs, desc=f"evaluate {Path(drafter_dir).name}", unit="prompt", disable=not progress
    ):
        t0 = time.perf_counter()
        turns = [{"role": "system", "content": system}] if system else []
        res = speculative_generate(
            target,
            tokenizer,
            drafter,
            [*turns, {"role": "user", "content": prompt}],
            max_new_tokens=max_new_tokens,
            max_draft_tokens=None,
        )
        for key in (cat, "all"):
            row = totals.setdefault(key, {"prompts": 0, "tokens": 0, "rounds": 0, "seconds": 0.0})
            row["prompts"] += 1
            row["tokens"] += sum(res.accept_lengths)
            row["rounds"] += len(res.accept_lengths)
            row["seconds"] += time.perf_counter() - t0
    for row in totals.values():
        row["tau"] = row["tokens"] / max(row["rounds"], 1)
    return totals


def format_eval(rows: dict[str, dict[str, float]]) -> str:
    lines = ["| category | prompts | τ (tokens/round) | rounds |", "|---|---|---|---|"]
    for cat, r in sorted(rows.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        lines.append(f"| {cat} | {int(r['prompts'])} | {r['tau']:.2f} | {int(r['rounds'])} |")
    return "\n".join(lines)
