"""Count the answer tokens of a training recipe's cached data (the target's own outputs).

The counts rank tokens for a drafter's draft vocabulary (the most frequent outputs first); the
train command's vocab stage writes the ranking itself, this keeps the raw counts.

    python benchmarks/token_counts.py RECIPE.yaml OUT.npy [--vocab-size 49152]
"""

from __future__ import annotations

import argparse

import numpy as np

import dspark_flow  # noqa: F401  (preloads OpenBLAS before mlx.core)
from dspark_flow.models.draft_vocab import count_answer_tokens
from dspark_flow.training.data import data_cache_dir, load_samples
from dspark_flow.training.recipe import load_train_recipe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="a training recipe whose data stage has run")
    p.add_argument("out", help="where to save the counts (.npy)")
    p.add_argument("--vocab-size", type=int, default=49152, help="the target's (SmolLM2: 49152)")
    args = p.parse_args(argv)
    samples = load_samples(data_cache_dir(load_train_recipe(args.recipe)))
    counts = count_answer_tokens(samples, args.vocab_size)
    np.save(args.out, counts)
    print(
        f"{len(samples)} samples, {int(counts.sum())} answer tokens, {int((counts > 0).sum())} distinct"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
