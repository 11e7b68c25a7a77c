"""Speculative sampling is exact: committed tokens are distributed as the target's p.

Each test draws many samples and runs a chi-square goodness-of-fit test against the exact
distribution. ALPHA is the false-alarm rate per test for a correct implementation (the seeds are
fixed, so a run is reproducible); with the handful of tests here the suite-wide rate stays < 1e-3.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from dspark_flow.strategies.samplers.sample import SampleConfig, SpeculativeSampler, processed_probs
from dspark_flow.strategy import Draft, Sampler

ALPHA = 1e-4


def fit_ok(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of a chi-square test, pooling cells with small expected counts."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert obs.sum() == n
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


P = np.array(
    [
        [0.50, 0.25, 0.15, 0.10, 0.00],
        [0.05, 0.05, 0.30, 0.30, 0.30],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ],
    dtype=np.float32,
)
Q_CASES = {
    "q_equals_p": P[:2],
    "q_bad": np.array([[0.0, 0.0, 0.0, 0.1, 0.9], [0.9, 0.1, 0.0, 0.0, 0.0]], np.float32),
    "q_uniform": np.full((2, 5), 0.2, np.float32),
    "one_hot_no_q": None,
}


@pytest.mark.parametrize("case", list(Q_CASES))
def test_verify_rule_reproduces_target_distribution(case):
    q = Q_CASES[case]
    sampler = SpeculativeSampler(SampleConfig(temperature=1.0, seed=1234))
    sampler.begin()
    rng = np.random.default_rng(7)
    logits = mx.log(mx.array(P))
    first = np.zeros(5, np.int64)
    second = np.zeros(5, np.int64)  # the second committed token, when the first draft was accepted
    n = 3000
    for _ in range(n):
        if q is None:
            tokens = [int(rng.choice(5, p=[0.1, 0.1, 0.1, 0.6, 0.1])), int(rng.integers(5))]
            draft = Draft(tokens=tokens)
        else:
            tokens = [int(rng.choice(5, p=q[i] / q[i].sum())) for i in range(2)]
            draft = Draft(tokens=tokens, probs=mx.array(q))
        accepted, nxt = sampler.verify(logits, draft)
        committed = [*tokens[:accepted], nxt]
        first[committed[0]] += 1
        if accepted >= 1:
            second[committed[1]] += 1
    assert fit_ok(first, P[0]) > ALPHA
    if second.sum() > 200:
        assert fit_ok(second, P[1]) > ALPHA
    if case == "q_equals_p":
        assert second.sum() == n  # p == q: every first draft is accepted


def test_processed_probs_truncation():
    logits = mx.log(mx.array([[0.4, 0.3, 0.2, 0.1]]))
    top_k = np.array(processed_probs(logits, 1.0, 1.0, 2, 0.0))[0]
    assert np.allclose(top_k, [4 / 7, 3 / 7, 0, 0], atol=1e-6)
    top_p = np.array(processed_probs(logits, 1.0, 0.65, 0, 0.0))[0]
    assert np.allclose(top_p, [0.4 / 0.7, 0.3 / 0.7, 0, 0], atol=1e-6)  # 0.4 < 0.65, 0.7 crosses
    min_p = np.array(processed_probs(logits, 1.0, 1.0, 0, 0.6))[0]
    assert np.allclose(min_p, [0.4 / 0.7, 0.3 / 0.7, 0, 0], atol=1e-6)
    hot = np.array(processed_probs(logits, 0.5, 1.0, 0, 0.0))[0]
    assert np.allclose(hot, np.array([0.16, 0.09, 0.04, 0.01]) / 0.30, atol=1e-6)


class _PluginSampler(Sampler):
    """A third-party sampler with only what a sampler must define: no `sample_from` of its own."""

    Config = SampleConfig

    @property
    def greedy(self) -> bool:
        return False

    def probs(self, logits: mx.array) -> mx.array:
        return mx.softmax(logits.astype(mx.float32), axis=-1)

    def sample(self, logits: mx.array) -> mx.array:
        return mx.random.categorical(logits)


def test_base_sample_from_draws_from_the_given_distribution():
    sampler = _PluginSampler(SampleConfig(temperature=1.0))
    mx.random.seed(11)
    probs = mx.array(P[0])
    draws = np.array([sampler.sample_from(probs).item() for _ in range(3000)])
    assert fit_ok(np.bincount(draws, minlength=5), P[0]) > ALPHA


def test_draft_model_drafts_through_a_sampler_without_sample_from():
    """The draft-model drafter used to call `sample_from` as if every sampler had one."""
    from dspark_flow.strategies.drafters.draft_model import DraftModelConfig, DraftModelDrafter
    from tests.tiny import tiny_model

    drafter = DraftModelDrafter(DraftModelConfig(model="<tiny>"), model=tiny_model())
    sampler = _PluginSampler(SampleConfig(temperature=1.0))
    drafter.begin([1, 2, 3, 4], sampler)
    draft = drafter.propose([1, 2, 3, 4], 3)
    assert len(draft.tokens) == 3 and draft.probs is not None
    assert draft.probs.shape[0] == 3
    # Each drafted token is one the drafter's own distribution gives weight to.
    for i, token in enumerate(draft.tokens):
        assert draft.probs[i, token].item() > 0


@pytest.mark.parametrize("extra", [8, -8])
def test_a_draft_model_of_another_width_drafts_over_the_target_s_ids(embedded, extra):
    """Same tokenizer, embeddings padded differently: q had the draft's width and the verify's
    p - q failed to broadcast at any temperature > 0."""
    from dspark_flow.api import draft_model_generate, greedy_generate
    from tests.tiny import VOCAB, tiny_model

    target, tok = tiny_model(seed=0), embedded[1]
    draft = tiny_model(seed=5, vocab=VOCAB + extra)
    res = draft_model_generate(
        target, tok, draft, [1, 504, 2031], max_new_tokens=6, temperature=1.0, seed=3
    )
    assert res.num_tokens == 6 and res.num_rounds < 6  # drafts were proposed and verified
    plain = greedy_generate(target, tok, [1, 504, 2031], max_new_tokens=6)
    assert (
        draft_model_generate(target, tok, draft, [1, 504, 2031], max_new_tokens=6).token_ids
        == plain.token_ids
    )


def test_processed_probs_stay_a_distribution_where_settings_round_to_zero():
    logits = mx.array([[1.0, 3.0, 2.0, -1.0], [0.5, 0.1, -2.0, 7.0]])
    for probs in (
        processed_probs(logits, 1e-300, 1.0, 0, 0.0),  # temperature 0 in float32
        processed_probs(logits, 1e-40, 1.0, 0, 0.0),  # below float32's smallest normal
        processed_probs(logits, 1.0, 1e-300, 0, 0.0),  # top_p 0 in float32
    ):
        assert np.array(probs).tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
