"""What overlapping the host with the device would buy plain greedy decoding.

The decode loop syncs every round: it reads the round's token on the host (`.item()`) before
it builds the next forward's graph, so the host's graph building and the device's work take
turns. mlx-lm's `generate_step` does not: it builds and launches step n + 1 on step n's lazy
token, then reads step n's, so the two overlap. On the H200 the product's greedy ran at about
0.8 of mlx-lm's stock greedy speed (the shipped DSpark card: 1.76x of greedy through the same
verifier, 1.39x of mlx-lm's stock greedy), and its rounds spend 2.5 ms of host time building the
graph (docs/benchmarks.md §3, "Where a round's time goes on the H200").

This decodes the same prompts three ways, interleaved, and reports ms a token (median over
prompts and trials) and the median of per-prompt ratios to the product's greedy:
- `greedy`: the product's greedy pipeline (the CLI's verifier stack, no drafter);
- `pipelined`: the same components (model, verifier forward, KV cache), each step launched on
  the previous step's lazy argmax before that token is read;
- `mlx-lm`: mlx-lm's `stream_generate` with an argmax sampler, MLX's stock layers.
Tokens are checked against the product's greedy (the pipelined loop runs the same forwards, so
they must be equal; mlx-lm's stock kernels may round differently, so it is reported, not
required).

    python benchmarks/pipelined_greedy.py --prompts held.jsonl --trials 3 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
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


def pipelined_greedy(pipe: Any, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy decoding on the pipeline's own components, each step launched before the
    previous token is read. Returns (tokens, decode seconds after the first token)."""
    import mlx.core as mx

    from dspark_flow.engine.decode import _prefill

    c = pipe.components
    eos = set(getattr(c.tokenizer, "eos_token_ids", None) or [])
    cache, logits, _ = _prefill(c, prompt_ids)
    token = mx.argmax(logits, axis=-1)  # lazy: token 0
    tokens: list[int] = []
    t_first: float | None = None
    while True:
        # Launch the step after this token on the lazy token itself, then read it: the host
        # builds the next graph while the device still computes this one.
        nxt = None
        if len(tokens) + 1 < max_tokens:
            nxt = mx.argmax(c.verifier.forward(c.model, token.reshape(1), cache)[-1], axis=-1)
            mx.async_eval(nxt)
        value = int(token.item())
        if t_first is None:
            t_first = time.perf_counter()
        if value in eos:  # dropped, as the product's eos rule does
            break
        tokens.append(value)
        if nxt is None:
            break
        token = nxt
    return tokens, time.perf_counter() - (t_first or time.perf_counter())


def mlx_lm_greedy(
    model: Any, tok: Any, prompt_ids: list[int], max_tokens: int
) -> tuple[list[int], float]:
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    tokens: list[int] = []
    t_first = None
    for resp in stream_generate(
        model,
        tok,
        mx.array(prompt_ids, dtype=mx.uint32),
        max_tokens,
        sampler=lambda lp: mx.argmax(lp, axis=-1),
    ):
        if t_first is None:
            t_first = time.perf_counter()
        if resp.finish_reason == "stop":
            break
        tokens.append(int(resp.token))
    return tokens, time.perf_counter() - (t_first or time.perf_counter())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of {category, turns}")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)

    from mlx_lm import load as mlx_lm_load

    from dspark_flow.api import load_target
    from dspark_flow.models.loading import resolve_model_path
    from dspark_flow.pipeline import Pipeline

    model, tok = load_target("builtin:smollm2-135m")
    stops = [{"kind": "eos"}, {"kind": "max_tokens", "limit": args.max_tokens}]
    recipe = {"drafter": {"kind": "none"}, "verifier": CLI_VERIFIER, "stop": stops}
    pipe = Pipeline.from_dict(recipe, target=(model, tok)).warm_up()
    stock_model, stock_tok = mlx_lm_load(str(resolve_model_path("builtin:smollm2-135m")))
    prompts = [json.loads(line)["turns"][0] for line in args.prompts.read_text().splitlines()]
    ids = [pipe.encode_prompt(text) for text in prompts]

    def run(name: str, i: int) -> tuple[list[int], float]:
        if name == "greedy":
            r = pipe.generate(prompts[i], max_new_tokens=args.max_tokens)
            return r.token_ids, (r.num_tokens - 1) / r.decode_tokens_per_sec
        if name == "pipelined":
            return pipelined_greedy(pipe, ids[i], args.max_tokens)
        return mlx_lm_greedy(stock_model, stock_tok, ids[i], args.max_tokens)

    names = ["greedy", "pipelined", "mlx-lm"]
    ms: dict[str, list[list[float]]] = {n: [[] for _ in prompts] for n in names}
    same: dict[str, list[bool]] = {n: [] for n in names}
    for trial in range(args.trials + 1):  # the first pass warms every shape up, untimed
        for i in range(len(prompts)):
            shift = (trial + i) % len(names)
            got: dict[str, list[int]] = {}
            for name in names[shift:] + names[:shift]:
                tokens, seconds = run(name, i)
                got[name] = tokens
                if trial > 0 and len(tokens) > 1:
                    ms[name][i].append(1000.0 * seconds / (len(tokens) - 1))
            for name in names:
                same[name].append(got[name] == got["greedy"])
    report: dict[str, Any] = {"trials": args.trials, "max_tokens": args.max_tokens}
    for name in names:
        per_prompt = [statistics.median(v) for v in ms[name] if v]
        ratios = [
            statistics.median(g) / statistics.median(v)
            for v, g in zip(ms[name], ms["greedy"], strict=True)
            if v and g
        ]
        report[name] = {
            "ms_per_token": round(statistics.median(per_prompt), 3),
            "speed_over_greedy": round(statistics.median(ratios), 3),
            "outputs_equal_greedy": all(same[name]),
        }
        print(
            f"{name}: {report[name]['ms_per_token']} ms/token, "
            f"{report[name]['speed_over_greedy']}x greedy's speed (median of per-prompt "
            f"ratios); outputs equal to greedy's: {report[name]['outputs_equal_greedy']}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
