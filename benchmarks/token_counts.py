"""Count the answer tokens of a training recipe's cached data (the target's own outputs).

The counts rank tokens for a drafter's draft vocabulary (the most frequent outputs first).
Usage: python benchmarks/token_counts.py RECIPE.yaml OUT.npy
"""

from __future__ import annotations

import sys

import numpy as np

import dspark_flow  # noqa: F401  (preloads OpenBLAS before mlx.core)
from dspark_flow.training.data import data_cache_dir, load_samples
from dspark_flow.training.recipe import load_train_recipe


def main() -> None:
    recipe_path, out = sys.argv[1], sys.argv[2]
    recipe = load_train_recipe(recipe_path)
    samples = load_samples(data_cache_dir(recipe))
    answers = [s.tokens[s.prompt_len :] for s in samples]
    counts = np.bincount(np.concatenate(answers), minlength=49152).astype(np.int64)
    np.save(out, counts)
    print(
        f"{len(samples)} samples, {int(counts.sum())} answer tokens, {int((counts > 0).sum())} distinct"
    )


if __name__ == "__main__":
    main()
