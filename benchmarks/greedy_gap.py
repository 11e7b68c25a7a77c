#!/usr/bin/env python3
"""Where plain greedy decoding spends its time against mlx-lm's own: five loops over the same
model, prompts and cache type, interleaved per prompt in one process.

* `ours`: the quick-start pipeline (`Pipeline.generate`, drafter `none`).
* `ours, own stream`: the same inside a dedicated stream, as mlx-lm's `generate_step` runs.
* `bare`: the least a loop can do: forward one token, argmax, bring it to the host.
* `bare, own stream`: the same inside a dedicated stream.
* `bare ahead` (and in its own stream): the next forward built on the lazy token before waiting
  for it, as mlx-lm does.
* `mlx-lm`: `mlx_lm.generate.generate_step` (its own stream, one token ahead, greedy).

    python benchmarks/greedy_gap.py --trials 4
    python3 -P benchmarks/greedy_gap.py --set target.weights=bfloat16   # on a GPU

Prints each loop's median decode tok/s (tokens after the first over the time after it) and its
median per-run ratio to `ours`; checks every loop produced the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import dspark_flow  # noqa: F401  (first: OpenBLAS must bind before mlx.core)
from dspark_flow.bench.prompts import AB_PROMPTS

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [*AB_PROMPTS, "Tell me a long story about a dragon."]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", action="append", default=[], help="recipe overrides")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from dspark_flow import Pipeline

    # No EOS stop: every loop makes exactly max_tokens tokens.
    overrides = [f"stop=[{{kind: max_tokens, limit: {args.max_tokens}}}]", *args.set]
    pipe = Pipeline.from_yaml(REPO / "recipes" / "quickstart.yaml", overrides=overrides)
    pipe.warm_up()
    model, n = pipe.components.model, args.max_tokens
    stream = mx.new_stream(mx.default_device())

    def ours(ids: list[int]) -> tuple[list[int], float]:
        r = pipe.generate(ids)  # token ids go in as they are
        return r.token_ids, r.decode_tokens_per_sec

    def bare(ids: list[int]) -> tuple[list[int], float]:
        cache = make_prompt_cache(model)
        logits = model(mx.array(ids)[None], cache=cache)[0, -1]
        out = [int(mx.argmax(logits).item())]
        t = time.perf_counter()
        while len(out) < n:
            logits = model(mx.array([out[-1]])[None], cache=cache)[0, -1]
            out.append(int(mx.argmax(logits).item()))
        return out, (n - 1) / (time.perf_counter() - t)

    def bare_ahead(ids: list[int]) -> tuple[list[int], float]:
        cache = make_prompt_cache(model)
        token = mx.argmax(model(mx.array(ids)[None], cache=cache)[0, -1])
        mx.async_eval(token)
        out: list[int] = []
        t = 0.0
        while True:
            if len(out) + 1 < n:
                ahead = mx.argmax(model(token.reshape(1, 1), cache=cache)[0, -1])
                mx.async_eval(ahead)
            out.append(int(token.item()))
            if len(out) == 1:
                t = time.perf_counter()
            if len(out) == n:
                return out, (n - 1) / (time.perf_counter() - t)
            token = ahead

    def mlx_lm(ids: list[int]) -> tuple[list[int], float]:
        out: list[int] = []
        t = 0.0
        for token, _ in generate_step(
            mx.array(ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
        ):
            out.append(int(token))
            if len(out) == 1:
                t = time.perf_counter()
        return out, (n - 1) / (time.perf_counter() - t)

    def in_stream(loop: Callable[[list[int]], tuple[list[int], float]]) -> Callable:
        def run(ids: list[int]) -> tuple[list[int], float]:
            with mx.stream(stream):
                return loop(ids)

        return run

    loops = {
        "ours": ours,
        "ours, own stream": in_stream(ours),
        "bare": bare,
        "bare, own stream": in_stream(bare),
        "bare ahead": bare_ahead,
        "bare ahead, own stream": in_stream(bare_ahead),
        "mlx-lm": mlx_lm,
    }
    speed: dict[str, list[float]] = {name: [] for name in loops}
    same = True
    for trial in range(args.trials + 1):  # trial 0 warms every shape up, unrecorded
        for i, prompt in enumerate(PROMPTS):
            ids = pipe.encode_prompt(prompt)
            names = list(loops)
            shift = (trial + i) % len(names)  # drift hits every loop alike
            tokens = {}
            for name in names[shift:] + names[:shift]:
                with contextlib.redirect_stdout(sys.stderr):
                    tokens[name], tps = loops[name](ids)
                if trial:
                    speed[name].append(tps)
            same &= all(t == tokens["ours"] for t in tokens.values())
        print(f"trial {trial} done", file=sys.stderr, flush=True)
    figures = {"overrides": args.set, "same_tokens": same, "loops": {}}
    for name, runs in speed.items():
        ratio = statistics.median(a / b for a, b in zip(runs, speed["ours"], strict=True))
        figures["loops"][name] = {"tok_s": statistics.median(runs), "x_ours": ratio}
        print(f"{name:24s} {statistics.median(runs):8.1f} tok/s  {ratio:.3f}x ours")
    print(f"same tokens: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if same else 3


if __name__ == "__main__":
    sys.exit(main())
