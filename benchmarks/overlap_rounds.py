"""What overlapping consecutive plain rounds buys: the decode loop with and without it.

A plain round (k = 0) whose next round is plain too launches that round's forward on its own
lazy token before reading it (`dspark_flow.engine.decode.OVERLAP_PLAIN_ROUNDS`), so the host's
graph building overlaps the device's work, as in mlx-lm's `generate_step`. Greedy pipelines
qualify every round; `auto` in its off stretches. This decodes the same prompts with, in turn:
- `greedy, read first` and `greedy`: the product's greedy pipeline (the CLI's verifier stack,
  no drafter) without and with the overlap;
- `auto, read first` and `auto`: the shipped drafter's pipeline (`--drafter`) with `auto`,
  without and with it;
- `mlx-lm`: mlx-lm's `stream_generate`, argmax, MLX's stock layers (not the same kernels, so
  its tokens may differ; reported, not required).
Modes rotate per prompt and trial (none always runs first); a first pass is untimed. Figures:
ms a token (median over prompts and trials) and, per category, the median of per-prompt
ratios of time a token to `greedy, read first`'s. Every product mode's tokens must equal greedy's.

    python benchmarks/overlap_rounds.py --prompts held.jsonl --trials 2 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import dspark_flow  # noqa: F401  (loads OpenBLAS before mlx.core)

BASE = "greedy, read first"


def mlx_lm_ms(
    model: Any, tok: Any, prompt_ids: list[int], max_tokens: int
) -> tuple[list[int], float]:
    """mlx-lm's greedy: (tokens, ms a token after the first)."""
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
    seconds = time.perf_counter() - (t_first or time.perf_counter())
    return tokens, 1000.0 * seconds / max(len(tokens) - 1, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of {category, turns}")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--drafter", choices=("dspark", "dflash"), default="dspark")
    p.add_argument("--no-mlx-lm", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)

    from dspark_flow.api import load_target
    from dspark_flow.engine import decode
    from dspark_flow.models.loading import resolve_model_path
    from dspark_flow.pipeline import Pipeline
    from dspark_flow.recipe.schema import TOOL_DEFAULTS

    model, tok = load_target("builtin:smollm2-135m")
    stops = [{"kind": "eos"}, {"kind": "max_tokens", "limit": args.max_tokens}]
    drafter = {
        "kind": args.drafter,
        "checkpoint": f"builtin:smollm2-135m-{args.drafter}",
        "draft_vocab": 8192,
        "prompt_lookup": True,
    }

    def build(section: dict[str, Any]) -> Any:
        verifier = TOOL_DEFAULTS["verifier"]  # the CLI's stack
        recipe: dict[str, Any] = {"drafter": section, "verifier": verifier, "stop": stops}
        if section["kind"] != "none":
            recipe["draft_cap"] = {"kind": "auto"}
        return Pipeline.from_dict(recipe, target=(model, tok)).warm_up()

    greedy, auto = build({"kind": "none"}), build(drafter)
    modes: dict[str, tuple[Any, bool]] = {
        BASE: (greedy, False),
        "greedy": (greedy, True),
        "auto, read first": (auto, False),
        "auto": (auto, True),
    }
    stock = None
    if not args.no_mlx_lm:
        from mlx_lm import load as mlx_lm_load

        stock = mlx_lm_load(str(resolve_model_path("builtin:smollm2-135m")))
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] for r in rows]
    cats = [r.get("category", "all") for r in rows]
    ids = [greedy.encode_prompt(text) for text in prompts]
    names = list(modes) + (["mlx-lm"] if stock else [])
    ms: dict[str, list[list[float]]] = {n: [[] for _ in prompts] for n in names}
    equal: dict[str, bool] = dict.fromkeys(names, True)

    def run(name: str, i: int) -> tuple[list[int], float]:
        if name == "mlx-lm":
            return mlx_lm_ms(stock[0], stock[1], ids[i], args.max_tokens)
        pipe, overlap = modes[name]
        decode.OVERLAP_PLAIN_ROUNDS = overlap
        r = pipe.generate(prompts[i], max_new_tokens=args.max_tokens)
        return r.token_ids, 1000.0 / r.decode_tokens_per_sec if r.decode_tokens_per_sec else 0.0

    for trial in range(args.trials + 1):  # the first pass warms every shape up, untimed
        for i in range(len(prompts)):
            shift = (trial + i) % len(names)
            got: dict[str, list[int]] = {}
            for name in names[shift:] + names[:shift]:
                got[name], one = run(name, i)
                if trial > 0 and one > 0:
                    ms[name][i].append(one)
            for name in names:
                equal[name] = equal[name] and got[name] == got[BASE]
        print(f"pass {trial} done", flush=True)
    decode.OVERLAP_PLAIN_ROUNDS = None  # the backend's default again

    report: dict[str, Any] = {
        "trials": args.trials,
        "max_tokens": args.max_tokens,
        "drafter": args.drafter,
        "prompts": len(prompts),
        "modes": {},
    }
    groups = sorted(set(cats)) + ["all"]
    for name in names:
        per_prompt = [statistics.median(v) for v in ms[name] if v]
        ratios: dict[str, float] = {}
        for group in groups:
            pairs = [
                statistics.median(v) / statistics.median(b)
                for v, b, c in zip(ms[name], ms[BASE], cats, strict=True)
                if v and b and group in (c, "all")
            ]
            if pairs:
                ratios[group] = round(statistics.median(pairs), 3)
        report["modes"][name] = {
            "ms_per_token": round(statistics.median(per_prompt), 3) if per_prompt else None,
            "time_over_read_first_greedy": ratios,
            "outputs_equal_greedy": equal[name],
        }
        print(
            f"{name}: {report['modes'][name]['ms_per_token']} ms/token; time a token over "
            f"'{BASE}' (median of per-prompt ratios) {ratios}; outputs equal to greedy's: "
            f"{equal[name]}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
