"""What a round that drafts nothing costs in a drafting pipeline, against plain greedy's step.

`auto` drafts nothing where drafting would lose (chat, mostly), so those rounds should cost what
plain decoding does. On the H200's sweep of 2026-12-02 the DSpark pipeline's one-row rounds took
6.85 ms in the loop against 5.46 ms a token for greedy (docs/benchmarks.md §3). This decodes the
same prompts with greedy and with a shipped drafter's pipeline (`--drafter`, DSpark by default)
forced to draft nothing, interleaved, and reports ms per token and the median of the paired
ratios. `--eager-features` adds a pipeline that evaluates the target features the drafter keeps
for its next pass with each round's forward (so the forward's buffers are not held until then).
`--parts` adds the shipped recipe's pipeline (`auto`) and splits each pipeline's rounds by
strategy call: host time per round in each call (the verifier's forward only builds the graph;
the sampler's verify waits for the device), the loop's `mx.async_eval` of a lazy draft, and the
rest of the loop. `--rounds` (with `--parts`) also sums the `auto` pipeline's rounds by kind:
off, probe or planned draft; for a round that runs the drafter's pass, whether it is the
generation's first (it takes in the whole prompt), whether the rows it takes in first exceed
what the drafter's compiled path takes, and whether that row count is new to this pipeline's
timed rounds; each kind against greedy's step and against what the curves charge it (at the
round's own source: a copy without the drafter's pass, which `auto` without
`plan_sources_apart` does charge; no learnt offset), so a loss to greedy can be put on the kind
of round that makes it. Greedy's step is its decode time a round; a kind's time is the sum of
its rounds' own seconds (from the round's start to `observe`), which leaves out the loop's
stop checks. `--variant JSON` adds a second `auto` pipeline with those settings, timed and
summed alike.

    python benchmarks/off_rounds.py --prompts held.jsonl --trials 3 [--parts [--rounds]
        [--variant JSON]] [--drafter dflash]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import dspark_flow  # noqa: F401  (loads OpenBLAS before mlx.core)

CLI_VERIFIER = {
    "kind": "kernels",
    "invariant": True,
    "compile_layers": True,
    "fuse_projections": True,
    "prefer_stock": True,
}


def never_draft(pipe: Any) -> Any:
    """The pipeline's cap picks k = 0 every round (the drafter still gets every feature)."""
    pipe.draft_cap.choose = lambda drafter_max, source="drafter": 0
    return pipe


def eager_features(pipe: Any) -> Any:
    """Evaluate the features the drafter keeps, with the round's forward, instead of at its
    next pass."""
    import mlx.core as mx

    drafter = pipe.drafter
    keep = drafter.after_forward

    def after_forward(committed: int) -> None:
        keep(committed)
        mx.async_eval(drafter._pending[-1])

    drafter.after_forward = after_forward
    return pipe


# The strategy calls a round makes, by slot (only those a pipeline's strategy has are timed).
ROUND_CALLS = {
    "drafter": ("source", "propose", "after_forward", "observe"),
    "draft_cap": ("choose", "observe"),
    "verifier": ("forward",),
    "sampler": ("verify",),
}


# The dict of the pipeline now decoding (None: none is), for the loop's own device calls.
_DECODING: list[dict[str, float] | None] = [None]
LOOP_ASYNC_EVAL = "loop: the draft's async_eval"


def _time_loop_async_eval() -> None:
    """Time the decode loop's `mx.async_eval` of a lazy draft: on CUDA it does most of the
    drafter's device work before it returns (3.25 ms a drafting round on an H200, 2026-12-02),
    which no strategy call's time shows."""
    import time

    from dspark_flow.engine import decode

    mx = decode.mx
    if getattr(decode, "_timed_mx", None) is not None:
        return

    class TimedMx:
        def __getattr__(self, name: str) -> Any:
            return getattr(mx, name)

        @staticmethod
        def async_eval(*arrays: Any) -> None:
            t = time.perf_counter()
            mx.async_eval(*arrays)
            seconds = _DECODING[0]
            if seconds is not None:
                seconds[LOOP_ASYNC_EVAL] = seconds.get(LOOP_ASYNC_EVAL, 0.0) + (
                    time.perf_counter() - t
                )

    decode._timed_mx = decode.mx = TimedMx()  # type: ignore[attr-defined]


def record_round_kinds(
    pipe: Any, log: list[dict[str, Any]], parts: dict[str, float] | None = None
) -> Any:
    """Log each round of `pipe` (an `auto` pipeline) after the prefill: k chosen, tokens
    proposed and accepted, whether the cap was off (a probe is a draft chosen while off),
    seconds, and for a round that ran the drafter's pass the rows it took in first (the rows
    committed since its last pass: the prompt, at a generation's first pass), whether they
    exceed the drafter's compiled path, and whether that count was new to the logged rounds.
    With `parts` (the pipeline's `time_calls` figures, wrapped before this), also each round's
    host seconds per call."""
    cap, drafter = pipe.draft_cap, pipe.drafter
    choose, propose, observe = cap.choose, drafter.propose, cap.observe
    compiled_rows = getattr(getattr(drafter, "model", None), "_compiled_context_rows", 0)
    seen: set[int] = set()
    current: dict[str, Any] = {}
    last_parts: dict[str, float] = dict(parts or {})

    def chosen(drafter_max: Any, source: str = "drafter") -> int:
        k = choose(drafter_max, source)
        current.clear()
        # `auto` keeps the situation it switched off in while off, probes included
        current.update(k=k, off=getattr(cap.current, "off_key", None) is not None)
        return k

    def proposed(history: list[int], k: int) -> Any:
        pending = getattr(drafter, "_pending", [])
        rows = sum(int(p.shape[1]) for p in pending)
        state = getattr(drafter, "_state", None)
        first = state is not None and state.end == 0
        draft = propose(history, k)
        if pending and not getattr(drafter, "_pending", []):  # the drafter's pass took them in
            current.update(
                rows_in=rows,
                new_rows=rows not in seen,
                first=first,
                past_compiled=rows > compiled_rows,
            )
            seen.add(rows)
        return draft

    def observed(proposed_n: int, accepted: int, seconds: float, source: str = "drafter") -> None:
        curves = getattr(cap, "curves", None)  # what the curves charge it, at its depth
        copied = source == "copy"
        charged = curves.round_cost(proposed_n, cap.depth, not copied) if curves else 0.0
        observe(proposed_n, accepted, seconds, source)
        if _DECODING[0] is not None and current:
            entry = {**current, "proposed": proposed_n, "accepted": accepted}
            entry.update(seconds=seconds, source=source)
            entry["charged"] = charged
            if parts is not None:  # this round's calls: the figures' growth since the last
                entry["parts"] = {c: t - last_parts.get(c, 0.0) for c, t in parts.items()}
                last_parts.clear()
                last_parts.update(parts)
            log.append(entry)

    cap.choose, drafter.propose, cap.observe = chosen, proposed, observed
    return pipe


def summarise_round_kinds(log: list[dict[str, Any]], greedy_ms: float) -> dict[str, Any]:
    """Rounds by kind: count, rounds per k chosen, tokens committed, ms per round, and the time
    they took beyond what greedy's step would have taken for the same tokens (ms, summed over
    the rounds)."""
    out: dict[str, Any] = {}

    def kind(r: dict[str, Any]) -> str:
        if r.get("proposed", r["k"]) == 0:  # a k cut to 0 by the token budget drafts nothing
            return "off"
        base = "probe" if r["off"] else "draft"
        if r.get("source") == "copy":
            return f"{base}, copied"
        if r.get("first"):
            return f"{base}, the generation's first pass (the prompt taken in)"
        if "rows_in" not in r:
            return f"{base}, nothing to take in"
        size = "past the compiled rows" if r.get("past_compiled") else "within the compiled rows"
        return f"{base}, {'new' if r.get('new_rows') else 'seen'} row count {size}"

    for r in log:
        entry = out.setdefault(
            kind(r),
            {"rounds": 0, "k": {}, "tokens": 0, "ms": 0.0, "charged_ms": 0.0, "calls_ms": {}},
        )
        entry["rounds"] += 1
        entry["k"][r["k"]] = entry["k"].get(r["k"], 0) + 1
        entry["tokens"] += r["accepted"] + 1
        entry["ms"] += 1000.0 * r["seconds"]
        entry["charged_ms"] += 1000.0 * r.get("charged", 0.0)
        for call, t in r.get("parts", {}).items():
            entry["calls_ms"][call] = entry["calls_ms"].get(call, 0.0) + 1000.0 * t
    for entry in out.values():
        entry["ms_per_round"] = round(entry["ms"] / entry["rounds"], 3)
        entry["ms_beyond_greedy"] = round(entry["ms"] - entry["tokens"] * greedy_ms, 1)
        charged = entry.pop("charged_ms")
        entry["measured_over_charged"] = round(entry["ms"] / charged, 3) if charged else None
        entry["ms"] = round(entry["ms"], 1)
        calls = entry.pop("calls_ms")
        if calls:  # host ms per round in each call
            entry["calls_ms_per_round"] = {
                c: round(t / entry["rounds"], 3) for c, t in calls.items()
            }
    return out


def time_calls(pipe: Any, seconds: dict[str, float]) -> Any:
    """Wrap the pipeline's per-round strategy calls (and the loop's async_eval of a lazy draft)
    so each adds its host time to `seconds`, counting only calls after the prompt's prefill
    (from the first token's sampling on)."""
    import time

    _time_loop_async_eval()

    def timed(label: str, call: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                if _DECODING[0] is seconds:
                    seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - t

        return run

    def marking(call: Any, decoding: bool) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            _DECODING[0] = seconds if decoding else None
            return call(*args, **kwargs)

        return run

    for slot, names in ROUND_CALLS.items():
        strategy = getattr(pipe, slot)
        for name in names:
            if hasattr(strategy, name):
                setattr(strategy, name, timed(f"{slot}.{name}", getattr(strategy, name)))
    pipe.drafter.begin = marking(pipe.drafter.begin, False)  # before the prefill
    pipe.sampler.sample = marking(pipe.sampler.sample, True)  # the first token, after it
    return pipe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of {category, turns}")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--eager-features", action="store_true")
    p.add_argument(
        "--parts", action="store_true", help="add `auto` and split rounds by strategy call"
    )
    p.add_argument(
        "--rounds", action="store_true", help="with --parts: sum the `auto` rounds by kind"
    )
    p.add_argument(
        "--variant",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="with --parts: a second `auto` with these settings, e.g. '{\"off_confidence\": 0.7}'",
    )
    p.add_argument(
        "--drafter", choices=("dspark", "dflash"), default="dspark", help="the shipped drafter"
    )
    p.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)

    from dspark_flow.api import load_target
    from dspark_flow.pipeline import Pipeline

    model, tok = load_target("builtin:smollm2-135m")
    stops = [{"kind": "eos"}, {"kind": "max_tokens", "limit": args.max_tokens}]
    kind = args.drafter
    drafter = {
        "kind": kind,
        "checkpoint": f"builtin:smollm2-135m-{kind}",
        "draft_vocab": 8192,
        "prompt_lookup": True,
    }

    def build(section: dict[str, Any], cap: dict[str, Any] | None = None) -> Any:
        recipe = {"drafter": section, "verifier": CLI_VERIFIER, "stop": stops}
        if section["kind"] != "none":
            recipe["draft_cap"] = cap or {"kind": "fixed", "k": 1}
        return Pipeline.from_dict(recipe, target=(model, tok)).warm_up()

    pipes = {"greedy": build({"kind": "none"}), f"{kind}, k = 0": never_draft(build(drafter))}
    if args.eager_features:
        pipes[f"{kind}, k = 0, eager features"] = eager_features(never_draft(build(drafter)))
    autos = []
    if args.parts:
        autos.append(f"{kind}, auto")
        pipes[autos[-1]] = build(drafter, {"kind": "auto"})
        if args.variant:
            autos.append(f"{kind}, auto {json.dumps(args.variant, sort_keys=True)}")
            pipes[autos[-1]] = build(drafter, {"kind": "auto", **args.variant})
    parts: dict[str, dict[str, float]] = {name: {} for name in pipes}
    rounds: dict[str, int] = dict.fromkeys(pipes, 0)
    decode_s: dict[str, float] = dict.fromkeys(pipes, 0.0)
    prompts = [json.loads(line)["turns"][0] for line in args.prompts.read_text().splitlines()]
    ms: dict[str, list[float]] = {name: [] for name in pipes}
    names = list(pipes)
    round_logs: dict[str, list[dict[str, Any]]] = {name: [] for name in autos}
    outputs: dict[tuple[int, int, str], list[int]] = {}
    for trial in range(args.trials + 1):  # the first pass warms every shape up, untimed
        if trial == 1 and args.parts:
            for name, pipe in pipes.items():
                time_calls(pipe, parts[name])
            if args.rounds:
                for name in autos:
                    record_round_kinds(pipes[name], round_logs[name], parts[name])
        for i, prompt in enumerate(prompts):
            shift = (trial + i) % len(names)
            for name in names[shift:] + names[:shift]:  # rotated: no mode always runs first
                r = pipes[name].generate(prompt, max_new_tokens=args.max_tokens)
                outputs[trial, i, name] = r.token_ids
                if trial > 0 and r.decode_tokens_per_sec > 0:
                    ms[name].append(1000.0 / r.decode_tokens_per_sec)
                    rounds[name] += r.num_rounds
                    decode_s[name] += (r.num_tokens - 1) / r.decode_tokens_per_sec
    report: dict[str, Any] = {}
    for name, values in ms.items():
        pairs = [b / a for a, b in zip(ms["greedy"], values, strict=True)]
        same = all(
            ids == outputs[t, i, "greedy"] for (t, i, n), ids in outputs.items() if n == name
        )
        report[name] = {
            "ms_per_token": round(statistics.median(values), 3),
            "paired_ratio_to_greedy": round(statistics.median(pairs), 3),
            "outputs_equal_to_greedy": same,
        }
        print(
            f"{name}: {report[name]['ms_per_token']} ms/token (median), "
            f"{report[name]['paired_ratio_to_greedy']} of greedy's (median of pairs); "
            f"outputs equal to greedy's: {'yes' if same else 'NO'}"
        )
        if args.parts and rounds[name]:
            # The first round's prefill and sampling are outside the decode time; the loop's
            # share is what the timed calls leave of it (stops, text, bookkeeping).
            per_round = {call: 1000.0 * s / rounds[name] for call, s in parts[name].items()}
            per_round["round"] = 1000.0 * decode_s[name] / rounds[name]
            per_round["rest of the loop"] = per_round["round"] - sum(
                v for call, v in per_round.items() if call != "round"
            )
            report[name]["ms_per_round"] = {k: round(v, 4) for k, v in per_round.items()}
            print("  " + ", ".join(f"{k} {v:.3f}" for k, v in per_round.items()))
    greedy_ms = 1000.0 * decode_s["greedy"] / max(rounds["greedy"], 1)
    for auto, log in round_logs.items():
        if not log:
            continue
        report[auto]["rounds by kind"] = summarise_round_kinds(log, greedy_ms)
        print(f"{auto}: rounds by kind (greedy's step {greedy_ms:.3f} ms):")
        for name, entry in report[auto]["rounds by kind"].items():
            print(f"  {name}: {entry}")
    if args.out:
        args.out.write_text(json.dumps({"prompts": len(prompts), **report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
