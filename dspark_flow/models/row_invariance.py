"""Does a verify forward of K rows compute each row as a one-row forward does?

Speculation at temperature 0 reproduces greedy decoding token for token only where it does:
greedy decodes one row a forward, a verify holds K. `row_differences` measures it for any
verifier on a loaded target (benchmarks/row_invariance.py prints it; tests assert it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from dspark_flow.arrays import as_float, as_int


@dataclass(frozen=True)
class RowDifference:
    rows_differing: int  # rows of the K-row forward whose logits differ in any bit
    max_abs_diff: float  # the largest absolute logit difference among them


def synthetic_tokens(count: int, salt: int = 0) -> list[int]:
    """Deterministic token ids in the embedded vocabulary's ordinary range (no special ids)."""
    return [((17 + 14 * salt) * i + 3 + salt) % 4000 + 100 for i in range(count)]


def row_differences(
    verifier: Any, model: Any, context: list[int], rows: list[int], ks: Iterable[int]
) -> dict[int, RowDifference]:
    """After `context`, the logits of one-row forwards over `rows` (what greedy sees), then for
    each K in `ks` one forward of the first K rows (the cache trimmed back every time)."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(verifier.forward(model, context, cache))
    one = []
    for token in rows:
        logits = verifier.forward(model, [token], cache)
        mx.eval(logits)
        one.append(logits[-1])
    trim_prompt_cache(cache, len(rows))
    out = {}
    for k in ks:
        logits = verifier.forward(model, rows[:k], cache)
        mx.eval(logits)
        trim_prompt_cache(cache, k)
        differ = sum(int(not as_int(mx.array_equal(logits[i], one[i]))) for i in range(k))
        worst = max(as_float(mx.abs(logits[i] - one[i]).max()) for i in range(k))
        out[k] = RowDifference(differ, worst)
    return out
