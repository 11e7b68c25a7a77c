"""Draft caps on this machine: fixed k = 1..16 against `calibrated` and `auto`, with lookup
(or a shipped trained drafter: --drafter dspark|dflash).

Every strategy runs on the same prompts (a few per category of dspark_flow/data/prompts.jsonl)
in the same process, interleaved (each trial visits every prompt, and for each prompt every
strategy in a rotated order) so slow phases of a shared machine hit all strategies alike. The
figure per prompt is the median decode time over the trials; a category's speed is its tokens
over the sum of those medians. Output at T=0 is checked to equal plain greedy token for token.

    python benchmarks/draft_caps.py                      # CPU here, or the GPU where MLX has one
    python benchmarks/draft_caps.py --quick              # smoke run

It also records, per prompt, the drafter's full proposal at every position of the greedy
output and replays every strategy on those drafts with the measured curves
(`dspark_flow.calibration.simulate`): a noise-free, counterfactual figure. `--replay` re-runs
that part alone from a results.json, optionally against another machine's curves:

    python benchmarks/draft_caps.py --replay out/draft_caps/results.json --curves h200.json

The decode loop times every round it runs; the report sets those times, per row count, against
what the curves charge, and replays the strategies once more charged the loop's own costs
(`dspark_flow.calibration.in_loop`): where the two disagree, the curves mislead `auto`.

`--merge` prints the measured table over the trials of several runs on the same prompts (e.g.
two device calls, each with its own warm-up pass), with the paired medians:

    python benchmarks/draft_caps.py --merge call1/results.json call2/results.json

Writes results.json, table.md and verify_cost.png to --out (default out/draft_caps/).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import dspark_flow  # noqa: F401  (loads OpenBLAS before mlx.core)
from dspark_flow.calibration.in_loop import (
    Round,
    comparison_table,
    in_loop_curves,
    record_rounds,
    rounds_of,
    summarize_rounds,
)
from dspark_flow.strategy import COPY_SOURCE

PROMPTS = Path(__file__).resolve().parent.parent / "dspark_flow" / "data" / "prompts.jsonl"
CATEGORIES = ("chat", "code", "math", "edit")


def categories(present: Any) -> list[str]:
    """The CATEGORIES among `present` (category names), in the tables' order."""
    found = set(present)
    return [c for c in CATEGORIES if c in found]


LOOKUP = {"kind": "lookup", "min_ngram": 2, "max_ngram": 4, "max_draft": 16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--per-category",
        type=int,
        default=None,
        help="prompts per category (default: 2 of the package's prompts, every prompt of a "
        "--prompts file)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=PROMPTS,
        help="JSONL of {category, turns} (default: the package's prompts; held-out sets: "
        "benchmarks/heldout_prompts.py)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=3, help="0: only calibrate and replay")
    p.add_argument(
        "--warmup-trials",
        type=int,
        default=0,
        help="unrecorded passes over every prompt and strategy first (GPUs compile per new shape)",
    )
    p.add_argument("--ks", default="1-16", help="fixed k values: '1-16' or '1,2,4,8'")
    p.add_argument("--model", default=None, help="target (default: the embedded model)")
    p.add_argument(
        "--drafter",
        choices=["lookup", "dspark", "dflash"],
        default="lookup",
        help="lookup, or the shipped trained drafter of that kind (builtin:smollm2-135m-KIND)",
    )
    p.add_argument("--weights", default="auto")
    p.add_argument(
        "--verifier",
        default=None,
        help="every pipeline's verifier section (YAML), e.g. '{kind: kernels, invariant: true}', "
        "the CLI's default stack (default: the library's reference verifier)",
    )
    p.add_argument(
        "--draft-vocab", type=int, default=None, help="trained drafters: drafter.draft_vocab"
    )
    p.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="trained drafters: drafter.prompt_lookup on (copy runs from the context first, "
        "as the shipped recipes do)",
    )
    p.add_argument(
        "--lookup-max-draft",
        type=int,
        default=LOOKUP["max_draft"],
        help="lookup's longest draft (15 keeps an invariant verifier's forwards within 16 rows)",
    )
    p.add_argument("--out", default="out/draft_caps")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds for the trials; no trial starts that would likely end past it",
    )
    p.add_argument("--quick", action="store_true", help="1 prompt per category, k in 1,4, 1 trial")
    p.add_argument("--recalibrate", action="store_true", help="measure the curves even if cached")
    p.add_argument(
        "--replay",
        metavar="RESULTS",
        help="only replay the strategies on the drafts recorded in this results.json",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="RESULTS",
        help="only print the measured table over the trials of these results.json files "
        "(same prompts and strategies)",
    )
    p.add_argument(
        "--curves",
        metavar="JSON",
        help="with --replay: cost curves from this results.json (e.g. another machine's)",
    )
    p.add_argument(
        "--auto",
        default="{}",
        help="with --replay: JSON of `auto` settings to try, e.g. '{\"probe_cost\": 0.05}'",
    )
    p.add_argument(
        "--orders",
        type=int,
        default=0,
        metavar="N",
        help="with --replay: also replay `auto` over N random prompt orders (it carries what "
        "one prompt taught it into the next) and report the worst and median per category",
    )
    p.add_argument(
        "--sticky",
        type=float,
        metavar="MARGIN",
        help="also run `auto` with this switch_margin (keep the previous k unless another is "
        "this fraction faster), as the strategy 'auto sticky'",
    )
    p.add_argument(
        "--auto-variant",
        metavar="JSON",
        help="also run `auto` with these settings beside the plain one, as the strategy 'auto "
        "variant', e.g. '{\"learn_round_cost\": false}' (an A/B in one run; replays too)",
    )
    args = p.parse_args(argv)
    if (args.draft_vocab or args.prompt_lookup) and args.drafter == "lookup":
        p.error("--draft-vocab and --prompt-lookup are for the trained drafters, not lookup")
    if args.quick:
        args.per_category, args.ks, args.trials = 1, "1,4", 1
    if args.per_category is None:  # a file the user chose is taken whole
        args.per_category = 2 if args.prompts == PROMPTS else None
    return args


def parse_ks(text: str) -> list[int]:
    if "-" in text and "," not in text:
        lo, hi = (int(x) for x in text.split("-"))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",") if x.strip()]


def pick_prompts(per_category: int | None, path: Path = PROMPTS) -> list[tuple[str, str]]:
    """The first `per_category` prompts of each category in `path` (None: all of them)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out: list[tuple[str, str]] = []
    for cat in CATEGORIES:
        out += [(cat, r["turns"][0]) for r in rows if r["category"] == cat][:per_category]
    return out


def machine() -> dict[str, Any]:
    from dspark_flow.calibration.store import machine_identity

    info = machine_identity()
    info["platform"] = platform.platform()
    return info


def plot_curves(curves: Any, path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:  # the GPU machine has no matplotlib: the curves are in results.json
        print(f"matplotlib missing: {path.name} not drawn", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = list(range(1, len(curves.verify[0]) + 1))
    for depth, row in zip(curves.depths, curves.verify, strict=True):
        ax1.plot(rows, [t * 1e3 for t in row], marker="o", ms=3, label=f"depth {depth}")
        ax2.plot(rows, [t / row[0] for t in row], marker="o", ms=3, label=f"depth {depth}")
    ax2.plot(rows, rows, ls=":", c="grey", label="K x one token")
    ax1.set(xlabel="rows verified K (= k + 1)", ylabel="ms per verify round", title="verify cost")
    ax2.set(xlabel="rows verified K (= k + 1)", ylabel="cost / cost of K=1", title="relative")
    ax2.set_ylim(0, max(4.0, max(t / r[0] for r in curves.verify for t in r) * 1.1))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replay:
        return replay_only(args)
    if args.merge:
        return merge_only(args.merge)
    from dspark_flow.api import load_target
    from dspark_flow.calibration.obtain import obtain_curves
    from dspark_flow.calibration.simulate import record_trace
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.recipe.schema import DEFAULT_MODEL
    from dspark_flow.strategies.drafters.lookup import LookupConfig, LookupDrafter

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    target_ref = args.model or DEFAULT_MODEL
    model, tok = load_target(target_ref, weights=args.weights)
    info = machine()
    print(f"machine: {info}", flush=True)

    # The same curves the calibrated/auto caps load in warm_up (same key), measured first so the
    # time is reported apart.
    t0 = time.perf_counter()
    if args.drafter == "lookup":
        section: dict[str, Any] = {**LOOKUP, "max_draft": args.lookup_max_draft}
        probe: Any = LookupDrafter(LookupConfig(**section))
    else:
        from dspark_flow.api import load_drafter

        section = {"kind": args.drafter, "checkpoint": f"builtin:smollm2-135m-{args.drafter}"}
        probe = load_drafter(section["checkpoint"], model, kind=args.drafter)
        if args.draft_vocab:
            section["draft_vocab"] = args.draft_vocab
        if args.prompt_lookup:
            section["prompt_lookup"] = True
    curves, cache_path, measured = obtain_curves(
        model,
        probe,
        tokenizer=tok,
        target_ref=target_ref,
        force=args.recalibrate,
    )
    calib_s = time.perf_counter() - t0
    where = cache_path or "not cached (the cache could not be written)"
    print(f"curves {'measured' if measured else 'cached'} in {calib_s:.1f}s: {where}")
    blas = "OpenBLAS" if info.get("blas") else "reference BLAS"
    where = (
        f"{info['backend']}, {info['device'].get('device_name', '?')}, {info['cpus']} CPUs, {blas}"
    )
    plot_curves(curves, out / "verify_cost.png", f"{target_ref} ({args.weights}) on {where}")

    ks = [k for k in parse_ks(args.ks) if probe.max_draft is None or k <= probe.max_draft]
    block = min(probe.max_draft or curves.block, curves.block)  # what calibrated/auto may draft
    target = {"model": target_ref, "weights": args.weights}
    stops = [{"kind": "eos"}, {"kind": "max_tokens", "limit": args.max_tokens}]
    recipes: dict[str, dict[str, Any]] = {"greedy": {"drafter": {"kind": "none"}}}
    for k in ks:
        recipes[f"fixed k={k}"] = {"drafter": section, "draft_cap": {"kind": "fixed", "k": k}}
    recipes["calibrated"] = {"drafter": section, "draft_cap": {"kind": "calibrated"}}
    recipes["auto"] = {"drafter": section, "draft_cap": {"kind": "auto"}}
    if args.sticky:
        recipes["auto sticky"] = {
            "drafter": section,
            "draft_cap": {"kind": "auto", "switch_margin": args.sticky},
        }
    if args.auto_variant:
        recipes["auto variant"] = {
            "drafter": section,
            "draft_cap": {"kind": "auto", **json.loads(args.auto_variant)},
        }
    if args.verifier:
        import yaml

        verifier = yaml.safe_load(args.verifier)
        recipes = {name: {**r, "verifier": verifier} for name, r in recipes.items()}
    pipes = {
        name: Pipeline.from_dict({**r, "target": target, "stop": stops}, target=(model, tok))
        for name, r in recipes.items()
    }
    for pipe in pipes.values():
        pipe.warm_up()
    curves_from = "the reference verifier's (measured above)"
    if args.verifier or args.draft_vocab:
        curves_from = (
            f"the `auto` pipeline's (verifier {args.verifier}, draft_vocab {args.draft_vocab})"
        )
        # The caps calibrated through the recipe's verifier and drafter (another cache key):
        # those are the curves the modelled and replayed views must charge.
        curves = pipes["auto"].draft_cap.curves
        plot_curves(
            curves, out / "verify_cost.png", f"{target_ref} ({args.weights}), {args.verifier}"
        )
    names = list(pipes)
    prompts = pick_prompts(args.per_category, args.prompts)

    # times[name][prompt index] = decode seconds per trial; tokens per prompt; auto's k choices.
    times: dict[str, list[list[float]]] = {n: [[] for _ in prompts] for n in names}
    taus: dict[str, list[list[float]]] = {n: [[] for _ in prompts] for n in names}
    tokens: list[int] = [0] * len(prompts)
    outputs: dict[str, list[list[int]]] = {n: [[] for _ in prompts] for n in names}
    # Noise-free view: each round's cost read off the measured curve for what it really drafted.
    modelled: dict[str, list[list[float]]] = {n: [[] for _ in prompts] for n in names}
    drafted = {n: record_proposals(pipes[n].drafter) for n in names}
    # Every drafting round's own time, as the decode loop measured it (timed trials only).
    round_logs = {n: record_rounds(pipes[n].draft_cap) for n in names}
    loop_rounds: list[Round] = []
    auto_k: dict[str, Counter[int]] = defaultdict(Counter)
    traces: list[dict[str, Any]] = []

    def write_report() -> str:
        mismatches = [
            f"{n} on prompt {i}"
            for n in names
            for i in range(len(prompts))
            if outputs[n][i] != outputs["greedy"][i]
        ]
        cats = categories(cat for cat, _ in prompts) + ["all"]
        speed: Any = {}
        checks: Any = {}
        model_speed: Any = {}
        model_checks: Any = {}
        table = ""
        if trials_done:
            speed, checks = summarize(names, cats, prompts, tokens, times, paired=True)
            model_speed, model_checks = summarize(names, cats, prompts, tokens, modelled)
            table = (
                "Measured (wall clock, decode tok/s):\n\n"
                + render(names, cats, speed, taus, checks, auto_k)
                + "\n\nModelled (each round's cost from the measured curve for what it "
                "drafted; no machine noise):\n\n"
                + render(names, cats, model_speed, taus, model_checks, auto_k)
                + "\n\n"
            )
        if trials_done and loop_rounds:
            table += loop_report(loop_rounds, curves, greedy_step(times, tokens)) + "\n\n"
        if traces:
            table += replay_report(
                traces,
                curves,
                ks,
                block=block,
                sticky=args.sticky,
                drafter=args.drafter,
                variant=json.loads(args.auto_variant or "null"),
            )
            if trials_done and loop_rounds:
                table += "\n\n" + loop_replay(
                    loop_rounds,
                    traces,
                    curves,
                    ks,
                    block=block,
                    drafter=args.drafter,
                    variant=json.loads(args.auto_variant or "null"),
                )
        header = (
            f"command: {' '.join(sys.argv)}\n"
            f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; total {time.time() - started:.0f}s; "
            f"calibration {calib_s:.1f}s ({'measured' if measured else 'cached'}); curves used: "
            f"{curves_from}\n"
            f"machine: {json.dumps(info)}\n"
            f"prompts: {len(prompts)} ({args.per_category or 'all'}/category), max {args.max_tokens} tokens, "
            f"{trials_done} trials, T=0; outputs equal to greedy: "
            f"{'n/a' if not trials_done else 'yes' if not mismatches else 'NO: ' + ', '.join(mismatches)}\n"
        )
        (out / "table.md").write_text(header + "\n" + table + "\n")
        result = {
            "header": header,
            "speed": speed,
            "checks": checks,
            "modelled_speed": model_speed,
            "modelled_checks": model_checks,
            "modelled": modelled,
            "tokens": tokens,
            "times": times,
            "taus": taus,
            "prompts": prompts,
            "auto_k": {c: dict(v) for c, v in auto_k.items()},
            "curves": curves.to_dict(),
            "traces": traces,
            "ks": ks,
            "block": block,
            "in_loop": [[r.rows, r.depth, round(r.seconds, 7)] for r in loop_rounds],
        }
        (out / "results.json").write_text(json.dumps(result, indent=1))
        return header + "\n" + table

    trials_done = 0
    t_trials = time.time()  # the warm-up passes count against --time-budget too
    for _ in range(args.warmup_trials):
        for _cat, text in prompts:
            for name in names:
                pipes[name].generate(text, max_new_tokens=args.max_tokens)
        print(f"warm-up pass done at {time.time() - started:.0f}s", flush=True)
    write_report()  # the curves and replays survive a run cut before its first trial
    for trial in range(args.trials):
        spent = time.time() - t_trials
        if args.time_budget and trial and spent + spent / trial > args.time_budget:
            print(f"time budget: stopping after {trial} trials", flush=True)
            break
        for i, (cat, text) in enumerate(prompts):
            shift = (trial * 7 + i * 3) % len(names)
            for name in names[shift:] + names[:shift]:
                cap = pipes[name].draft_cap
                before = Counter(getattr(cap, "chosen", {}))
                drafted[name].clear()
                round_logs[name].clear()
                r = pipes[name].generate(text, max_new_tokens=args.max_tokens)
                prompt_len = len(pipes[name].encode_prompt(text))
                loop_rounds.extend(rounds_of(round_logs[name], prompt_len))
                modelled[name][i].append(model_seconds(curves, r, drafted[name], prompt_len))
                if name == "greedy":
                    tokens[i] = r.num_tokens
                if name == "auto":
                    auto_k[cat] += Counter(cap.chosen) - before  # type: ignore[attr-defined]
                times[name][i].append(decode_seconds(r))
                taus[name][i].append(r.mean_accept_len)
                if outputs[name][i] and outputs[name][i] != r.token_ids:
                    print(f"warning: {name} changed its output on prompt {i}", flush=True)
                outputs[name][i] = r.token_ids
        trials_done = trial + 1
        write_report()  # partial results survive an interrupted run
        print(f"trial {trial + 1}/{args.trials} done at {time.time() - started:.0f}s", flush=True)

    # Every strategy replayed on each prompt's recorded drafts (no noise, same curves).
    recorder = pipes[next(n for n in names if n.startswith("fixed"))]
    traces[:] = [
        record_trace(recorder, text, args.max_tokens, cat).to_dict() for cat, text in prompts
    ]
    report = write_report()
    print(report)
    return 1 if "outputs equal to greedy: NO" in report else 0


def plain_cap() -> Any:
    """A draft cap of k = 0 every round: plain greedy decoding, for replays."""
    from dspark_flow.strategies.draft_caps.fixed import FixedCap, FixedCapConfig

    class Plain(FixedCap):
        def choose(self, drafter_max: int | None, source: str = "drafter") -> int:
            return 0

    return Plain(FixedCapConfig(k=1))


def replay_auto(settings: dict[str, Any], curves: Any, drafter: str) -> Any:
    """An `auto` cap for replays, told what warm_up() learns from the drafter in a live run:
    whether it sizes its own drafts."""
    from dspark_flow.registry import load_kind
    from dspark_flow.strategies.draft_caps.auto import AutoCap, AutoCapConfig

    cap = AutoCap(AutoCapConfig(**settings), curves=curves)
    cap.drafter_sizes_drafts = load_kind("drafter", drafter).sizes_own_drafts  # type: ignore[attr-defined]
    return cap


def replay_report(
    traces: list[dict[str, Any]],
    curves: Any,
    ks: list[int],
    auto: dict[str, Any] | None = None,
    block: int | None = None,
    sticky: float | None = None,
    drafter: str = "lookup",
    charged: str = "the measured curves",
    decided_by: Any = None,
    variant: dict[str, Any] | None = None,
) -> str:
    """The strategies replayed on recorded drafts (see the module docstring), rendered like
    the measured tables: each strategy visits the prompts in order, its state carried along,
    once untimed first as the measured run's warm-up trial does (so `auto` starts each prompt
    from the state the timed trials start from: what the last prompt left, not the prior).
    With `decided_by` (other curves), "auto as run" decides by those and is charged `curves`."""
    from dspark_flow.calibration.simulate import DraftTrace, replay
    from dspark_flow.strategies.draft_caps.calibrated import CalibratedCap, CalibratedCapConfig
    from dspark_flow.strategies.draft_caps.fixed import FixedCap, FixedCapConfig

    caps: dict[str, Any] = {"greedy": plain_cap()}
    caps.update({f"fixed k={k}": FixedCap(FixedCapConfig(k=k)) for k in ks})
    caps["calibrated"] = CalibratedCap(CalibratedCapConfig(), curves=curves)
    caps["auto"] = replay_auto(auto or {}, curves, drafter)
    if sticky:
        caps["auto sticky"] = replay_auto(
            {**(auto or {}), "switch_margin": sticky}, curves, drafter
        )
    if variant is not None:
        caps["auto variant"] = replay_auto({**(auto or {}), **variant}, curves, drafter)
    if decided_by is not None:
        caps["auto as run"] = replay_auto(auto or {}, decided_by, drafter)
        if variant is not None:
            caps["auto variant as run"] = replay_auto(
                {**(auto or {}), **variant}, decided_by, drafter
            )
    runs = [DraftTrace.from_dict(t) for t in traces]
    prompts = [(t.category, "") for t in runs]
    names = list(caps)
    seconds: dict[str, list[list[float]]] = {n: [] for n in names}
    taus: dict[str, list[list[float]]] = {n: [] for n in names}
    auto_k: dict[str, Counter[int]] = defaultdict(Counter)
    for name, cap in caps.items():
        for trace in runs:  # the warm-up pass
            replay(cap, trace, curves, block or max(ks))
        for trace in runs:
            one = replay(cap, trace, curves, block or max(ks))
            seconds[name].append([one.seconds])
            taus[name].append([one.tokens / max(one.rounds, 1)])
            if name == "auto":
                auto_k[trace.category] += one.chosen
    cats = categories(cat for cat, _ in prompts) + ["all"]
    tokens = [t.num_tokens for t in runs]
    speed, checks = summarize(names, cats, prompts, tokens, seconds)
    return (
        f"Replayed (every strategy on each prompt's recorded drafts, charged {charged}; no "
        "noise, counterfactual):\n\n" + render(names, cats, speed, taus, checks, auto_k)
    )


def greedy_step(times: dict[str, list[list[float]]], tokens: list[int]) -> float | None:
    """Plain greedy decoding's seconds per token (sum of per-prompt medians over tokens)."""
    if "greedy" not in times or not all(times["greedy"]):
        return None
    secs = sum(statistics.median(t) for t in times["greedy"])
    steps = sum(n - 1 for n in tokens)
    return secs / steps if steps > 0 else None


def loop_report(rounds: list[Round], curves: Any, plain: float | None) -> str:
    """The decode loop's own round times per row count against the curves' figures."""
    return (
        "Round cost in the decode loop against the curves (every drafting round of the timed "
        "trials, medians):\n\n" + comparison_table(summarize_rounds(rounds), curves, plain)
    )


def loop_replay(
    rounds: list[Round],
    traces: list[dict[str, Any]],
    curves: Any,
    ks: list[int],
    auto: dict[str, Any] | None = None,
    block: int | None = None,
    drafter: str = "lookup",
    variant: dict[str, Any] | None = None,
) -> str:
    """The replay again, each row count charged what the loop measured (`in_loop_curves`)."""
    try:
        loop_curves = in_loop_curves(summarize_rounds(rounds), curves)
    except ValueError as e:
        return f"(no replay with the loop's costs: {e})"
    return replay_report(
        traces,
        loop_curves,
        ks,
        auto,
        block=block,
        drafter=drafter,
        charged="the loop's own round costs (the curves rescaled per row count); `auto` "
        "decides by those, `auto as run` by the curves",
        decided_by=curves,
        variant=variant,
    )


def replay_only(args: argparse.Namespace) -> int:
    from dspark_flow.calibration.curves import Curves

    data = json.loads(Path(args.replay).read_text())
    if not data.get("traces"):
        print(f"{args.replay} has no recorded drafts (made by an older version?)", file=sys.stderr)
        return 2
    source = json.loads(Path(args.curves).read_text()) if args.curves else data
    curves = Curves.from_dict(source.get("curves", source))
    ks = [k for k in data.get("ks", []) if k <= curves.block] or list(range(1, curves.block + 1))
    block = min(data.get("block") or curves.block, curves.block)
    auto, drafter = json.loads(args.auto), drafter_of(data)
    print(
        replay_report(
            data["traces"],
            curves,
            ks,
            auto,
            block=block,
            sticky=args.sticky,
            drafter=drafter,
            variant=json.loads(args.auto_variant or "null"),
        )
    )
    if data.get("in_loop"):  # results.json files since 2026-12-01 keep the loop's round times
        rounds = loaded_rounds(data)
        plain = greedy_step(data["times"], data["tokens"])
        print("\n" + loop_report(rounds, curves, plain) + "\n")
        variant = json.loads(args.auto_variant or "null")
        print(loop_replay(rounds, data["traces"], curves, ks, auto, block, drafter, variant))
    if args.orders:
        print("\n" + order_report(data["traces"], curves, ks, auto, block, drafter, args.orders))
    return 0


def order_report(
    traces: list[dict[str, Any]],
    curves: Any,
    ks: list[int],
    auto: dict[str, Any],
    block: int,
    drafter: str,
    orders: int,
) -> str:
    """`auto` against the best fixed k and greedy per category, over `orders` seeded random
    prompt orders (a warm-up pass in the same order first, as in the measured protocol). The
    fixed caps keep no state, so only `auto` depends on the order."""
    import random

    from dspark_flow.calibration.simulate import DraftTrace, replay
    from dspark_flow.strategies.draft_caps.fixed import FixedCap, FixedCapConfig

    runs = [DraftTrace.from_dict(t) for t in traces]
    fixed = {
        k: [replay(FixedCap(FixedCapConfig(k=k)), r, curves, block).seconds for r in runs]
        for k in ks
    }
    greedy = [replay(plain_cap(), r, curves, block).seconds for r in runs]
    cats = categories(r.category for r in runs)
    vs_best: dict[str, list[float]] = {c: [] for c in cats}
    vs_greedy: dict[str, list[float]] = {c: [] for c in cats}
    for seed in range(orders):
        order = list(range(len(runs)))
        random.Random(seed).shuffle(order)
        cap = replay_auto(auto, curves, drafter)
        for i in order:  # the warm-up pass
            replay(cap, runs[i], curves, block)
        secs = {i: replay(cap, runs[i], curves, block).seconds for i in order}
        for c in cats:
            idx = [i for i, r in enumerate(runs) if r.category == c]
            ours = sum(secs[i] for i in idx)
            vs_best[c].append(min(sum(fixed[k][i] for i in idx) for k in ks) / ours)
            vs_greedy[c].append(sum(greedy[i] for i in idx) / ours)
    lines = [
        f"`auto` over {orders} random prompt orders (replayed): worst / median",
        "",
        "| check | " + " | ".join(cats) + " |",
        "|---" * (len(cats) + 1) + "|",
    ]
    for label, ratios in (("auto / best fixed", vs_best), ("auto / greedy", vs_greedy)):
        cells = [f"{min(ratios[c]):.3f} / {statistics.median(ratios[c]):.3f}" for c in cats]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def drafter_of(results: dict[str, Any]) -> str:
    """The drafter a results.json was made with (its header records the command)."""
    found = re.search(r"--drafter (\S+)", results.get("header", ""))
    return found.group(1) if found else "lookup"  # the script's default


def merge_only(paths: list[str]) -> int:
    """The measured table of several runs' trials together: per prompt, every run's trials."""
    try:
        runs = [json.loads(Path(p).read_text()) for p in paths]
        for path, run in zip(paths, runs, strict=True):
            if not run["times"]["auto"] or not all(run["times"]["auto"]):
                print(f"{path}: no timed trials (made with --trials 0?)", file=sys.stderr)
                return 2
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"cannot merge: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    first = runs[0]
    for path, run in zip(paths[1:], runs[1:], strict=True):
        if run["prompts"] != first["prompts"] or list(run["times"]) != list(first["times"]):
            print(f"{path}: other prompts or strategies than {paths[0]}", file=sys.stderr)
            return 2
        if drafter_of(run) != drafter_of(first):
            print(
                f"{path}: drafter {drafter_of(run)}, {paths[0]}: {drafter_of(first)}",
                file=sys.stderr,
            )
            return 2
    names = list(first["times"])
    prompts = [tuple(p) for p in first["prompts"]]
    cats = categories(cat for cat, _ in prompts) + ["all"]

    def joined(field: str) -> dict[str, list[list[float]]] | None:
        if not all(field in run for run in runs):
            return None  # results.json files before 2026-11-30 21:30 UTC did not keep taus
        return {
            n: [sum((r[field][n][i] for r in runs), []) for i in range(len(prompts))] for n in names
        }

    times = joined("times")
    assert times is not None
    auto_k: dict[str, Counter[int]] = defaultdict(Counter)
    for run in runs:
        for cat, counts in run.get("auto_k", {}).items():
            auto_k[cat].update({int(k): n for k, n in counts.items()})
    speed, checks = summarize(names, cats, prompts, first["tokens"], times, paired=True)
    trials = sum(len(r["times"]["auto"][0]) for r in runs)
    print(f"{trials} trials from {len(runs)} runs: {', '.join(paths)}\n")
    print(render(names, cats, speed, joined("taus"), checks, auto_k))
    if all(run.get("in_loop") for run in runs):
        from dspark_flow.calibration.curves import Curves

        rounds = [r for run in runs for r in loaded_rounds(run)]
        curves = Curves.from_dict(first["curves"])
        print("\n" + loop_report(rounds, curves, greedy_step(times, first["tokens"])))
    return 0


def loaded_rounds(results: dict[str, Any]) -> list[Round]:
    """The decode loop's rounds a results.json keeps ([rows, depth, seconds] each)."""
    return [Round(rows=int(n), depth=int(d), seconds=float(t)) for n, d, t in results["in_loop"]]


def decode_seconds(r: Any) -> float:
    """Time after the first token (prefill is the same for every strategy)."""
    return (r.num_tokens - 1) / r.decode_tokens_per_sec if r.decode_tokens_per_sec > 0 else 0.0


def record_proposals(drafter: Any) -> list[tuple[int, int, bool]]:
    """Log (context length, tokens proposed, whether the drafter's pass ran: not for a copied
    run) of every propose() call of `drafter`."""
    calls: list[tuple[int, int, bool]] = []
    propose = drafter.propose

    def recorded(history: list[int], k: int) -> Any:
        copied = drafter.source(history) == COPY_SOURCE
        draft = propose(history, k)
        calls.append((len(history), draft.count, not copied))
        return draft

    drafter.propose = recorded
    return calls


def model_seconds(
    curves: Any, r: Any, calls: list[tuple[int, int, bool]], prompt_len: int
) -> float:
    """Decode time as the curves predict it: a drafting round verifies n + 1 rows at its depth
    (and runs the drafter unless it copied); a round without a propose() call (plain, or auto
    switched off) verifies one row."""
    secs = sum(curves.round_cost(n, depth, ran) for depth, n, ran in calls)
    plain = max(0, r.num_rounds - len(calls))
    return secs + plain * curves.verify_cost(1, prompt_len + r.num_tokens / 2)


def summarize(
    names: list[str],
    cats: list[str],
    prompts: list[tuple[str, str]],
    tokens: list[int],
    seconds: dict[str, list[list[float]]],
    paired: bool = False,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
    """Tokens per second per category (decode tokens over the sum of per-prompt median times)
    and the goal checks; with `paired` (wall clocks of two trials or more) also the median over
    runs of one strategy's time over auto's on the same prompt in the same trial, which a
    machine's slow phases (they hit both runs of a pair alike) disturb less."""
    speed: dict[str, dict[str, float]] = {}
    for name in names:
        speed[name] = {}
        for cat in cats:
            idx = [i for i, (c, _) in enumerate(prompts) if cat in (c, "all")]
            secs = sum(statistics.median(seconds[name][i]) for i in idx)
            toks = sum(tokens[i] - 1 for i in idx)
            speed[name][cat] = toks / secs if secs > 0 else 0.0
    fixed = [n for n in names if n.startswith("fixed")]
    best = {c: max(fixed, key=lambda n, c=c: speed[n][c]) for c in cats}
    checks = {
        c: {
            "best_fixed": best[c],
            "auto_vs_best_fixed": speed["auto"][c] / speed[best[c]][c],
            "auto_vs_greedy": speed["auto"][c] / speed["greedy"][c],
            "calibrated_vs_best_fixed": speed["calibrated"][c] / speed[best[c]][c],
        }
        for c in cats
    }
    if "auto sticky" in speed:
        for c in cats:
            checks[c]["sticky_vs_best_fixed"] = speed["auto sticky"][c] / speed[best[c]][c]
    if "auto variant" in speed:
        for c in cats:
            checks[c]["variant_vs_best_fixed"] = speed["auto variant"][c] / speed[best[c]][c]
            checks[c]["variant_vs_auto"] = speed["auto variant"][c] / speed["auto"][c]
    if paired and max(len(runs) for runs in seconds["auto"]) > 1:
        for c in cats:
            idx = [i for i, (cat, _) in enumerate(prompts) if c in (cat, "all")]
            for key, other in (("paired_vs_best_fixed", best[c]), ("paired_vs_greedy", "greedy")):
                ratios = [
                    theirs / ours
                    for i in idx
                    for ours, theirs in zip(seconds["auto"][i], seconds[other][i], strict=False)
                    if ours > 0
                ]
                checks[c][key] = statistics.median(ratios) if ratios else float("nan")
    return speed, checks


def render(
    names: list[str],
    cats: list[str],
    speed: dict[str, dict[str, float]],
    taus: dict[str, list[list[float]]] | None,
    checks: dict[str, dict[str, Any]],
    auto_k: dict[str, Counter[int]],
) -> str:
    lines = ["| strategy | " + " | ".join(f"{c} tok/s" for c in cats) + " | mean τ |"]
    lines.append("|---" * (len(cats) + 2) + "|")
    for name in names:
        tau = f"{statistics.mean(statistics.median(t) for t in taus[name]):.2f}" if taus else "n/a"
        cells = [f"{speed[name][c]:.1f}" for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {tau} |")
    lines.append("")
    lines.append("| check | " + " | ".join(cats) + " |")
    lines.append("|---" * (len(cats) + 1) + "|")
    lines.append("| best fixed | " + " | ".join(checks[c]["best_fixed"] for c in cats) + " |")
    for key, label in (
        ("auto_vs_best_fixed", "auto / best fixed (goal >= 0.95)"),
        ("auto_vs_greedy", "auto / greedy (goal >= 0.97)"),
        ("paired_vs_best_fixed", "auto / best fixed, median of paired runs"),
        ("paired_vs_greedy", "auto / greedy, median of paired runs"),
        ("calibrated_vs_best_fixed", "calibrated / best fixed"),
        ("sticky_vs_best_fixed", "auto sticky / best fixed"),
        ("variant_vs_best_fixed", "auto variant / best fixed"),
        ("variant_vs_auto", "auto variant / auto"),
    ):
        if key not in checks[cats[0]]:
            continue
        lines.append(f"| {label} | " + " | ".join(f"{checks[c][key]:.3f}" for c in cats) + " |")
    ks = [", ".join(f"{k}:{n}" for k, n in sorted(auto_k.get(c, Counter()).items())) for c in cats]
    lines.append("| auto's k (k:rounds) | " + " | ".join(ks) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
