#!/usr/bin/env python3
"""A/B of a boolean recipe option, by default compiled verify layers (`verifier.compile_layers`):
plain greedy and speculative decoding, each with the option off and on, on one loaded target,
interleaved in one process.

    python benchmarks/compile_ab.py --cap "{kind: fixed, k: 5}"
    python3 -P benchmarks/compile_ab.py --set verifier="{kind: kernels, invariant: true}"  # GPU
    python3 -P benchmarks/compile_ab.py --option verifier.prefer_stock \
        --set verifier="{kind: kernels, invariant: true, compile_layers: true}"  # GPU

Prints decode tok/s medians of the four pipelines, the median per-run ratio on / off for greedy
and for speculation, and checks that all four committed the same tokens (the option must not
change a value). Side by side in one run: these machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import dspark_flow  # noqa: F401  (first: OpenBLAS must bind before mlx.core)
from dspark_flow.bench.prompts import AB_PROMPTS, load_prompts

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [*AB_PROMPTS, "Explain what a hash table is to a new programmer."]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "dspark.yaml"))
    p.add_argument("--cap", default="{kind: fixed, k: 5}", help="the draft_cap section")
    p.add_argument("--option", default="verifier.compile_layers", help="the boolean to A/B")
    p.add_argument("--set", action="append", default=[], help="more recipe overrides")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument(
        "--prompts",
        metavar="JSONL",
        help="prompts instead of the four built in (a bench prompt file, e.g. "
        "heldout_prompts.py's: each record's first turn)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = p.parse_args(argv)
    prompts = [bp.text for bp in load_prompts([args.prompts])] if args.prompts else PROMPTS

    from dspark_flow import Pipeline

    # No EOS stop: every run makes exactly max_tokens tokens.
    base = [f"draft_cap={args.cap}", f"stop=[{{kind: max_tokens, limit: {args.max_tokens}}}]"]
    base += args.set
    arms: dict[str, Any] = {}
    target = None  # loaded by the first arm, shared by the others
    for mode in ("greedy", "spec"):
        for on in (False, True):
            extra = [f"{args.option}={str(on).lower()}"]
            if mode == "greedy":
                extra.append("drafter={kind: none}")
            pipe = Pipeline.from_yaml(args.recipe, overrides=base + extra, target=target)
            arms[f"{mode} {'on' if on else 'off'}"] = pipe.warm_up()
            target = (pipe.components.model, pipe.components.tokenizer)
    names = list(arms)
    speed: dict[str, list[float]] = {n: [] for n in names}
    same = True
    for trial in range(args.trials + 1):  # trial 0 warms every shape up, unrecorded
        for i, prompt in enumerate(prompts):
            shift = (trial + i) % len(names)  # drift hits every arm alike
            tokens = {}
            for name in names[shift:] + names[:shift]:
                result = arms[name].generate(prompt)
                tokens[name] = result.token_ids
                if trial:
                    speed[name].append(result.decode_tokens_per_sec)
            same &= all(t == tokens[names[0]] for t in tokens.values())
        print(f"trial {trial} done", file=sys.stderr, flush=True)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(speed[a], speed[b], strict=True))

    figures = {
        "option": args.option,
        "cap": args.cap,
        "overrides": args.set,
        "tok_s": {n: statistics.median(v) for n, v in speed.items()},
        "greedy_on_off": ratio("greedy on", "greedy off"),
        "spec_on_off": ratio("spec on", "spec off"),
        "spec_greedy_off": ratio("spec off", "greedy off"),
        "spec_greedy_on": ratio("spec on", "greedy on"),
        "runs": len(speed[names[0]]),
        "same_tokens": same,
    }
    for n in names:
        print(f"{n:12s} {figures['tok_s'][n]:8.1f} tok/s")
    print(
        f"{args.option} on/off (median per-run ratio over {figures['runs']} runs): greedy "
        f"{figures['greedy_on_off']:.3f}, spec {figures['spec_on_off']:.3f}; spec/greedy off "
        f"{figures['spec_greedy_off']:.3f}, on {figures['spec_greedy_on']:.3f}; "
        f"same tokens: {same}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if same else 3


if __name__ == "__main__":
    sys.exit(main())
