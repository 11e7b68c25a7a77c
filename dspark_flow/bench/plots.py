"""PNG figures from a bench.json dict. matplotlib is the optional extra `plot`; it is imported
only here, so a bench without it still writes bench.json and bench.md (and the figures can be
drawn later from that bench.json: `dspark-flow bench --from-json bench.json --out DIR`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark_flow.bench.summary import ALL
from dspark_flow.errors import DsparkFlowError

MISSING = "matplotlib is not installed: plots skipped (pip install 'dspark-flow[plot]')"
# Every figure a report may hold (a run writes those its data has).
FIGURES = ("speed.png", "acceptance.png", "verify_cost.png")


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise DsparkFlowError(MISSING) from e
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def speed_chart(data: dict[str, Any], path: Path) -> Path:
    """Decode tok/s per mode (bars) and category (groups), median with min-max whiskers."""
    plt = _pyplot()
    summary = data["summary"]
    targets = list(dict.fromkeys(r["target"] for r in summary))
    fig, axes = plt.subplots(len(targets), 1, figsize=(10, 4.2 * len(targets)), squeeze=False)
    for ax, target in zip(axes[:, 0], targets, strict=True):
        rows = [r for r in summary if r["target"] == target]
        cats = list(dict.fromkeys(r["category"] for r in rows))
        modes = list(dict.fromkeys(r["mode"] for r in rows))
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            xs: list[float] = []
            meds: list[float] = []
            errs: list[list[float]] = [[], []]
            for j, cat in enumerate(cats):
                row = next((r for r in rows if r["mode"] == mode and r["category"] == cat), None)
                stat = row["decode_tok_s"] if row else None
                if not stat or stat["median"] is None:
                    continue
                xs.append(j + (i - (len(modes) - 1) / 2) * width)
                meds.append(stat["median"])
                errs[0].append(stat["median"] - stat["min"])
                errs[1].append(stat["max"] - stat["median"])
            ax.bar(xs, meds, width, yerr=errs, capsize=2, label=mode)
        ax.set_xticks(range(len(cats)), [c if c != ALL else "all" for c in cats])
        ax.set_ylabel("decode tokens/s")
        ax.set_title(target)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=min(len(modes), 4))
    fig.suptitle("Decode speed per mode and category (median, min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance_histogram(data: dict[str, Any], path: Path) -> Path | None:
    """Tokens committed per verify round, per speculative mode (plain modes are always 1)."""
    plt = _pyplot()
    per_mode: dict[str, list[int]] = {}
    for r in data["runs"]:
        lengths = r.get("accept_lengths") or []
        if r["kind"] == "mlx_lm" or (r["mode"] == "greedy" and r["baseline"]):
            continue
        per_mode.setdefault(r["mode"], []).extend(lengths)
    per_mode = {m: v for m, v in per_mode.items() if v and max(v) > 1}
    if not per_mode:
        return None
    top = max(max(v) for v in per_mode.values())
    width = 0.8 / len(per_mode)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (mode, lengths) in enumerate(per_mode.items()):
        # Side-by-side bars rather than overlaid histograms: several modes stay readable.
        shares = [lengths.count(n) / len(lengths) for n in range(1, top + 1)]
        xs = [n + (i - (len(per_mode) - 1) / 2) * width for n in range(1, top + 1)]
        mean = sum(lengths) / len(lengths)
        ax.bar(xs, shares, width, label=f"{mode} (τ={mean:.2f}, {len(lengths)} rounds)")
    ax.set_xticks(range(1, top + 1))
    ax.set_xlabel("tokens committed per target forward (accepted drafts + 1)")
    ax.set_ylabel("share of rounds")
    ax.set_title("Acceptance length")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def verify_cost_chart(data: dict[str, Any], path: Path) -> Path | None:
    """ms per target forward against K: the flatter, the more a K-token draft can pay."""
    plt = _pyplot()
    curves = data.get("verify_cost") or []
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target in dict.fromkeys(c["target"] for c in curves):
        rows = sorted((c for c in curves if c["target"] == target), key=lambda c: c["k"])
        ctx = rows[0]["context"]
        ax.plot(
            [c["k"] for c in rows],
            [c["median_ms"] for c in rows],
            marker="o",
            label=f"{target}, context {ctx}",
        )
    ax.set_xlabel("K (new tokens in one forward)")
    ax.set_ylabel("ms per forward (median)")
    ax.set_ylim(bottom=0)
    ax.set_title("Verify cost")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(data: dict[str, Any], out_dir: Path) -> list[Path]:
    """All figures into `out_dir`; raises DsparkFlowError(MISSING) without matplotlib."""
    _pyplot()
    speed, acceptance, verify_cost = (out_dir / name for name in FIGURES)
    made = [
        speed_chart(data, speed),
        acceptance_histogram(data, acceptance),
        verify_cost_chart(data, verify_cost),
    ]
    return [p for p in made if p is not None]
