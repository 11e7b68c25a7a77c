#!/usr/bin/env python3
"""Does a self-prompt start steer the target toward answers like a benchmark's? Greedy τ of a
drafter (full block, the product's loop) on prompts the target writes itself, begun each way,
beside the evaluation prompts of each category. A start whose answers decode at the τ of a
category's benchmark makes training data like that benchmark's; free prompts decode easier.

    python benchmarks/start_tau.py --per-start 6            # CPU: ~5 min with the DFlash drafter
    python benchmarks/start_tau.py --starts "" "Write a" --drafter builtin:smollm2-135m-dspark

The prompts are written with the data stage's own batch sampler (temperature 1, top-p 0.95; seed
`--seed` + the start's index, 9 and up by default: draws no shipped set used), so they are new to
the drafter; the evaluation prompts are the held-out ones of `heldout_prompts.py`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import dspark_flow  # noqa: F401  (first: OpenBLAS must bind before mlx.core)
from dspark_flow.api import load_drafter, load_target, speculative_generate
from dspark_flow.training.data import _eos_ids, _user_turn_prefix, generate_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heldout_prompts import heldout_rows  # noqa: E402

DEFAULT_STARTS = [
    "",
    "Write a",
    "Compose a",
    "Imagine you are",
    "Describe",
    "Explain",
    "Draft",
    "Complete the following Python function so that its doctests pass:\n```python\n",
    "Complete this Python code:\n```python\n",
    "Write a Python function",
    "Solve this math problem step by step:",
]


def self_prompts(model, tok, start: str, n: int, seed: int) -> list[str]:
    """n user turns the target writes after `start` (temperature 1, top-p 0.95, as the data
    stage's defaults)."""
    head = _user_turn_prefix(tok, None)
    begin = list(tok.encode(start, add_special_tokens=False)) if start else []
    eos = _eos_ids(tok)
    new, _ = generate_batch(
        model,
        [head + begin] * n,
        max_new_tokens=96,
        eos_ids=eos,
        temperature=1.0,
        top_p=0.95,
        seed=seed,
    )
    eos_set = set(eos.tolist())
    return [tok.decode(begin + [t for t in ids if t not in eos_set]).strip() for ids in new]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="builtin:smollm2-135m-dflash")
    ap.add_argument("--starts", nargs="*", default=DEFAULT_STARTS)
    ap.add_argument("--per-start", type=int, default=6)
    ap.add_argument(
        "--heldout", type=int, default=6, help="evaluation prompts a category (0: none)"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()

    model, tok = load_target()
    drafter = load_drafter(args.drafter, model)
    groups: list[tuple[str, list[str]]] = []
    for i, start in enumerate(args.starts):
        groups.append(
            (f"self: {start!r}", self_prompts(model, tok, start, args.per_start, args.seed + i))
        )
    if args.heldout:  # the held-out split, as heldout_prompts.py takes it
        by_category: dict[str, list[str]] = {}
        for row in heldout_rows(args.heldout):
            by_category.setdefault(row["category"], []).append(row["turns"][0])
        groups += [(f"held-out {c}", prompts) for c, prompts in by_category.items()]

    table = []
    for name, prompts in groups:
        committed = rounds = 0
        taus = []
        for prompt in prompts:
            r = speculative_generate(
                model, tok, drafter, prompt, max_new_tokens=args.max_tokens, max_draft_tokens=None
            )
            committed += sum(r.accept_lengths)
            rounds += r.num_rounds
            taus.append(r.mean_accept_len)
        row = {
            "group": name,
            "prompts": len(prompts),
            "tau_pooled": committed / max(rounds, 1),
            "tau_median": statistics.median(taus),
            "example": prompts[0][:90],
        }
        table.append(row)
        print(
            f"{name:<70.70} n={row['prompts']:>2} τ pooled {row['tau_pooled']:.2f} "
            f"median {row['tau_median']:.2f}  e.g. {row['example']!r:.70}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"drafter": args.drafter, "args": vars(args), "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
