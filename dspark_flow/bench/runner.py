"""Run every mode on the same prompt ids, interleaved, and check outputs against greedy.

Interleaving (for each trial and prompt, each mode in turn, the order rotated per trial) spreads
drift in machine speed - thermal throttling, other processes - over all modes instead of
charging it to whichever ran last. Each mode makes one short warm-up generation first.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dspark_flow.bench.plan import GREEDY, Mode, TargetGroup
from dspark_flow.bench.prompts import BenchPrompt

WARMUP_TOKENS = 16


@dataclass
class BenchConfig:
    trials: int = 3
    warmup_trials: int = 0  # whole unrecorded passes first (first-use compilation on GPUs)
    max_tokens: int = 128
    warmup_tokens: int = WARMUP_TOKENS
    verify_cost: bool = True
    verify_context: int = 256
    verify_max_k: int = 16
    verify_repeats: int = 5


@dataclass
class Measured:
    token_ids: list[int]
    decode_tok_s: float
    e2e_tok_s: float
    ttft_s: float
    accept_lengths: list[int]
    finish_reason: str


def _mx() -> Any:
    import mlx.core as mx

    return mx


def reset_peak_memory() -> None:
    mx = _mx()
    fn = getattr(mx, "reset_peak_memory", None) or getattr(mx.metal, "reset_peak_memory", None)
    if fn is not None:
        fn()


def peak_memory_mb() -> float | None:
    mx = _mx()
    fn = getattr(mx, "get_peak_memory", None) or getattr(mx.metal, "get_peak_memory", None)
    return fn() / 2**20 if fn is not None else None


def _argmax(logprobs: Any) -> Any:
    return _mx().argmax(logprobs, axis=-1)


def _run_ours(mode: Mode, ids: list[int], max_tokens: int) -> Measured:
    assert mode.pipeline is not None
    r = mode.pipeline.generate(ids, max_new_tokens=max_tokens)
    return Measured(
        token_ids=list(r.token_ids),
        decode_tok_s=r.decode_tokens_per_sec,
        e2e_tok_s=r.tokens_per_sec,
        ttft_s=r.ttft_seconds,
        accept_lengths=list(r.accept_lengths),
        finish_reason=r.finish_reason,
    )


def mlx_lm_rounds(from_draft: list[bool]) -> list[int]:
    """Tokens per verify round of mlx-lm's speculative loop: each round yields its accepted
    draft tokens, then the target's own token (a round cut by the budget may lack it)."""
    rounds: list[int] = []
    run = 0
    for drafted in from_draft:
        run += 1
        if not drafted:
            rounds.append(run)
            run = 0
    if run:
        rounds.append(run)
    return rounds


def _run_mlx_lm(mode: Mode, group: TargetGroup, ids: list[int], max_tokens: int) -> Measured:
    from mlx_lm.generate import stream_generate

    mx = _mx()
    kwargs: dict[str, Any] = {"sampler": _argmax}
    if mode.kind == "mlx_lm_spec":
        kwargs.update(draft_model=mode.draft_model, num_draft_tokens=mode.num_draft_tokens)
    tokens: list[int] = []
    drafted: list[bool] = []
    finish = "length"
    t0 = time.perf_counter()
    t_first: float | None = None
    prompt = mx.array(ids, dtype=mx.uint32)
    for resp in stream_generate(group.model, group.tokenizer, prompt, max_tokens, **kwargs):
        if t_first is None:
            t_first = time.perf_counter()
        if resp.finish_reason == "stop":  # its token is the EOS, which our loop drops too
            finish = "stop"
            break
        tokens.append(int(resp.token))
        drafted.append(bool(resp.from_draft))
    t_end = time.perf_counter()
    t_first = t_first if t_first is not None else t_end
    n = len(tokens)
    rounds = mlx_lm_rounds(drafted) if mode.kind == "mlx_lm_spec" else [1] * max(n - 1, 0)
    return Measured(
        token_ids=tokens,
        decode_tok_s=(n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0,
        e2e_tok_s=n / (t_end - t0) if t_end > t0 else 0.0,
        ttft_s=t_first - t0,
        accept_lengths=rounds,
        finish_reason=finish,
    )


def measure(mode: Mode, group: TargetGroup, ids: list[int], max_tokens: int) -> Measured:
    if mode.kind == "ours":
        return _run_ours(mode, ids, max_tokens)
    return _run_mlx_lm(mode, group, ids, max_tokens)


def compare(expected: list[int], got: list[int], prefix_only: bool) -> int | None:
    """Index of the first differing token, or None when `got` matches (as a prefix when a text
    stop rule may have ended it early)."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    if len(got) == len(expected) or (prefix_only and len(got) < len(expected)):
        return None
    return min(len(got), len(expected))


def _mismatch(
    group: TargetGroup,
    mode: Mode,
    prompt: BenchPrompt,
    trial: int,
    at: int,
    exp: list[int],
    got: list[int],
) -> dict[str, Any]:
    tok = group.tokenizer
    lo = max(0, at - 8)
    return {
        "target": group.label,
        "mode": mode.name,
        "prompt_id": prompt.id,
        "trial": trial,
        "first_difference": at,
        "expected_tokens": len(exp),
        "got_tokens": len(got),
        "expected_ids": exp[lo : at + 8],
        "got_ids": got[lo : at + 8],
        "expected_text": tok.decode(exp[lo : at + 8]),
        "got_text": tok.decode(got[lo : at + 8]),
    }


def verify_cost_curve(group: TargetGroup, cfg: BenchConfig) -> list[dict[str, Any]]:
    """Time of one target forward (through the greedy pipeline's verifier) of K = 1..max_k new
    tokens after a fixed context: what speculation buys depends on how flat this is."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    mx = _mx()
    comps = group.encoder.warm_up().components
    assert comps is not None
    vocab = int(getattr(group.tokenizer, "vocab_size", 0) or 32000)
    ids = [(1000 + 7 * i) % vocab for i in range(cfg.verify_context + cfg.verify_max_k)]
    cache = make_prompt_cache(comps.model)
    mx.eval(comps.verifier.forward(comps.model, ids[: cfg.verify_context], cache))
    rows = []
    for k in range(1, cfg.verify_max_k + 1):
        block = ids[cfg.verify_context : cfg.verify_context + k]
        times = []
        for rep in range(cfg.verify_repeats + 1):  # the first is a warm-up for this shape
            t = time.perf_counter()
            mx.eval(comps.verifier.forward(comps.model, block, cache))
            if rep:
                times.append(time.perf_counter() - t)
            trim_prompt_cache(cache, k)
        rows.append(
            {
                "target": group.label,
                "weight_format": group.weight_format,
                "context": cfg.verify_context,
                "k": k,
                "median_ms": 1000 * statistics.median(times),
                "min_ms": 1000 * min(times),
            }
        )
    return rows


Progress = Callable[[str], None]


def run_bench(
    groups: list[TargetGroup],
    prompts: list[BenchPrompt],
    cfg: BenchConfig,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Measure every (target, mode) on every prompt `cfg.trials` times.

    Returns {"runs": [...], "mismatches": [...], "verify_cost": [...]}; `report` adds the meta
    and the summary.
    """
    say = progress or (lambda _line: None)
    ids = {(g.label, p.id): g.encoder.encode_prompt(p.text) for g in groups for p in prompts}
    pairs = [(g, m) for g in groups for m in g.modes]
    try:
        _warm_up(prompts, cfg, pairs, ids, say)
    except KeyboardInterrupt:
        # On a fresh GPU the warm-up (kernel compilation, probes) can outlast a caller's limit:
        # say that nothing was measured rather than a bare "interrupted".
        raise KeyboardInterrupt("while warming up, before any trial: nothing measured") from None

    runs: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    try:
        _trials(prompts, cfg, pairs, ids, runs, mismatches, say)
    except KeyboardInterrupt:
        # Ctrl-C: keep every prompt all modes finished (so the modes compare on the same
        # prompts), drop the one in progress, and let the caller report what was measured.
        finished = len(runs) - len(runs) % len(pairs)
        del runs[finished:]
        if not runs:
            raise KeyboardInterrupt(
                "before any prompt ran in every mode: nothing measured"
            ) from None
        say(f"interrupted: reporting the {finished // len(pairs)} prompt runs finished")
        return {"runs": runs, "mismatches": mismatches, "verify_cost": [], "interrupted": True}

    curves: list[dict[str, Any]] = []
    if cfg.verify_cost:
        for group in groups:
            say(f"verify cost curve for {group.label}")
            curves += verify_cost_curve(group, cfg)
    return {"runs": runs, "mismatches": mismatches, "verify_cost": curves}


def _warm_up(
    prompts: list[BenchPrompt],
    cfg: BenchConfig,
    pairs: list[tuple[TargetGroup, Mode]],
    ids: dict[tuple[str, str], list[int]],
    say: Progress,
) -> None:
    for group, mode in pairs:  # warm-up: compile kernels, allocate buffers, load drafters
        if mode.pipeline is not None:
            mode.pipeline.warm_up()
        measure(
            mode, group, ids[(group.label, prompts[0].id)], min(cfg.warmup_tokens, cfg.max_tokens)
        )
        say(f"warmed up {mode.name} on {group.label}")

    for _ in range(cfg.warmup_trials):  # the trials' own shapes, once, unrecorded
        for prompt in prompts:
            for group, mode in pairs:
                measure(mode, group, ids[(group.label, prompt.id)], cfg.max_tokens)
        say("warm-up pass done")


def _trials(
    prompts: list[BenchPrompt],
    cfg: BenchConfig,
    pairs: list[tuple[TargetGroup, Mode]],
    ids: dict[tuple[str, str], list[int]],
    runs: list[dict[str, Any]],
    mismatches: list[dict[str, Any]],
    say: Progress,
) -> None:
    """The timed trials of `run_bench`, appending to `runs` and `mismatches` as they go (one
    prompt's runs of every mode at a time)."""
    total, done = cfg.trials * len(prompts) * len(pairs), 0
    for trial in range(cfg.trials):
        shift = trial % len(pairs)
        order = pairs[shift:] + pairs[:shift]
        for prompt in prompts:
            outputs: dict[tuple[str, str], list[int]] = {}
            block: list[tuple[TargetGroup, Mode, dict[str, Any]]] = []
            for group, mode in order:
                prompt_ids = ids[(group.label, prompt.id)]
                reset_peak_memory()
                m = measure(mode, group, prompt_ids, cfg.max_tokens)
                peak = peak_memory_mb()
                outputs[(group.label, mode.name)] = m.token_ids
                rec = {
                    "target": group.label,
                    "mode": mode.name,
                    "kind": mode.kind,
                    "baseline": mode.baseline,
                    "category": prompt.category,
                    "prompt_id": prompt.id,
                    "trial": trial,
                    "prompt_tokens": len(prompt_ids),
                    "num_tokens": len(m.token_ids),
                    "decode_tok_s": m.decode_tok_s,
                    "e2e_tok_s": m.e2e_tok_s,
                    "ttft_s": m.ttft_s,
                    "mean_accept_len": (
                        sum(m.accept_lengths) / len(m.accept_lengths) if m.accept_lengths else 1.0
                    ),
                    "peak_memory_mb": peak,
                    "finish_reason": m.finish_reason,
                    "matches_greedy": None,
                    "accept_lengths": m.accept_lengths,
                }
                runs.append(rec)
                block.append((group, mode, rec))
                done += 1
                say(
                    f"[{done}/{total}] trial {trial + 1} {prompt.id:<12} {mode.name:<24} "
                    f"{m.decode_tok_s:7.1f} tok/s decode  tau={rec['mean_accept_len']:.2f}"
                )
            # The free losslessness check: at T=0 every mode must reproduce greedy's tokens.
            for group, mode, rec in block:
                if mode.name == GREEDY or not mode.greedy:
                    continue
                expected = outputs[(group.label, GREEDY)]
                got = outputs[(group.label, mode.name)]
                at = compare(expected, got, mode.prefix_only)
                rec["matches_greedy"] = at is None
                if at is not None:
                    mismatches.append(_mismatch(group, mode, prompt, trial, at, expected, got))
