"""End to end: speculative sampling through the whole loop gives the target's exact distribution.

Thousands of generations do not fit the CI budget on the embedded model, so these tests use a
tiny random llama (same vocabulary) as the target; the loop, samplers and drafters are the real
ones. The first three generated tokens (top_k=3, so 27 outcomes) are compared by chi-square
with the exact distribution, enumerated from the target. ALPHA is the false-alarm rate per test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import mlx.core as mx
import numpy as np
import pytest

from dspark_flow.pipeline import Pipeline
from dspark_flow.strategies.drafters.draft_model import DraftModelConfig, DraftModelDrafter
from dspark_flow.strategies.samplers.sample import SampleConfig, SpeculativeSampler, processed_probs
from dspark_flow.strategy import Draft, Drafter, StrategyConfig
from tests.test_sampling_exact import ALPHA, fit_ok
from tests.tiny import VOCAB, tiny_model

PROMPT = [1, 504, 2031, 77, 9000]
# For the flat target: its top-3 tokens after this prompt all occur earlier in it, so prompt
# lookup finds a run to copy in the first rounds (found by prepending what was missing).
LOOKUP_PROMPT = [9000, 15880, 33036, *PROMPT]
TOP_K = 3
N = 500


def next_probs(model, ids: list[int], temperature: float = 1.0, top_p: float = 1.0) -> np.ndarray:
    logits = model(mx.array(ids)[None])[0, -1]
    return np.array(processed_probs(logits[None], temperature, top_p, TOP_K, 0.0)[0])


def exact_three(
    model, prompt: list[int] = PROMPT, temperature: float = 1.0, top_p: float = 1.0
) -> dict[tuple[int, int, int], float]:
    out: dict[tuple[int, int, int], float] = {}
    p1 = next_probs(model, prompt, temperature, top_p)
    for t1 in np.flatnonzero(p1).tolist():
        p2 = next_probs(model, [*prompt, t1], temperature, top_p)
        for t2 in np.flatnonzero(p2).tolist():
            p3 = next_probs(model, [*prompt, t1, t2], temperature, top_p)
            for t3 in np.flatnonzero(p3).tolist():
                out[(int(t1), int(t2), int(t3))] = float(p1[t1] * p2[t2] * p3[t3])
    return out


class LeastLikelyConfig(StrategyConfig):
    kind: Literal["least_likely"] = "least_likely"


class LeastLikelyDrafter(Drafter):
    """Deliberately bad: always proposes the least likely of the target's top-k tokens
    (one-hot, no distribution)."""

    Config = LeastLikelyConfig

    def __init__(self, target):
        super().__init__()
        self.target = target

    @property
    def max_draft(self) -> int:
        return 2

    def propose(self, history: list[int], k: int) -> Draft:
        tokens: list[int] = []
        for _ in range(k):
            p = next_probs(self.target, history + tokens)
            support = np.flatnonzero(p)
            tokens.append(int(support[np.argmin(p[support])]))
        return Draft(tokens=tokens)


@pytest.fixture(scope="module")
def target_and_exact(embedded):
    target = tiny_model(seed=0)
    return (target, embedded[1]), exact_three(target)


def restricted_dspark(directory: Path, target, exact, dflash: bool = False, **options) -> Drafter:
    """A random-weight DSpark drafter (Markov and confidence heads), or DFlash one, for the tiny
    target whose draft vocabulary holds some of the target's likely tokens and misses others:
    its q is zero on tokens the target may say, and its drafts are drawn within the subset. (Few
    of its drafts are accepted, so this end-to-end check is weak against a q that is slightly
    off; the drafter tests check q itself: tests/test_drafters.py, draft vocabulary.)"""
    from dspark_flow.api import load_drafter
    from dspark_flow.models.draft_vocab import VOCAB_FILE
    from tests import drafter_helpers as h

    if dflash:
        cfg = h.zlab_config(32, VOCAB, 1, [0], block=4)
    else:
        cfg = h.deepspec_config(32, VOCAB, 1, [-1, 0], markov_rank=8, confidence=True)
    h.write_checkpoint(directory, cfg, h.random_tensors(cfg, seed=4))
    likely = sorted({t for outcome in exact for t in outcome[1:]})  # what drafts can match
    ids = [t for i, t in enumerate(likely) if i % 4]  # misses a quarter of them
    rest = np.setdiff1d(np.arange(VOCAB), ids)
    np.save(directory / VOCAB_FILE, np.concatenate([ids, rest]).astype(np.int32))
    return load_drafter(str(directory), target, draft_vocab=len(ids), **options)


@pytest.fixture(scope="module")
def flat_target_and_exact(embedded):
    """A target whose top-3 tokens all carry real mass (the default one says 9000 at p 0.9996)."""
    target = tiny_model(seed=0, scale=1.0)
    return (target, embedded[1]), exact_three(target)


# A cooler, nucleus-truncated sampler: the target's processed p and the draft's q both change.
TUNED = {"temperature": 0.7, "top_p": 0.9}


@pytest.mark.parametrize(
    "which",
    [
        "least_likely",
        "draft_model",
        "draft_model_tuned",
        "draft_model_narrower",
        "lookup",
        "dspark_draft_vocab",
        "dflash_draft_vocab",
        "dspark_prompt_lookup",
    ],
)
def test_three_token_distribution_is_exact(request, which, tmp_path):
    flat = which.startswith(("dspark", "dflash", "lookup")) or which == "draft_model_tuned"
    (target, tok), exact = request.getfixturevalue(
        "flat_target_and_exact" if flat else "target_and_exact"
    )
    prompt = PROMPT
    cap = {"kind": "fixed", "k": 2}
    settings = {"temperature": 1.0}
    if which == "least_likely":
        drafter: Drafter = LeastLikelyDrafter(target)
    elif which.startswith("draft_model"):
        # narrower: a family's small model with fewer padding rows (Qwen2.5-0.5B vs -7B)
        vocab = VOCAB - 8 if which == "draft_model_narrower" else VOCAB
        draft = tiny_model(seed=5, vocab=vocab)
        drafter = DraftModelDrafter(DraftModelConfig(model="<tiny>"), model=draft)
        if which == "draft_model_tuned":
            settings = TUNED
            exact = exact_three(target, prompt, **TUNED)
    elif which == "lookup":  # one-hot copies of the context (no distribution)
        from dspark_flow.strategies.drafters.lookup import LookupConfig, LookupDrafter

        prompt = LOOKUP_PROMPT
        exact = exact_three(target, prompt)
        drafter = LookupDrafter(LookupConfig(min_ngram=1, max_ngram=2, max_draft=2))
    elif which.endswith("_draft_vocab"):
        drafter = restricted_dspark(
            tmp_path / "d", target, exact, dflash=which.startswith("dflash")
        )
    else:  # one-hot copies in some rounds, the drafter's q in the others
        prompt = LOOKUP_PROMPT
        exact = exact_three(target, prompt)
        lookup = {"min_ngram": 1, "min_match": 2}
        drafter = restricted_dspark(tmp_path / "dspark", target, exact, prompt_lookup=lookup)
        passes = []
        own_pass = drafter.propose_block
        drafter.propose_block = lambda history, k: passes.append(k) or own_pass(history, k)
    recipe = {
        "drafter": {"kind": "none"},
        "draft_cap": cap,
        "stop": [{"kind": "max_tokens", "limit": 3}],
        "prompt": {"chat": False},
    }
    pipe = Pipeline.from_dict(recipe, target=(target, tok), drafter=drafter).warm_up()
    outcomes = sorted(exact)
    index = {o: i for i, o in enumerate(outcomes)}
    counts = np.zeros(len(outcomes), np.int64)
    drafted = accepted = 0
    for seed in range(N):
        sampler = {"kind": "sample", **settings, "top_k": TOP_K, "seed": seed}
        res = pipe.generate(prompt, sampler=sampler)
        counts[index[tuple(res.token_ids)]] += 1
        drafted += res.num_rounds
        accepted += sum(n - 1 for n in res.accept_lengths)
    assert drafted > 0
    if which.endswith("_draft_vocab") or which == "lookup":  # some drafts were accepted
        assert accepted > 0
    if which == "dspark_prompt_lookup":  # rounds of both kinds ran, and drafts were accepted
        assert 0 < len(passes) < drafted and accepted > 0
    probs = np.array([exact[o] for o in outcomes])
    assert abs(probs.sum() - 1) < 1e-4 and len(outcomes) > 3  # a distribution worth testing
    assert fit_ok(counts, probs / probs.sum()) > ALPHA


class AcceptAllSampler(SpeculativeSampler):
    """A classic losslessness bug: every draft is accepted."""

    def verify(self, logits, draft):
        _, bonus = super().verify(logits[len(draft.tokens) :], Draft())
        return len(draft.tokens), bonus


def test_the_check_catches_a_sampler_that_accepts_everything(target_and_exact):
    (target, tok), exact = target_and_exact
    outcomes = sorted(exact)
    counts = np.zeros(len(outcomes), np.int64)
    recipe = {
        "draft_cap": {"kind": "fixed", "k": 2},
        "prompt": {"chat": False},
        "stop": [{"kind": "max_tokens", "limit": 3}],
    }
    for seed in range(N // 5):
        sampler = AcceptAllSampler(SampleConfig(temperature=1.0, top_k=TOP_K, seed=seed))
        pipe = Pipeline.from_dict(
            recipe, target=(target, tok), drafter=LeastLikelyDrafter(target), sampler=sampler
        )
        res = pipe.generate(PROMPT)
        counts[outcomes.index(tuple(res.token_ids))] += 1
    probs = np.array([exact[o] for o in outcomes])
    assert fit_ok(counts, probs / probs.sum()) < ALPHA
