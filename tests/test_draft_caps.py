"""Draft caps that fit the machine: the curve cache, the choice formula, `auto`'s on/off logic,
and losslessness of `calibrated`/`auto` on the real embedded model.

Calibration here uses a tiny random model or few depths and repeats, and a temporary cache
directory (the store's own override, so the user's model cache is left where it is).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest

from dspark_flow.calibration import curves as curves_mod
from dspark_flow.calibration.controller import (
    PLAIN_RESAMPLE_EVERY,
    best_plan,
    expected_tokens,
    plan_table,
)
from dspark_flow.calibration.curves import Curves, monotone_fit
from dspark_flow.calibration.estimators import (
    AcceptanceEstimator,
    LengthEstimator,
    beta_quantile,
)
from dspark_flow.calibration.obtain import obtain_curves
from dspark_flow.calibration.store import ENV_DIR, VERSION, CurveStore, calibration_dir
from dspark_flow.strategies.draft_caps.auto import AutoCap, AutoCapConfig
from dspark_flow.strategies.draft_caps.calibrated import CalibratedCap, CalibratedCapConfig
from dspark_flow.strategies.drafters.lookup import LookupConfig, LookupDrafter
from dspark_flow.strategy import COPY_SOURCE, DRAFTER_SOURCE
from tests.tiny import tiny_model

FAST = {"depths": [8, 24], "repeats": 1, "warmup": 0}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=3)


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of the two measuring functions."""
    calls = {"verify": 0, "drafter": 0}
    real_verify, real_drafter = curves_mod.measure_verify, curves_mod.measure_drafter

    def verify(*a, **kw):
        calls["verify"] += 1
        return real_verify(*a, **kw)

    def drafter(*a, **kw):
        calls["drafter"] += 1
        return real_drafter(*a, **kw)

    monkeypatch.setattr(curves_mod, "measure_verify", verify)
    monkeypatch.setattr(curves_mod, "measure_drafter", drafter)
    return calls


def lookup(max_draft: int = 4) -> LookupDrafter:
    return LookupDrafter(LookupConfig(max_draft=max_draft))


# -- the cache ---------------------------------------------------------------------------------


def test_curves_are_cached_and_reused(tiny, tmp_path, counted):
    store = CurveStore(tmp_path)
    first, path, measured = obtain_curves(tiny, lookup(), store=store, **FAST)
    assert measured and path.is_file() and path.parent == tmp_path
    assert counted == {"verify": 1, "drafter": 1}
    assert first.block == 4 and len(first.verify) == 2 and len(first.verify[0]) == 5
    data = json.loads(path.read_text())
    assert data["version"] == VERSION and data["key"]["weights"] == "float32"
    assert {"target", "drafter", "machine", "settings"} <= set(data["key"])
    assert data["key"]["machine"]["mlx"] and data["key"]["machine"]["backend"] == "cpu"

    again, path2, measured2 = obtain_curves(tiny, lookup(), store=store, **FAST)
    assert not measured2 and path2 == path and counted == {"verify": 1, "drafter": 1}
    assert again.verify == first.verify and again.drafter == first.drafter
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp files left behind


def test_a_changed_key_measures_again(tiny, tmp_path, counted):
    store = CurveStore(tmp_path)
    _, base, _ = obtain_curves(tiny, lookup(), store=store, **FAST)
    _, other_drafter, m1 = obtain_curves(tiny, lookup(max_draft=3), store=store, **FAST)
    _, other_depths, m2 = obtain_curves(tiny, lookup(), store=store, **{**FAST, "depths": [8]})
    _, other_ref, m3 = obtain_curves(tiny, lookup(), store=store, target_ref="acme/x", **FAST)
    assert m1 and m2 and m3 and counted["verify"] == 4
    assert len({base, other_drafter, other_depths, other_ref}) == 4
    _, forced, m4 = obtain_curves(tiny, lookup(), store=store, force=True, **FAST)
    assert m4 and forced == base and counted["verify"] == 5


def test_a_changed_weight_format_changes_the_key(tiny, tmp_path):
    import mlx.core as mx

    from dspark_flow.calibration.store import make_key

    half = tiny_model(seed=3)
    half.set_dtype(mx.bfloat16)
    k32, k16 = make_key(tiny, lookup()), make_key(half, lookup())
    assert k32["weights"] == "float32" and k16["weights"] == "bfloat16"
    assert CurveStore(tmp_path).path_for(k32) != CurveStore(tmp_path).path_for(k16)


def test_a_shipped_drafter_is_identified_by_its_files():
    # A retrained drafter shipped under the same name must not reuse the old one's curves.
    from dspark_flow.calibration.store import checkpoint_identity

    ident = checkpoint_identity("builtin:smollm2-135m-dspark")
    assert ident["config_sha256"] and ident["weight_sizes"]["model.safetensors"] > 0


def test_the_key_ignores_what_changes_between_runs_of_one_device(tiny, monkeypatch):
    """CUDA's device_info carries the free memory (and the card's uuid and bus id): the key must
    not, or every process measures its curves again; the kind of device still keys them."""
    import mlx.core as mx

    from dspark_flow.calibration.store import make_key

    card = {"device_name": "NVIDIA H200", "total_memory": 150754820096, "architecture": "sm_90"}
    runs = [
        {**card, "free_memory": 149312045056, "uuid": "GPU-5a3f", "pci_bus_id": "0000:00:06.0"},
        {**card, "free_memory": 149312110592, "uuid": "GPU-11fd", "pci_bus_id": "0000:00:07.0"},
        {**card, "device_name": "NVIDIA H100", "free_memory": 1, "uuid": "x", "pci_bus_id": "y"},
    ]
    keys = []
    for info in runs:
        monkeypatch.setattr(mx, "device_info", lambda info=info: dict(info))
        keys.append(make_key(tiny, lookup()))
    assert keys[0] == keys[1] and keys[0]["machine"]["device"] == card
    assert keys[2] != keys[0]


def test_the_key_holds_the_sampler_kind_and_the_threads_blas_may_use(tiny, monkeypatch):
    """A drawing sampler makes the drafter compute distributions (top-p also sorts them), and
    the CPU's verify cost scales with BLAS's threads: curves of one must not serve the other.
    A seed or a temperature changes no cost."""
    from dspark_flow.calibration.obtain import sampler_identity
    from dspark_flow.calibration.store import make_key
    from dspark_flow.strategies.samplers.greedy import GreedySampler
    from dspark_flow.strategies.samplers.sample import SampleConfig, SpeculativeSampler

    def sample(**kw):  # noqa: ANN003, ANN202
        return sampler_identity(SpeculativeSampler(SampleConfig(**kw)))

    assert sampler_identity(GreedySampler()) == "greedy" == sample(temperature=0.0)
    assert sample(temperature=0.7, seed=1) == sample(temperature=1.0, seed=2) != "greedy"
    assert sample(top_p=0.9) != sample()
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    unset = make_key(tiny, lookup())
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert make_key(tiny, lookup())["machine"] != unset["machine"]


def test_a_cache_file_too_deep_or_with_infinite_depths_is_replaced(tiny, tmp_path, counted):
    store = CurveStore(tmp_path)
    _, path, _ = obtain_curves(tiny, lookup(), store=store, **FAST)
    good = json.loads(path.read_text())
    for content in (
        "[" * 100_000 + "]" * 100_000,  # json.loads raises RecursionError
        json.dumps({**good, "curves": {**good["curves"], "depths": [float("inf"), 24]}}),
    ):
        path.write_text(content)
        _, _, measured = obtain_curves(tiny, lookup(), store=store, **FAST)
        assert measured


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"version": VERSION - 1 if VERSION > 1 else 999, "key": {}, "curves": {}}),
        "PLACEHOLDER_WRONG_SHAPE",
        "PLACEHOLDER_ZERO",
        "PLACEHOLDER_INF",
        "PLACEHOLDER_SHORT",
    ],
    ids=["corrupt", "wrong-version", "malformed-curves", "zero-cost", "infinite-cost", "short"],
)
def test_an_unusable_cache_file_is_replaced_not_fatal(
    tiny, tmp_path, counted, content, caplog, monkeypatch
):
    store = CurveStore(tmp_path)
    _, path, _ = obtain_curves(tiny, lookup(), store=store, **FAST)
    if content == "PLACEHOLDER_WRONG_SHAPE":
        data = json.loads(path.read_text())
        data["curves"]["verify"] = [[1.0, 2.0]]  # one row for two depths
        content = json.dumps(data)
    elif content == "PLACEHOLDER_SHORT":  # consistent, but k = 0 only: it would never draft
        data = json.loads(path.read_text())
        data["curves"]["verify"] = [row[:1] for row in data["curves"]["verify"]]
        content = json.dumps(data)
    elif content.startswith("PLACEHOLDER_"):  # a cost no measurement gives
        data = json.loads(path.read_text())
        data["curves"]["verify"][0][0] = 0.0 if content.endswith("ZERO") else float("inf")
        content = json.dumps(data)
    path.write_text(content)
    caplog.clear()
    # (a CLI test run before this one configured logging, which stops propagation to caplog)
    monkeypatch.setattr(logging.getLogger("dspark_flow"), "propagate", True)
    with caplog.at_level(logging.DEBUG, logger="dspark_flow"):
        curves, path2, measured = obtain_curves(tiny, lookup(), store=store, **FAST)
    assert measured and path2 == path and counted["verify"] == 2
    # said once, though the store looks again once it holds the measuring lock
    said = [r for r in caplog.records if "re-measuring" in r.getMessage()]
    assert [r.levelno > logging.DEBUG for r in said] == [True, False], said
    assert json.loads(path.read_text())["curves"]["verify"] == curves.verify


def test_two_processes_wanting_one_key_measure_it_once(tmp_path):
    """The second waits for the first's curves instead of timing its load alongside it."""
    import threading
    import time

    store, key = CurveStore(tmp_path), {"settings": {"block": 2}, "model": "x"}
    made = []

    def measure() -> Curves:
        made.append(1)
        time.sleep(0.3)
        return synthetic(lambda K: 1.0, block=2)

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(store.get(key, measure))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and sorted(measured for _, measured, _ in results) == [False, True]
    assert results[0][0].verify == results[1][0].verify


def test_an_unwritable_cache_dir_is_not_fatal(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    curves, path, measured = obtain_curves(
        tiny, lookup(), store=CurveStore(blocker / "sub"), **FAST
    )
    # No path: `calibrate` used to print the path it had failed to write as where they were.
    assert measured and curves.block == 4 and path is None


def test_the_store_has_its_own_directory_override(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_FLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(ENV_DIR, raising=False)
    assert calibration_dir() == tmp_path / "home" / "calibration"
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "cal"))
    assert calibration_dir() == tmp_path / "cal" and CurveStore().root == tmp_path / "cal"


# -- the formula -------------------------------------------------------------------------------


def synthetic(verify_of_rows, block: int = 16, depths=(64,), drafter: float = 0.0) -> Curves:
    rows = [[float(verify_of_rows(k)) for k in range(1, block + 2)] for _ in depths]
    return Curves(depths=list(depths), verify=rows, drafter=[0.0] + [drafter] * block)


def test_a_cap_calibrated_for_another_drafter_says_so(tiny, monkeypatch):
    from types import SimpleNamespace

    from dspark_flow.calibration import controller
    from dspark_flow.calibration.store import drafter_identity
    from dspark_flow.strategy import BuildContext

    warnings = []
    monkeypatch.setattr(
        controller, "log", SimpleNamespace(warning=lambda *a, **kw: warnings.append(kw))
    )
    for used_with, warned in ((lookup(4), False), (lookup(7), True)):
        cap = AutoCap(AutoCapConfig(), curves=synthetic(lambda K: 1.0, block=7))
        cap.calibrated_for = drafter_identity(lookup(4))  # as calibrate() records it
        cap.warm_up(BuildContext(model=tiny, tokenizer=None, recipe=None, drafter=used_with))
        assert bool(warnings) == warned  # it used to take another drafter's curves silently
    assert warnings[0]["calibrated_for"] == "lookup"
    # One drafter however its checkpoint was named; other files are another drafter.
    auto = {"kind": "dspark", "config": {"kind": "dspark", "checkpoint": "auto", "block": 7}}
    named = {**auto, "config": {**auto["config"], "checkpoint": "builtin:x"}, "checkpoint": "f1"}
    assert controller._same_drafter(auto, named)
    assert not controller._same_drafter({**named, "checkpoint": "f2"}, named)
    assert not controller._same_drafter(auto, {**auto, "config": {**auto["config"], "block": 4}})


def geometric_rounds(
    cap, rng, accept: float, rounds: int, max_k: int, plain_charge: float | None = None
) -> list[tuple[int, int]]:
    """`rounds` rounds of a drafter whose every drafted position is accepted with `accept`:
    (k chosen, tokens accepted) per round, each observed by `cap`: untimed, or with
    `plain_charge` as taking what the cap's curves charge (a plain step that times as much)."""
    out = []
    for _ in range(rounds):
        k = cap.choose(max_k)
        got = 0
        while got < k and rng.random() < accept:
            got += 1
        seconds = 0.0
        if plain_charge is not None:
            seconds = cap.curves.round_cost(k, cap.depth) * (plain_charge if k == 0 else 1.0)
        cap.observe(k, got, seconds)
        out.append((k, got))
    return out


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 3, p_first=0.2) == pytest.approx(1 + 0.2 * (1 + 0.5 + 0.25))


@pytest.mark.parametrize(
    ("name", "cost", "p", "k"),
    [
        # Flat (bf16 on a big GPU): every extra row is free, E grows with k -> the whole block.
        ("flat", lambda K: 1.0, 0.9, 16),
        # Linear (4-bit on the MLX CPU): E(p, k) / (k + 1) falls with k for any p < 1.
        ("linear", lambda K: K, 0.5, 1),
        ("linear", lambda K: K, 0.95, 1),
        # Affine 1 + 0.25 (K - 1): E / (1 + 0.25 k) at p = 0.5 is 1.2, 1.167, ... -> 1;
        # at p = 0.8: 1.44, 1.627, 1.687, 1.681 -> 3;
        # at p = 0.95 the maximum is k = 9 (2.4693) but k = 8 (2.4650) is within the 0.5%
        # tolerance, so the shorter draft wins -> 8.
        ("affine", lambda K: 1 + 0.25 * (K - 1), 0.5, 1),
        ("affine", lambda K: 1 + 0.25 * (K - 1), 0.8, 3),
        ("affine", lambda K: 1 + 0.25 * (K - 1), 0.95, 8),
        # A step at K = 4 (4-bit on an H200): k = 3 (E = 2.533 at cost 1) beats k = 4 (2.77 / 2).
        ("step", lambda K: 1.0 if K <= 4 else 2.0, 0.7, 3),
    ],
)
def test_the_choice_follows_the_formula(name, cost, p, k):
    plan = best_plan(synthetic(cost), p, depth=64, max_k=16)
    assert plan.k == k, name
    cap = CalibratedCap(CalibratedCapConfig(acceptance=p), curves=synthetic(cost))
    assert cap.choose(None) == k and cap.choose(2) == min(k, 2)


def test_a_switch_margin_keeps_the_previous_k_while_it_is_nearly_as_good():
    # Affine curve at p = 0.8: k = 3 is best (1.687), k = 4 within 0.5% (1.681), k = 2 3.5%
    # behind (1.627), k = 1 15% behind (1.44).
    curves = synthetic(lambda K: 1 + 0.25 * (K - 1))
    assert best_plan(curves, 0.8, 64, 16).k == 3
    assert best_plan(curves, 0.8, 64, 16, keep=2, margin=0.05).k == 2
    assert best_plan(curves, 0.8, 64, 16, keep=1, margin=0.05).k == 3  # too far behind
    assert best_plan(curves, 0.8, 64, 16, keep=2, margin=0.0).k == 3  # no margin: the best
    # never kept where that would turn drafting off although the best k pays
    assert best_plan(curves, 0.8, 64, 16, keep=2, margin=0.05, keep_floor=1.65).k == 3
    sticky = AutoCap(AutoCapConfig(acceptance=0.8, switch_margin=0.05), curves=curves)
    plain = AutoCap(AutoCapConfig(acceptance=0.8), curves=curves)
    rng = random.Random(1)
    switches = []
    for cap in (plain, sticky):
        ks = [k for k, _ in geometric_rounds(cap, rng, 0.8, 400, 16)]
        switches.append(sum(a != b for a, b in zip(ks, ks[1:])))
    assert switches[1] < switches[0]


def test_the_choice_uses_the_verify_cost_at_the_current_depth():
    # Shallow: flat (draft the block); deep: linear (draft 1); in between, interpolated.
    curves = Curves(
        depths=[100, 1000],
        verify=[[1.0] * 9, [float(K) for K in range(1, 10)]],
        drafter=[0.0] * 9,
    )
    assert curves.verify_cost(3, 550) == pytest.approx(2.0)
    assert curves.verify_cost(3, 5000) >= 3.0  # extrapolated, never below the deepest point
    cap = CalibratedCap(CalibratedCapConfig(acceptance=0.8), curves=curves)
    cap.begin(list(range(50)))
    assert cap.choose(None) == 8
    cap.begin(list(range(2000)))
    assert cap.choose(None) == 1


def test_a_noisy_dip_is_smoothed_out():
    assert monotone_fit([1.0, 1.2, 1.1, 1.5]) == pytest.approx([1.0, 1.15, 1.15, 1.5])
    dip = [1.0, 1.1, 1.2, 1.3, 0.5, 1.5]  # K = 5 "half the cost of one token": noise
    curves = Curves(depths=[64], verify=[dip], drafter=[0.0] * 6)
    costs = [curves.verify_cost(K, 64) for K in range(1, 7)]
    assert costs == sorted(costs) and curves.verify[0] == dip  # decisions smoothed, data raw
    # Without the fit, k = 4 would promise 1.9375 / 0.5 = 3.9x plain decoding.
    assert best_plan(curves, 0.5, 64, 5).gain < 2.0


def test_the_estimator_handles_truncated_runs():
    """Rounds drafting 4 tokens with true per-position acceptance 0.7: counting fully accepted
    rounds as censored recovers 0.7, where accepted/proposed would say ~0.5."""
    rng = random.Random(0)
    est = AcceptanceEstimator(prior=0.5, prior_weight=1.0, window=10_000)
    naive = [0, 0]
    for _ in range(3000):
        accepted = 0
        while accepted < 4 and rng.random() < 0.7:
            accepted += 1
        est.update(4, accepted)
        naive[0] += accepted
        naive[1] += 4
    assert est.p == pytest.approx(0.7, abs=0.03) and est.p_first == pytest.approx(0.7, abs=0.03)
    assert naive[0] / naive[1] < 0.6


def test_the_length_estimator_handles_capped_rounds():
    """A lookup-like drafter: no match half the time, else a copy of 3 or of 12 tokens. Rounds
    capped below the natural length only say L >= cap; the product-limit estimate still finds
    P(L >= n)."""
    rng = random.Random(1)
    est = LengthEstimator(block=16, window=100_000)
    for _ in range(4000):
        natural = 0 if rng.random() < 0.5 else (3 if rng.random() < 0.6 else 12)
        cap = rng.randint(1, 16)
        est.update(cap, min(natural, cap))
    s = est.survival()
    assert s[0] == 1.0 and len(s) == 18
    assert s[1] == pytest.approx(0.5, abs=0.03) and s[3] == pytest.approx(0.5, abs=0.03)
    assert s[4] == pytest.approx(0.2, abs=0.03) and s[12] == pytest.approx(0.2, abs=0.03)
    assert s[13] < 0.01
    assert LengthEstimator(block=4).survival() == [1.0] * 6  # no evidence: fills the cap


def test_the_plan_averages_over_the_drafter_s_natural_length():
    curves = synthetic(lambda K: 1 + 0.1 * (K - 1))
    table = plan_table(curves, 0.8, 64, 16)
    assert table[3].tokens == pytest.approx(expected_tokens(0.8, 3))  # no survival: fills k
    assert table[3].seconds == pytest.approx(1.3)
    # Never more than 3 tokens: any cap >= 3 drafts the same, so the shortest such cap wins.
    never_past_3 = [1.0, 0.5, 0.5, 0.5] + [0.0] * 14
    assert best_plan(curves, 0.8, 64, 16, survival=never_past_3).k == 3
    table = plan_table(curves, 0.8, 64, 16, survival=never_past_3)
    # Half the rounds draft nothing (1 token, cost 1), half draft 3.
    assert table[8].tokens == pytest.approx(0.5 * 1 + 0.5 * expected_tokens(0.8, 3))
    assert table[8].seconds == pytest.approx(0.5 * 1.0 + 0.5 * 1.3)


# -- auto: off and back on ---------------------------------------------------------------------


def test_auto_switches_drafting_off_and_comes_back():
    curves = synthetic(lambda K: 1 + 0.05 * (K - 1))  # float32 on the CPU: nearly flat
    cap = AutoCap(AutoCapConfig(probe_every=8, probe_k=2), curves=curves)
    assert cap.choose(16) >= 4  # the prior (0.6) says draft
    ks = []
    for _ in range(60):  # a drafter that is never right
        k = cap.choose(16)
        cap.observe(k, 0, 0.0)
        ks.append(k)
    tail = ks[-24:]
    assert tail.count(0) >= 20 and max(tail) <= 2  # off, but for short probes
    assert cap.estimator.p_first < 0.1
    ks = []
    for _ in range(40):  # now every draft is accepted
        k = cap.choose(16)
        cap.observe(k, k, 0.0)
        ks.append(k)
    assert ks[-10:] == [16] * 10


def test_auto_lets_a_drafter_that_sizes_its_drafts_fill_the_limit_when_drafting_pays():
    """Lookup drafts long only on long matches (strong evidence of a copy), so `auto` decides
    whether to draft and not how much: the plan's k assumes one acceptance rate for all."""
    curves = synthetic(lambda K: 1 + 0.15 * (K - 1))  # each row costs: the plan keeps k short
    plain, sized = AutoCap(AutoCapConfig(), curves=curves), AutoCap(AutoCapConfig(), curves=curves)
    sized.drafter_sizes_drafts = True
    planned = plain.choose(12)
    assert 0 < planned < 12 and sized.choose(12) == 12
    off = AutoCap(AutoCapConfig(follow_drafter_sizes=False), curves=curves)
    off.drafter_sizes_drafts = True
    assert off.choose(12) == planned  # the setting turns it off
    for _ in range(60):  # a drafter that is never right: off, but for short probes
        k = sized.choose(12)
        sized.observe(k, 0, 0.0)
    tail = [sized.choose(12) for _ in range(24)]
    assert tail.count(0) >= 20 and max(tail) <= 2


def test_auto_plans_copied_runs_apart_from_the_drafter_s_pass():
    """A block drafter with `prompt_lookup` drafts from two sources. Where the drafter's pass
    costs more than its drafts win, `auto` switches those rounds off, while copied runs (charged
    no pass, accepted far more often) keep drafting; with one plan for both, the copies' hits
    keep the losing drafter on."""
    curves = synthetic(lambda K: 1 + 0.05 * (K - 1), block=7, drafter=0.6)
    accept = {DRAFTER_SOURCE: 0.3, COPY_SOURCE: 0.9}
    ks: dict[str, dict[str, list[int]]] = {}
    for apart in (True, False):
        cap = AutoCap(AutoCapConfig(plan_sources_apart=apart), curves=curves)
        rng, chosen = random.Random(0), {DRAFTER_SOURCE: [], COPY_SOURCE: []}
        for i in range(150):
            source = COPY_SOURCE if i % 3 == 2 else DRAFTER_SOURCE
            k = cap.choose(7, source)
            got = 0
            while got < k and rng.random() < accept[source]:
                got += 1
            cap.observe(k, got, 0.0, source)
            chosen[source].append(k)
        ks["apart" if apart else "one"] = chosen
        if apart:
            assert cap.state(DRAFTER_SOURCE).estimator.p_first < 0.45
            assert cap.state(COPY_SOURCE).estimator.p_first > 0.75
    drafter_tail = ks["apart"][DRAFTER_SOURCE][-30:]
    assert drafter_tail.count(0) >= 24  # off, but for probes
    assert ks["apart"][COPY_SOURCE][-20:] == [7] * 20  # copies size themselves: the limit
    assert ks["one"][DRAFTER_SOURCE][-30:].count(0) <= 6  # the mixed estimate keeps it on


def test_a_new_request_keeps_the_estimate_but_adapts_fast():
    curves = synthetic(lambda K: 1 + 0.05 * (K - 1))
    cap = AutoCap(AutoCapConfig(carry_weight=4.0), curves=curves)
    for _ in range(50):  # a request where drafts always fail
        cap.observe(4, 0, 0.0)
    cap.begin([1] * 10)
    first = cap.estimator.first
    assert first.successes + first.failures == pytest.approx(4.0)
    assert cap.choose(16) == 0  # still off: the carried estimate says the drafter misses
    cap.observe(16, 16, 0.0)  # one long copy accepted in the new request...
    assert cap.choose(16) > 0  # ...is enough to draft again


def test_a_few_misses_do_not_switch_drafting_off():
    # CPU-like costs: each verified row adds 15% of a plain round, drafting 30%.
    curves = synthetic(lambda K: 1 + 0.15 * (K - 1), block=7, drafter=0.3)
    cap = AutoCap(AutoCapConfig(), curves=curves)
    rng = random.Random(0)
    geometric_rounds(cap, rng, 0.6, 40, 7)  # a request where drafts pay
    cap.begin([1] * 10)
    ks = []
    for _ in range(4):  # the next one starts with four misses
        ks.append(cap.choose(7))
        cap.observe(ks[-1], 0, 0.0)
    plan = cap.plan(7)
    assert plan is not None and plan.gain < 1.0  # the estimate alone would switch off...
    assert 0 not in ks and cap.choose(7) > 0  # ...but four rounds on a good history prove little
    stopped = [k for k, _ in geometric_rounds(cap, rng, 0.0, 40, 7)]
    assert stopped[-20:].count(0) >= 16  # a drafter that stopped hitting is off soon


def test_beta_quantile():
    # Checked against draws from numpy's Beta sampler, not against the same formulas: the share
    # of draws at or below the quantile is the level (400k draws: within 0.004 is > 5 sigma).
    rng = np.random.default_rng(0)
    for a, b, level in [
        (4.3, 14.2, 0.9),
        (0.04, 3.96, 0.9),
        (1.9, 4.1, 0.5),
        (30, 2, 0.99),
        (6e3, 9e3, 0.9),
    ]:
        q = beta_quantile(a, b, level)
        assert abs(float(np.mean(rng.beta(a, b, 400_000) <= q)) - level) < 0.004, (a, b, q)
    assert beta_quantile(0.0, 5.0, 0.9) == 0.0 and beta_quantile(3.0, 0.0, 0.9) == 1.0
    # Next to no successes left: confidently near 0 even on four trials.
    assert beta_quantile(0.04, 3.96, 0.9) < 0.02 < beta_quantile(1.0, 4.0, 0.9)


def test_auto_never_drafts_where_it_cannot_pay():
    # Verify costs K times one token (4-bit on the MLX CPU): no k beats plain decoding.
    cap = AutoCap(AutoCapConfig(probe_every=1000), curves=synthetic(lambda K: K))
    assert [cap.choose(16) for _ in range(20)] == [0] * 20


def test_a_reference_verifier_that_reroutes_its_forward_is_timed_as_itself(monkeypatch):
    """The curves time the plain forward only for a verifier that is the plain forward: one
    whose attention runs through matmuls (`auto` on CUDA) or whose layers are compiled costs
    what it costs, and is keyed apart."""
    from dspark_flow.calibration.controller import config_identity
    from dspark_flow.models import attention
    from dspark_flow.strategies.verifiers.reference import ReferenceConfig

    monkeypatch.setattr(attention, "backend_name", lambda: "cpu")
    assert config_identity(None) == config_identity(ReferenceConfig()) == "reference"
    assert config_identity(ReferenceConfig(attention="matmul")) != "reference"
    assert config_identity(ReferenceConfig(compile_layers=True)) != "reference"
    monkeypatch.setattr(attention, "backend_name", lambda: "cuda")
    assert config_identity(ReferenceConfig()) != "reference"
    assert config_identity(ReferenceConfig(attention="fused")) == "reference"


def test_calibrated_always_drafts_and_auto_turns_drafting_off_where_it_loses():
    # Each row costs a step (4-bit on the MLX CPU): no k pays. `calibrated` still picks the
    # best k (documented); `auto` is the cap that stops drafting.
    losing = synthetic(lambda K: K)
    assert CalibratedCap(CalibratedCapConfig(acceptance=0.1), curves=losing).choose(16) == 1
    assert AutoCap(AutoCapConfig(acceptance=0.1, probe_every=1000), curves=losing).choose(16) == 0


def test_auto_probes_cost_what_they_are_expected_to_lose():
    curves = synthetic(lambda K: 1 + 0.3 * (K - 1))  # a probe of 2 costs 1.6 plain rounds
    cfg = AutoCapConfig(probe_every=4, probe_k=2, probe_cost=0.02)

    def run(rounds: int, accept: float) -> list[int]:
        cap = AutoCap(cfg, curves=curves)
        return [k for k, _ in geometric_rounds(cap, random.Random(0), accept, rounds, 16)]

    # Never accepted: a probe commits one token in the time of 1.6 plain rounds (a loss of 0.6
    # of a round), so with probe_cost 2% probes are about 30 rounds apart.
    tail = run(300, 0.0)[100:]
    drafted = [i for i, k in enumerate(tail) if k]
    assert drafted and all(b - a >= 15 for a, b in zip(drafted, drafted[1:], strict=False))
    # Accepted half the time: short drafts pay, so it drafts nearly every round.
    assert sum(k > 0 for k in run(300, 0.5)[100:]) >= 150


def test_auto_reuses_its_off_decision_until_something_it_rests_on_moves(monkeypatch):
    """An off round learns nothing, so the next one reuses the decision (replanning took 0.15
    ms a round in a 2-core CPU's loop) until the estimates, the 16-token depth step or the
    learnt round cost move; between steps it is not replanned at the new depth, which on
    curves that grow with depth changes next to no choice."""
    from dspark_flow.calibration import controller

    rows = [[(1.0 + d / 4096) * (1 + 0.3 * (k - 1)) for k in range(1, 18)] for d in (64, 2048)]
    curves = Curves(depths=[64, 2048], verify=rows, drafter=[0.0] + [0.05] * 16)
    cfg = AutoCapConfig(probe_every=4, probe_k=2)
    tables = {"n": 0}
    real_table = controller.plan_table

    def counted(*args, **kwargs):
        tables["n"] += 1
        return real_table(*args, **kwargs)

    monkeypatch.setattr(controller, "plan_table", counted)

    def run(reuse: bool) -> tuple[list[int], int, float]:
        cap = AutoCap(cfg, curves=curves)
        cap.begin(list(range(100)))
        if not reuse:
            fresh = iter(range(10**6))
            cap._situation = lambda limit: next(fresh)  # never the same: plan every round
        tables["n"] = 0
        rng, ks = random.Random(1), []
        for i in range(400):  # drafts accepted 15% a position; rounds 10% over their charge
            k = cap.choose(16)
            draws = [rng.random() for _ in range(16)]  # the same draws whatever k: aligned runs
            got = 0
            while got < k and draws[got] < 0.15:
                got += 1
            seconds = 1.1 * curves.round_cost(k, cap.depth) + 0.01 * (i % 3)
            cap.observe(k, got, seconds)
            ks.append(k)
        return ks, tables["n"], cap.cost_offset()

    reused, planned_reusing, offset = run(True)
    replanned, planned_every_round, _ = run(False)
    assert offset > 0  # the learnt cost is part of what the reuse is keyed on
    assert reused.count(0) > 250  # mostly off: drafts are accepted 15% of the time
    same = sum(a == b for a, b in zip(reused, replanned, strict=True))
    assert same >= 0.97 * len(reused)
    assert planned_reusing < planned_every_round / 3


def test_auto_keeps_learning_past_the_first_position():
    # Verifying 2 or 3 rows costs the same, 4 and more 1.5x (the 4-bit CUDA matmul step).
    curves = synthetic(lambda K: 1.0 if K <= 3 else 1.5, block=7)
    cap = AutoCap(AutoCapConfig(), curves=curves)
    for _ in range(80):  # a request where only first positions are ever accepted
        k = cap.choose(7)
        cap.observe(k, min(k, 1), 0.0)
    assert cap.estimator.p < 0.2
    cap.begin([1] * 10)
    rng = random.Random(0)
    ks = []
    for _ in range(60):  # now every position is accepted with 0.8
        k = cap.choose(7)
        got = 0
        while got < k and rng.random() < 0.8:
            got += 1
        cap.observe(k, got, 0.0)
        ks.append(k)
    # Drafting only k = 1 never shows that later positions are accepted now; auto must find out
    # and draft more than one token.
    assert ks[-20:].count(1) <= 5, ks


def test_auto_learns_the_second_position_only_where_that_is_cheap():
    # One drafted token verifies at 1.1x a plain round, two at 3x: learning whether a second
    # token would be accepted costs a lot, so auto seldom tries it (about 2% of the time).
    curves = synthetic(lambda K: {1: 1.0, 2: 1.1}.get(K, 3.0), block=7)
    cap = AutoCap(AutoCapConfig(), curves=curves)
    ks = []
    for _ in range(300):  # the first position is always accepted, the second never
        k = cap.choose(7)
        cap.observe(k, min(k, 1), 0.0)
        ks.append(k)
    assert ks[50:].count(1) >= 240 and ks[50:].count(2) <= 3, ks


# -- replaying caps on recorded drafts -----------------------------------------------------------


def _replay_at_k3(trace):  # noqa: ANN001, ANN202
    """`trace` replayed by a fixed cap at k = 3, block 4, on curves where a verify of K rows
    costs 1 + 0.5 (K - 1) and the drafter's pass 0.25."""
    from dspark_flow.calibration.simulate import replay
    from dspark_flow.strategies.draft_caps.fixed import FixedCap, FixedCapConfig

    curves = synthetic(lambda K: 1.0 + 0.5 * (K - 1), block=4, drafter=0.25)
    return replay(FixedCap(FixedCapConfig(k=3)), trace, curves, block=4)


def test_replay_charges_each_round_what_it_drafted():
    from dspark_flow.calibration.simulate import DraftTrace

    # 8 tokens: the first from the prefill; at j=1 a draft of 4 matches 2 tokens, at j=4 the
    # drafter proposes only 1 (lookup without a longer match) and it matches.
    trace = DraftTrace(
        prompt_len=10,
        num_tokens=8,
        end=8,
        budget=8,
        proposed=[0, 4, 4, 4, 1, 4, 4, 4],
        accepted=[0, 2, 0, 0, 1, 3, 0, 0],
    )
    got = _replay_at_k3(trace)
    # j=1: 3 drafted, 2 accepted -> j=4: 1 proposed, 1 accepted -> j=6: k=min(3, 8-6-1)=1,
    # 0 accepted -> j=7: k=0 (the last token), plain.
    assert got.accept_lengths == [3, 2, 1, 1]
    assert got.chosen == {3: 2, 1: 1, 0: 1}
    assert got.tokens == 7 and got.rounds == 4
    want = (2.5 + 0.25) + (1.5 + 0.25) + (1.5 + 0.25) + 1.0
    assert got.seconds == pytest.approx(want)


def test_replay_charges_a_copied_round_no_drafter_pass():
    from dspark_flow.calibration.simulate import DraftTrace

    trace = DraftTrace(
        prompt_len=10,
        num_tokens=6,
        end=6,
        budget=16,
        proposed=[0, 4, 4, 4, 4, 4],
        accepted=[0, 2, 0, 0, 1, 0],
        sources=["", COPY_SOURCE, "", "", DRAFTER_SOURCE, ""],
    )
    got = _replay_at_k3(trace)
    # j = 1, a copy: 3 drafted, 2 accepted, verify of 4 rows only; j = 4, the drafter's pass:
    # 3 drafted, 1 accepted, verify and pass; j = 6 is the end.
    assert got.accept_lengths == [3, 2]
    assert got.seconds == pytest.approx(2.5 + (2.5 + 0.25))
    trace.sources = None  # an older trace: every round ran the drafter
    assert _replay_at_k3(trace).seconds == pytest.approx(5.5)


def _draft_caps_script():  # noqa: ANN202
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "draft_caps.py"
    spec = importlib.util.spec_from_file_location("draft_caps_bench", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_benchmark_pairs_each_auto_run_with_the_same_trial_s_other_run():
    bench = _draft_caps_script()
    prompts = [("chat", "a"), ("chat", "b")]
    seconds = {  # per prompt, per trial; trial 2 of prompt a ran in a slow phase for everyone
        "greedy": [[2.0, 4.0], [2.0, 2.0]],
        "fixed k=1": [[1.0, 2.0], [1.0, 1.0]],
        "calibrated": [[1.0, 2.0], [1.0, 1.0]],
        "auto": [[1.0, 2.0], [1.25, 1.25]],
    }
    speed, checks = bench.summarize(list(seconds), ["chat"], prompts, [11, 11], seconds, True)
    # Medians per prompt: auto 1.5 + 1.25 against fixed 1.5 + 1.0 s; pairs: 1, 1, 0.8, 0.8.
    assert checks["chat"]["auto_vs_best_fixed"] == pytest.approx(2.5 / 2.75)
    assert checks["chat"]["paired_vs_best_fixed"] == pytest.approx(0.9)
    assert checks["chat"]["paired_vs_greedy"] == pytest.approx(1.8)  # pairs 2, 2, 1.6, 1.6
    _, unpaired = bench.summarize(list(seconds), ["chat"], prompts, [11, 11], seconds)
    assert "paired_vs_best_fixed" not in unpaired["chat"]


def test_the_benchmark_takes_a_prompts_file_whole_unless_told(tmp_path):
    bench = _draft_caps_script()
    rows = [{"category": c, "turns": [f"{c} {i}"]} for c in ("chat", "code") for i in range(3)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = bench.parse_args(["--prompts", str(path)])
    assert len(bench.pick_prompts(whole.per_category, whole.prompts)) == 6
    told = bench.parse_args(["--prompts", str(path), "--per-category", "1"])
    assert bench.pick_prompts(told.per_category, told.prompts) == [
        ("chat", "chat 0"),
        ("code", "code 0"),
    ]
    assert bench.parse_args([]).per_category == 2  # the package's own prompts: two each


def test_the_benchmark_replays_recorded_drafts_against_other_curves(tmp_path):
    import subprocess
    import sys

    from dspark_flow.calibration.simulate import DraftTrace

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "draft_caps.py"
    rng = random.Random(1)
    traces = []
    for category in ("chat", "code", "math", "edit"):
        accepted = [0] + [rng.choice([0, 0, 1, 3, 8]) for _ in range(63)]
        traces.append(DraftTrace(30, 64, 64, 64, [8] * 64, accepted, category).to_dict())
    flat = synthetic(lambda K: 1.0, block=8)  # verifying costs the same for any K
    steep = synthetic(lambda K: float(K), block=8)  # K rows cost K times one: never draft
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"traces": traces, "ks": list(range(1, 9)), **_curves(flat)}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_curves(steep)))

    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(script), "--replay", str(results), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    def auto_vs_greedy(out: str) -> float:
        line = next(ln for ln in out.splitlines() if ln.startswith("| auto / greedy"))
        return float(line.split("|")[-2])  # the "all" column

    here, there = run(), run("--curves", str(other))
    assert here.returncode == 0 and there.returncode == 0, here.stderr + there.stderr
    assert "| fixed k=8 |" in here.stdout
    assert auto_vs_greedy(here.stdout) > 1.5  # free verification: drafting wins big
    assert 0.97 <= auto_vs_greedy(there.stdout) <= 1.0  # nothing to win: auto stays off
    sticky = run("--sticky", "0.05")
    assert sticky.returncode == 0, sticky.stderr
    assert "| auto sticky |" in sticky.stdout and "| auto sticky / best fixed |" in sticky.stdout
    orders = run("--orders", "3")
    assert orders.returncode == 0, orders.stderr
    assert "`auto` over 3 random prompt orders" in orders.stdout
    row = next(ln for ln in orders.stdout.splitlines() if ln.startswith("| auto / greedy |"))
    worst, median = (float(x) for x in row.split("|")[-2].split("/"))  # the "edit" column
    assert 1.0 < worst <= median  # free verification: every order drafts and wins
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(_curves(flat)))
    failed = subprocess.run(
        [sys.executable, str(script), "--replay", str(empty)], capture_output=True, text=True
    )
    assert failed.returncode == 2 and "no recorded drafts" in failed.stderr


def _curves(curves: Curves) -> dict:
    return {"curves": curves.to_dict()}


# -- end to end on the embedded model ----------------------------------------------------------

PROMPTS = [
    "Fix the typo in this sentence and repeat it: The quick brown fox jumsp over the lazy dog.",
    "Write a Python function that checks whether a number is prime.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def greedy_refs(embedded):
    from dspark_flow.api import greedy_generate

    return [greedy_generate(*embedded, p, max_new_tokens=MAX_NEW).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One calibration cache for the end-to-end tests: the draft cap's kind is not part of the
    key, so `auto` reuses what `calibrated` measured."""
    return tmp_path_factory.mktemp("calibration")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["calibrated", "auto"])
def test_calibrated_and_auto_are_lossless(embedded, greedy_refs, shared_cache, kind):
    from dspark_flow.pipeline import Pipeline

    cap = {"kind": kind, **FAST, "depths": [32], "cache_dir": str(shared_cache)}
    pipe = Pipeline.from_dict(
        {"drafter": {"kind": "lookup", "max_draft": 8}, "draft_cap": cap}, target=embedded
    ).warm_up()
    assert len(list(shared_cache.iterdir())) == 1
    for prompt, want in zip(PROMPTS, greedy_refs, strict=True):
        assert pipe.generate(prompt, max_new_tokens=MAX_NEW).token_ids == want
    chosen = pipe.draft_cap.chosen  # type: ignore[attr-defined]
    assert sum(chosen.values()) > 0 and max(chosen) <= 8
    # lookup sizes its own drafts: the cap learnt so from it at warm_up
    assert pipe.draft_cap.drafter_sizes_drafts  # type: ignore[attr-defined]
    assert pipe.draft_cap.depth > 20  # type: ignore[attr-defined]  # followed the generation


@pytest.mark.slow
def test_caps_sharing_a_drafter_follow_only_their_own_generations(embedded, shared_cache):
    """Each cap used to wrap the drafter's begin() to learn of new generations, so every cap
    ever warmed with a drafter stayed chained to it (one more per speculative_generate call
    with a cap given as a dict): the loop now tells the cap itself."""
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.strategies.drafters.lookup import LookupConfig, LookupDrafter

    drafter = LookupDrafter(LookupConfig(max_draft=8))
    cap = {"kind": "auto", **FAST, "depths": [32], "cache_dir": str(shared_cache)}
    pipes = [
        Pipeline.from_dict({"drafter": {"kind": "lookup"}, "draft_cap": cap}, target=embedded,
                           drafter=drafter).warm_up()
        for _ in range(3)
    ]  # fmt: skip
    assert "begin" not in vars(drafter)  # nothing wrapped the drafter's method
    depths = [p.draft_cap.depth for p in pipes]  # type: ignore[attr-defined]
    pipes[1].generate(PROMPTS[0], max_new_tokens=4)
    after = [p.draft_cap.depth for p in pipes]  # type: ignore[attr-defined]
    assert after[0] == depths[0] and after[2] == depths[2] and after[1] > 20


@pytest.mark.slow
def test_calibrate_api_gives_a_pipeline_draft_cap(embedded, greedy_refs, tmp_path):
    import dspark_flow
    from dspark_flow.pipeline import Pipeline

    cap = dspark_flow.calibrate(embedded, cache_dir=str(tmp_path), max_k=6, **FAST)
    assert cap.config.kind == "auto" and cap.curves.block == 6 and cap.cache_path.is_file()
    pipe = Pipeline.from_dict({"drafter": {"kind": "lookup"}}, target=embedded, draft_cap=cap)
    assert pipe.generate(PROMPTS[0], max_new_tokens=MAX_NEW).token_ids == greedy_refs[0]
    from dspark_flow.calibration.store import drafter_identity

    assert drafter_identity(pipe.drafter) == cap.calibrated_for  # the same drafter: no warning


@pytest.mark.slow
def test_cli_calibrate_and_max_draft(tmp_path, monkeypatch, capsys):
    from dspark_flow.cli.main import main

    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "lookup_auto.yaml")
    args = ["calibrate", recipe, "--depths", "16", "--repeats", "1", "--set", "drafter.max_draft=3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "verify@16" in out and "[measured:" in out and len(list(tmp_path.iterdir())) == 1
    assert main(args) == 0 and "[cached:" in capsys.readouterr().out
    # A depth the context cannot hold is measured lower, and the output says so
    deep = ["calibrate", recipe, "--depths", "16,99999999", "--repeats", "1", "--set",
            "drafter.max_draft=3"]  # fmt: skip
    assert main(deep) == 0
    err = capsys.readouterr().err
    assert "note: depths 99999999 leave no room" in err and "measured at 16" in err
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.setenv(ENV_DIR, str(blocker / "sub"))
    assert main(args) == 0
    assert "[measured; not cached: the calibration cache could not be written]" in (
        capsys.readouterr().out
    )
    assert main(["run", recipe, "--prompt", "hi", "--max-draft", "seven"]) == 2
    assert "--max-draft" in capsys.readouterr().err
    plain = str(Path(recipe).parent / "quickstart.yaml")
    assert main(["run", plain, "--prompt", "hi", "--max-tokens", "2", "--max-draft", "4"]) == 0
    assert "--max-draft does nothing with drafter none" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lookup", "dspark"])
def test_a_recorded_trace_replays_the_real_loop_exactly(embedded, kind):
    """The replay is only worth its numbers if a fixed k replayed on a recorded trace commits
    exactly what the real loop commits with that k, round by round (lookup, and a block
    drafter that reads the target's hidden states: the shipped DSpark one)."""
    from dspark_flow.calibration.simulate import record_trace, replay
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.strategies.draft_caps.fixed import FixedCap, FixedCapConfig

    drafter: dict = {"kind": "lookup", "max_draft": 8}
    if kind == "dspark":
        drafter = {"kind": "dspark", "checkpoint": "builtin:smollm2-135m-dspark"}
    recorder = Pipeline.from_dict({"drafter": drafter}, target=embedded).warm_up()
    curves = synthetic(lambda K: 1.0, block=8)
    for prompt in PROMPTS:
        trace = record_trace(recorder, prompt, MAX_NEW)
        for k in (2, 5):
            real = Pipeline.from_dict(
                {"drafter": drafter, "draft_cap": {"kind": "fixed", "k": k}}, target=embedded
            ).warm_up()
            result = real.generate(prompt, max_new_tokens=MAX_NEW)
            replayed = replay(FixedCap(FixedCapConfig(k=k)), trace, curves, block=8)
            assert trace.num_tokens == result.num_tokens and trace.end >= trace.num_tokens
            # Round for round, the last one included: both count it up to the stop.
            assert replayed.accept_lengths == result.accept_lengths


def test_auto_just_below_break_even_loses_little():
    """A drafter whose acceptance sits below break-even: `auto` pays for the rounds it needs to
    be sure (its optimistic reading keeps drafting on while the evidence is thin). Replayed on
    CPU-like curves over 5 requests x 100 rounds, time charged from the plans."""
    curves = synthetic(lambda K: 1 + 0.15 * (K - 1), block=7, drafter=0.3)
    even = next(q / 100 for q in range(1, 100) if best_plan(curves, q / 100, 64, 7).gain >= 1.0)
    plain = curves.verify_cost(1, 64)
    seconds = [plan.seconds for plan in plan_table(curves, 0.0, 64, 7)]  # per round, by k
    for q in (even - 0.15, even - 0.07, even - 0.02):
        rates = []
        for seed in range(6):
            cap, rng, rounds = AutoCap(AutoCapConfig(), curves=curves), random.Random(seed), []
            for _ in range(5):
                cap.begin([1] * 64)
                rounds += geometric_rounds(cap, rng, q, 100, 7)
            time = sum(seconds[k] for k, _ in rounds)
            rates.append(sum(got + 1 for _, got in rounds) / time * plain)
        # Measured 0.955-0.972 (the goal says 0.97; the switch on the point estimate alone got
        # 0.975-0.985 here but 0.917 of the best fixed k on the H200 code replay, and on the
        # first rate's quantile alone 0.964-0.978 here but 0.936 on the H200 DFlash chat
        # replay: docs §3). This scenario, a costly drafter just below break-even, is the
        # price of not switching off on thin evidence.
        assert sum(rates) / len(rates) >= 0.95, (q, rates)


def test_the_benchmark_merges_the_trials_of_two_runs_and_refuses_unlike_runs(tmp_path, capsys):
    bench = _draft_caps_script()

    def run(name: str, auto: float, drafter: str = "dspark", prompt: str = "a") -> str:
        times = {"greedy": [[2.0]], "fixed k=1": [[1.0]], "calibrated": [[1.0]], "auto": [[auto]]}
        data = {
            "header": f"command: benchmarks/draft_caps.py --drafter {drafter} --trials 1\n",
            "prompts": [["chat", prompt]],
            "tokens": [11],
            "times": times,
            "taus": {n: [[1.0 if n == "greedy" else 2.0]] for n in times},
            "auto_k": {"chat": {"1": 5}},
        }
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        return str(path)

    a, b = run("a", 1.0), run("b", 2.0)
    assert bench.main(["--merge", a, b]) == 0
    out = capsys.readouterr().out
    assert "2 trials from 2 runs" in out
    # auto's median over both runs' trials: 1.5 s against fixed k=1's 1.0 s.
    assert "| auto / best fixed (goal >= 0.95) | 0.667 | 0.667 |" in out
    # Pairs (fixed k=1's time over auto's, trial by trial): 1.0 and 0.5.
    assert "| auto / best fixed, median of paired runs | 0.750 | 0.750 |" in out
    assert "| auto's k (k:rounds) | 1:10 |" in out and "| 2.00 |" in out
    assert bench.main(["--merge", a, run("c", 1.0, drafter="dflash")]) == 2
    assert bench.main(["--merge", a, run("d", 1.0, prompt="other")]) == 2
    assert "other prompts" in capsys.readouterr().err
    assert bench.main(["--merge", a, str(tmp_path / "missing.json")]) == 2
    assert "cannot merge: FileNotFoundError" in capsys.readouterr().err


# -- the decode loop's own round costs ----------------------------------------------------------


def test_the_loop_round_log_forwards_observe_and_dates_each_round_by_its_depth():
    from dspark_flow.calibration.in_loop import record_rounds, rounds_of

    cap = AutoCap(AutoCapConfig(), curves=synthetic(lambda k: 1.0 + 0.1 * k, block=4))
    cap.begin(list(range(10)))
    log = record_rounds(cap)
    for proposed, accepted in [(4, 2), (0, 0), (3, 3)]:
        cap.observe(proposed, accepted, 0.5)
    cap.observe(2, 1, 0.25, COPY_SOURCE)
    cap.observe(1, 0, 0.5)
    assert log[:3] == [(4, 2, 0.5, DRAFTER_SOURCE), (0, 0, 0.5, DRAFTER_SOURCE)] + [
        (3, 3, 0.5, DRAFTER_SOURCE)
    ]
    assert log[3] == (2, 1, 0.25, COPY_SOURCE)
    assert cap.depth == 10 + 3 + 1 + 4 + 2 + 1  # the wrapped observe still ran
    rounds = rounds_of(log, prompt_len=10)
    # The prompt plus the prefill's token, then each round's accepted drafts + 1; the copied
    # round (no drafter pass, so not a drafter round's cost) is left out, its tokens counted.
    assert [(r.rows, r.depth) for r in rounds] == [(5, 11), (1, 14), (4, 15), (2, 21)]


def test_loop_costs_rescale_the_curves_per_row_count_and_say_so_when_too_few():
    from dspark_flow.calibration.in_loop import (
        Round,
        comparison_table,
        in_loop_curves,
        summarize_rounds,
    )

    curves = synthetic(lambda k: 1.0 + 0.1 * (k - 1), block=6)  # 1.0 s for one row, +0.1 a row
    # The loop: one row takes 1.5x what the curves say, five rows 1.2x.
    rounds = [Round(1, 64, 1.5)] * 5 + [Round(5, 64, 1.68)] * 3 + [Round(5, 64, 1.68 * 1.1)] * 2
    costs = summarize_rounds(rounds)
    assert [(c.rows, c.rounds) for c in costs] == [(1, 5), (5, 5)]
    assert costs[1].seconds == pytest.approx(1.68)
    table = comparison_table(costs, curves, plain=1.2)
    assert "| 1 (greedy) | per token | 1200.00 | 1000.00 | 1.20 |" in table
    assert "| 1 | 5 | 1500.00 | 1000.00 | 1.50 |" in table
    assert "| 5 | 5 | 1680.00 | 1400.00 | 1.20 |" in table
    loop = in_loop_curves(costs, curves)
    assert loop.verify_cost(1, 64) == pytest.approx(1.5)
    assert loop.verify_cost(3, 64) == pytest.approx(1.35 * 1.2)  # the ratio interpolated
    assert loop.verify_cost(5, 64) == pytest.approx(1.68)
    assert loop.verify_cost(7, 64) == pytest.approx(1.2 * 1.6)  # beyond: the nearest ratio
    assert loop.meta["rescaled_to_loop"] == {"1": 1.5, "5": 1.2}
    with pytest.raises(ValueError, match="no row count has 6 rounds"):
        in_loop_curves(costs, curves, min_rounds=6)


def test_the_benchmark_reports_the_loop_costs_it_recorded(tmp_path, capsys):
    bench = _draft_caps_script()
    curves = synthetic(lambda k: 0.01 * k, block=2)
    data = {
        "header": "command: benchmarks/draft_caps.py --drafter lookup --trials 1\n",
        "prompts": [["chat", "a"]],
        "tokens": [11],
        "times": {
            n: [[0.2 if n == "greedy" else 0.1]]
            for n in ("greedy", "fixed k=1", "calibrated", "auto")
        },
        "taus": {n: [[1.0]] for n in ("greedy", "fixed k=1", "calibrated", "auto")},
        "auto_k": {},
        "curves": curves.to_dict(),
        "in_loop": [[2, 40, 0.03]] * 6,
    }
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(data))
    b.write_text(json.dumps(data))
    assert bench.main(["--merge", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "| 1 (greedy) | per token | 20.00 | 10.00 | 2.00 |" in out
    assert "| 2 | 12 | 30.00 | 20.00 | 1.50 |" in out


def test_the_round_cost_offset_waits_for_evidence_and_clips_outliers():
    from dspark_flow.calibration.estimators import RoundCostOffset

    est = RoundCostOffset(window=1000.0, clip=0.75, min_rounds=8)
    for _ in range(7):
        est.update(1.5, 1.0)
    assert est.offset == 0.0  # seven rounds are not evidence yet
    est.update(1.5, 1.0)
    assert est.offset == pytest.approx(0.5)
    est.update(0.0, 1.0)  # an untimed round (replays of old callers, tests) is no evidence
    est.update(float("nan"), 1.0)
    assert est.rounds == 8
    est.update(1000.0, 1.0)  # one round that compiled a shape counts as +0.75 at most
    assert est.offset == pytest.approx((8 * 0.5 + 0.75) / 9, rel=0.01)


def test_auto_adds_what_rounds_take_beyond_the_curves_and_picks_k_by_it():
    """A host slower than at calibration adds the same seconds to every round, which makes a
    longer draft relatively cheaper: `auto` learns the gap and plans with it."""
    curves = synthetic(lambda K: 1.0 + 0.3 * (K - 1), block=8)  # every row costs (4-bit, CPU)
    learns = AutoCap(AutoCapConfig(), curves=curves)
    fixed = AutoCap(AutoCapConfig(learn_round_cost=False), curves=curves)
    for cap in (learns, fixed):
        cap.begin([0] * 64)
        for _ in range(40):  # drafts accepted about 70% a position; rounds 2 s slower
            k = cap.choose(8)
            accepted = 0
            while accepted < k and random.Random(len(cap.chosen) + accepted).random() < 0.7:
                accepted += 1
            charge = curves.verify_cost(k + 1, cap.depth)
            cap.observe(k, accepted, charge + 2.0)
    assert fixed.cost_offset() == 0.0
    assert learns.cost_offset() == pytest.approx(2.0, abs=0.021)  # in steps of 2% of one row
    p_first, p = learns.acceptance()
    with_gap = best_plan(curves, p, learns.depth, 8, p_first, offset=learns.cost_offset())
    without = best_plan(curves, p, learns.depth, 8, p_first)
    assert with_gap.k > without.k  # the gap makes longer drafts pay
    assert learns.plan(8).k == with_gap.k


def test_round_cost_ratios_learn_each_row_count_and_kind_apart():
    from dspark_flow.calibration.estimators import RoundCostRatios

    est = RoundCostRatios(window=1000.0, clip=3.0, min_rounds=4, step=0.02)
    assert est.ratio(3, drafted=True) == 1.0  # nothing known: the curves as they are
    for _ in range(3):
        est.update(1, False, 0.76, 1.0)
    assert not est.knows(1, drafted=False) and est.version == 0  # three rounds are too few
    est.update(1, False, 0.76, 1.0)
    assert est.ratio(1, drafted=False) == pytest.approx(0.76)  # in steps of 0.02
    assert est.ratio(3, drafted=True) == pytest.approx(0.76)  # the other kind's, until known
    for _ in range(4):
        est.update(3, True, 2.0, 1.0)
    assert est.ratio(3, drafted=True) == pytest.approx(2.0)
    assert est.ratio(9, drafted=True) == pytest.approx(2.0)  # the nearest row count of its kind
    assert est.scales(2, drafter_pass=True) == pytest.approx((0.76, 2.0, 2.0))
    assert est.scales(2, drafter_pass=False) == pytest.approx((0.76, 0.76, 0.76))
    version = est.version
    est.update(3, True, 2.001, 1.0)  # moves the ratio by less than a step: plans stay cached
    assert est.version == version
    est.update(3, True, 1000.0, 1.0)  # a round that compiled a shape counts as 3x at most
    assert est.ratio(3, drafted=True) == pytest.approx((4 * 2.0 + 2.001 + 3.0) / 6, abs=0.011)
    est.update(3, True, float("nan"), 1.0)
    est.update(3, True, 0.0, 1.0)  # untimed rounds are no evidence
    assert est.ratio(3, drafted=True) == pytest.approx((4 * 2.0 + 2.001 + 3.0) / 6, abs=0.011)


def drive(cap, rounds: int, accept: float, block: int, plain_charge: float = 1.0) -> list[int]:
    """k per round of `geometric_rounds` (seeded), each round timed as charged."""
    rounds_run = geometric_rounds(cap, random.Random(0), accept, rounds, block, plain_charge)
    return [k for k, _ in rounds_run]


def test_auto_by_row_count_prices_the_drafting_premium_one_offset_misses():
    """A synthetic case: the curves overcharge a plain step (0.75x) but charge drafting rounds
    right, so a drafter whose drafts gain about 10% by the curves loses about 18% in fact. One
    offset, learnt on drafting rounds alone, sees nothing wrong; costs learnt by row count
    time a plain step now and then and switch drafting off."""
    block = 8
    curves = Curves(depths=[64], verify=[[1.0] * (block + 1)], drafter=[0.0] + [0.3] * block)
    off_share = {}
    for by_rows in (False, True):
        cap = AutoCap(AutoCapConfig(round_cost_by_rows=by_rows), curves=curves)
        cap.begin([0] * 64)
        ks = drive(cap, 300, 0.3, block, plain_charge=0.75)
        off_share[by_rows] = sum(k == 0 for k in ks[100:]) / 200
        if by_rows:
            assert cap.round_costs.ratio(1, drafted=False) == pytest.approx(0.75, abs=0.011)
            assert cap.plan(block).gain < 1.0
        else:
            assert cap.plan(block).gain > 1.0
    assert off_share[False] == 0.0
    assert off_share[True] > 0.9


def test_auto_by_row_count_keeps_probes_out_and_retimes_plain_steps():
    """Probes take in the off stretch before them, so they are not learnt as drafting rounds'
    cost; and once a plain step's ratio is known, one is still timed now and then (not more
    often than one round in PLAIN_RESAMPLE_EVERY) so that it follows the host."""
    block = 8
    curves = Curves(depths=[64], verify=[[1.0] * (block + 1)], drafter=[0.0] + [0.3] * block)
    # A drafter that is never accepted: auto drafts at the curves' charge, goes off, and then
    # only probes draft, each at 2x.
    cap = AutoCap(AutoCapConfig(round_cost_by_rows=True), curves=curves)
    cap.begin([0] * 64)
    probes = 0
    for _ in range(300):
        k = cap.choose(block)
        probes += cap.current.probing
        slow = 2.0 if cap.current.probing else 1.0
        cap.observe(k, 0, curves.round_cost(k, cap.depth) * slow)
    # Enough probes of one row count (probe_k = 2) to be learnt, had they counted ...
    assert probes >= cap.round_costs.min_rounds
    # ... yet the drafting rounds' ratios are what steady rounds took.
    learnt = [r for r in range(2, block + 2) if cap.round_costs.knows(r, drafted=True)]
    assert learnt
    assert all(cap.round_costs.ratio(r, drafted=True) == pytest.approx(1.0) for r in learnt)
    # A drafter accepted almost always: auto drafts, and a plain step is timed now and then.
    cap = AutoCap(AutoCapConfig(round_cost_by_rows=True), curves=curves)
    cap.begin([0] * 64)
    plain_at = [i for i, k in enumerate(drive(cap, 600, 0.95, block)) if k == 0]
    assert cap.round_costs.knows(1, drafted=False)
    later = [i for i in plain_at if i > 200]
    assert len(later) >= 2
    assert all(b - a > PLAIN_RESAMPLE_EVERY for a, b in zip(later, later[1:]))
