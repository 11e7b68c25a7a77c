"""Measure what one speculative round costs on this machine.

Two curves decide the best draft length: the target's verify cost for K rows (K = k + 1: the
last committed token plus k drafted ones) at a few context depths, and the drafter's cost to
propose k tokens. Each point is the median of several timed repeats after warm-up runs, and the
K values are visited in interleaved passes so a burst of machine noise hits all of them alike.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from dspark_flow.engine.decode import PREFILL_CHUNK
from dspark_flow.models.context import context_limit
from dspark_flow.strategy import Drafter

DEFAULT_DEPTHS: tuple[int, ...] = (64, 512, 2048)

Forward = Callable[[Any, list[int], list[Any]], Any]


@dataclass
class Curves:
    """Measured costs, in seconds.

    `verify[i][K - 1]` is one verify round of K rows at context depth `depths[i]` (forward, the
    argmax host sync, the cache trim); `drafter[k]` is one `propose(history, k)`, `drafter[0]` 0
    (for a drafter that reads the target, with one new committed row to take in, as in the loop).
    """

    depths: list[int]
    verify: list[list[float]]
    drafter: list[float]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.depths or len(self.verify) != len(self.depths):
            raise ValueError("one verify row per depth is needed")
        if sorted(self.depths) != list(self.depths) or len(set(self.depths)) != len(self.depths):
            raise ValueError("depths must be strictly ascending")
        rows = {len(r) for r in self.verify}
        if len(rows) != 1 or rows.pop() < 1 or not self.drafter:
            raise ValueError("verify rows must share one length >= 1; drafter must be non-empty")
        if any(t < 0 for r in self.verify for t in r) or any(t < 0 for t in self.drafter):
            raise ValueError("costs must be non-negative")
        # A forward never takes no time, and nan or inf would make every plan nan or inf (a
        # damaged cache file that silently turned speculation off, as an audit found).
        if not all(math.isfinite(t) and t > 0 for r in self.verify for t in r):
            raise ValueError("verify costs must be finite and positive")
        if not all(math.isfinite(t) for t in self.drafter):
            raise ValueError("drafter costs must be finite")
        # Decisions use a non-decreasing fit of each row: verifying more rows never costs less,
        # so a dip is measurement noise, and chasing it would pick k by luck.
        self._smooth = [monotone_fit(row) for row in self.verify]

    @property
    def block(self) -> int:
        """The largest k both curves cover."""
        return min(len(self.verify[0]) - 1, len(self.drafter) - 1)

    def verify_cost(self, rows: int, depth: float) -> float:
        """Cost of verifying `rows` rows at `depth`: linear between measured depths; beyond the
        deepest, extrapolated along the last segment (attention grows linearly with depth), never
        below the deepest measurement."""
        return self.verify_costs(rows, depth, first=rows)[0]

    def verify_costs(self, max_rows: int, depth: float, first: int = 1) -> list[float]:
        """`verify_cost(rows, depth)` for rows = first..max_rows, the depth's interpolation
        found once (the controller asks for a whole row every round)."""
        width = len(self.verify[0])
        cols = [min(max(n, 1), width) - 1 for n in range(first, max_rows + 1)]
        ds, rows = self.depths, self._smooth
        if len(ds) == 1 or depth <= ds[0]:
            return [rows[0][c] for c in cols]
        for i in range(1, len(ds)):
            if depth <= ds[i]:
                w = (depth - ds[i - 1]) / (ds[i] - ds[i - 1])
                lo, hi = rows[i - 1], rows[i]
                return [lo[c] + w * (hi[c] - lo[c]) for c in cols]
        w = (depth - ds[-1]) / (ds[-1] - ds[-2])  # along the last segment, never below its end
        lo, hi = rows[-2], rows[-1]
        return [max(hi[c], hi[c] + w * (hi[c] - lo[c])) for c in cols]

    def drafter_cost(self, k: int) -> float:
        return 0.0 if k <= 0 else self.drafter[min(k, len(self.drafter) - 1)]

    def round_cost(self, drafted: int, depth: float, drafter_pass: bool = True) -> float:
        """What one round that drafted `drafted` tokens costs at `depth`: their verify (plus
        the last committed token's row) and proposing them (nothing when none were, or when
        they were copied: `drafter_pass=False`)."""
        verify = self.verify_cost(drafted + 1, depth)
        return verify + self.drafter_cost(drafted) if drafter_pass else verify

    def to_dict(self) -> dict[str, Any]:
        return {
            "depths": self.depths,
            "verify": self.verify,
            "drafter": self.drafter,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Curves:
        """Raises ValueError/TypeError/KeyError on anything malformed (the store then
        re-measures)."""
        return cls(
            depths=[int(d) for d in data["depths"]],
            verify=[[float(t) for t in row] for row in data["verify"]],
            drafter=[float(t) for t in data["drafter"]],
            meta=dict(data.get("meta") or {}),
        )


def monotone_fit(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


# -- inputs ------------------------------------------------------------------------------------


def usable_depths(depths: Sequence[int], rows: int, limit: int | None) -> list[int]:
    """The requested depths that fit the context with `rows` more tokens (at least one depth)."""
    wanted = sorted({max(1, int(d)) for d in depths}) or [64]
    if limit is None:
        return wanted
    fit = [d for d in wanted if d + rows <= limit]
    return fit or [max(1, min(wanted[0], limit - rows))]


def filler_tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    """Deterministic pseudo-random ids away from the special tokens at the start of a vocabulary."""
    lo = min(100, vocab // 2)
    state = seed * 2654435761 + 1
    out: list[int] = []
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(lo + (state >> 33) % (vocab - lo))
    return out


def sample_history(tokenizer: Any, n: int = 256) -> list[int]:
    """A real token history for timing drafters: the bundled prompts, with a repeated span so a
    lookup drafter finds a match (its cost is highest when it has something to copy)."""
    lines = resources.files("dspark_flow").joinpath("data/prompts.jsonl").read_text("utf-8")
    text = "\n".join(" ".join(json.loads(ln)["turns"]) for ln in lines.splitlines() if ln.strip())
    ids = list(tokenizer.encode(text))[:n] if tokenizer is not None else []
    if len(ids) < 16:
        ids = filler_tokens(n, 32000, seed=1)
    return ids + ids[: min(32, len(ids) // 4)]


# -- measuring ---------------------------------------------------------------------------------


def _default_forward(model: Any, tokens: list[int], cache: list[Any]) -> Any:
    import mlx.core as mx

    return model(mx.array(tokens, dtype=mx.uint32)[None], cache=cache)[0]


def verify_at_fresh_lengths() -> bool:
    """Whether verify costs are timed at fresh key lengths here: on GPUs, whose stock kernels
    cache work per shape; the CPU caches nothing per shape (see `measure_verify`)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def measure_verify(
    model: Any,
    depths: Sequence[int],
    max_rows: int,
    *,
    repeats: int = 5,
    warmup: int = 2,
    forward: Forward | None = None,
    vocab: int | None = None,
    tick: Callable[[], object] | None = None,
) -> list[list[float]]:
    """Median seconds of one verify round for K = 1..max_rows rows at each depth.

    Every timed forward meets a key length it has not seen before, as in decoding: after each
    one the cache is trimmed back and advanced by one untimed token. Backends that cache work
    per shape (MLX's CUDA attention from 4 queries: cuDNN graphs, the composite's matmuls) pay
    that cost in decoding every step, and a curve measured at one repeated length would miss
    it. The context grows by (warmup + repeats) * max_rows tokens over a depth's measurement,
    so it starts half that below the depth. On the CPU, which caches nothing per shape, the
    untimed steps are skipped and each depth is measured at exactly that depth."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    forward = forward or _default_forward
    vocab = vocab or int(getattr(getattr(model, "args", None), "vocab_size", 0) or 32000)
    fresh_lengths = verify_at_fresh_lengths()
    out: list[list[float]] = []
    drift = (warmup + repeats) * max_rows if fresh_lengths else 0
    for i, depth in enumerate(depths):
        cache = make_prompt_cache(model)
        start_depth = max(1, depth - drift // 2)
        context = filler_tokens(start_depth, vocab, seed=i)
        for start in range(0, start_depth, PREFILL_CHUNK):
            forward(model, context[start : start + PREFILL_CHUNK], cache)
            mx.eval([entry.state for entry in cache])
        probe = filler_tokens(max_rows, vocab, seed=100 + i)
        times: list[list[float]] = [[] for _ in range(max_rows)]
        for r in range(warmup + repeats):
            for rows in range(1, max_rows + 1):
                t0 = time.perf_counter()
                logits = forward(model, probe[:rows], cache)
                mx.argmax(logits, axis=-1).tolist()  # the round's one host sync
                trim_prompt_cache(cache, rows)
                if r >= warmup:
                    times[rows - 1].append(time.perf_counter() - t0)
                if fresh_lengths:  # untimed: the next key length
                    mx.eval(forward(model, probe[:1], cache))
                if tick is not None:
                    tick()
        out.append([statistics.median(t) for t in times])
        del cache
    return out


def measure_drafter(
    drafter: Any,
    history: list[int],
    block: int,
    sampler: Any,
    *,
    model: Any = None,
    forward: Forward | None = None,
    repeats: int = 5,
    warmup: int = 1,
    tick: Callable[[], object] | None = None,
    grow_context: bool = True,
) -> list[float]:
    """Median seconds of `drafter.propose(history, k)` for k = 0..block (index k).

    With `model`, the history before the last token is first prefilled through the target and
    handed to `drafter.after_forward`, as the decode loop does: drafters that read the target's
    features (dspark, dflash) need it. Such a drafter then also meets, before each timed
    proposal, one new committed row to take into its context, as in a round whose drafts were
    all rejected: the loop's proposals pay that, and timing proposals on one unchanged history
    left it out (on the H200 DSpark's drafting rounds took 1.98-2.28x a plain step where the
    curves charged 1.78-1.80x; how much of that gap this is was not measured there,
    docs/benchmarks.md §3). `grow_context=False` times proposals on the unchanged history, as
    before (`benchmarks/drafter_context_cost.py` sets the two side by side).
    """
    import mlx.core as mx

    history = list(history)
    prompt = history[:-1]
    drafter.begin(prompt, sampler)
    grow: Callable[[], None] | None = None
    if model is not None:
        from mlx_lm.models.cache import make_prompt_cache

        forward = forward or _default_forward
        cache = make_prompt_cache(model)
        for start in range(0, len(prompt), PREFILL_CHUNK):
            chunk = prompt[start : start + PREFILL_CHUNK]
            forward(model, chunk, cache)
            if hasattr(drafter, "after_forward"):
                drafter.after_forward(len(chunk))
            mx.eval([entry.state for entry in cache])
        own = getattr(type(drafter), "after_forward", Drafter.after_forward)
        if grow_context and own is not Drafter.after_forward:  # it reads the target's features

            def take_one_row() -> None:  # untimed: the target forwards the anchor, committed
                mx.eval(forward(model, history[-1:], cache))
                drafter.after_forward(1)
                history.append(history[len(history) // 2])

            grow = take_one_row

    # A block drafter copying runs first would copy the history's repeated span: time its pass.
    propose = getattr(drafter, "propose_block", drafter.propose)
    times: list[list[float]] = [[] for _ in range(block + 1)]
    for r in range(warmup + repeats):
        for k in range(1, block + 1):
            if grow is not None:
                grow()
            t0 = time.perf_counter()
            draft = propose(list(history), k)
            if getattr(draft, "pending", None) is not None:
                draft.resolve()  # a greedy block drafter's ids come back lazily: wait for them
            if getattr(draft, "probs", None) is not None:
                mx.eval(draft.probs)
            if r >= warmup:
                times[k].append(time.perf_counter() - t0)
            if tick is not None:
                tick()
    return [0.0] + [statistics.median(t) for t in times[1:]]


def measure(
    model: Any,
    drafter: Any,
    sampler: Any,
    *,
    block: int,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    repeats: int = 5,
    warmup: int = 2,
    history: list[int] | None = None,
    forward: Forward | None = None,
) -> Curves:
    """Both curves for k = 1..block, with a progress bar on a terminal: a first run on a CPU
    measures for one to three minutes before it generates anything (cached afterwards)."""
    from tqdm.auto import tqdm

    rows = block + 1
    ds = usable_depths(depths, rows, context_limit(model))
    t0 = time.perf_counter()
    steps = (warmup + repeats) * (len(ds) * rows + block)
    with tqdm(total=steps, desc="measuring draft costs (once)", unit="forward", leave=False,
              disable=None) as bar:  # fmt: skip
        verify = measure_verify(
            model, ds, rows, repeats=repeats, warmup=warmup, forward=forward, tick=bar.update
        )
        history = history or filler_tokens(256, 32000, seed=1)
        draft = measure_drafter(
            drafter,
            history,
            block,
            sampler,
            model=model,
            forward=forward,
            repeats=repeats,
            warmup=warmup,
            tick=bar.update,
        )
    meta = {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(time.perf_counter() - t0, 3),
        "repeats": repeats,
        "warmup": warmup,
        "history_tokens": len(history),
    }
    return Curves(depths=ds, verify=verify, drafter=draft, meta=meta)
