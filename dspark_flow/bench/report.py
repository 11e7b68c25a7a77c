"""bench.json and bench.md: the meta lines (where and with what it ran), the runs, the summary.

bench.json = {"meta": {...}, "runs": [...], "summary": [...], "mismatches": [...],
"verify_cost": [...]}; bench.md is rendered from that dict alone, so it can be re-rendered from a
bench.json measured elsewhere (`dspark-flow bench --from-json`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from dspark_flow.bench.summary import ALL

SCHEMA_VERSION = 1


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def collect_meta(targets: list[dict[str, str]], command: str) -> dict[str, Any]:
    """Everything a reader needs to know to trust (or reproduce) the numbers."""
    import mlx.core as mx

    from dspark_flow import __version__
    from dspark_flow.models.backend import backend_name, blas_status

    backend = backend_name()
    device_info: dict[str, Any] = getattr(mx, "device_info", lambda: {})()
    formats = sorted({t["weight_format"] for t in targets})
    meta: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "machine": f"{platform.system()} {platform.machine()} ({platform.platform()})",
        "cpu": f"{_cpu_name()}, {os.cpu_count()} logical cores",
        "backend": backend,
        "device": device_info.get("device_name"),
        "mlx_version": getattr(mx, "__version__", _version("mlx")),
        "mlx_lm_version": _version("mlx-lm"),
        "dspark_flow_version": __version__,
        "weight_format": ", ".join(formats),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "python": platform.python_version(),
        "targets": targets,
        # Other processes skew timings on a shared machine: keep the evidence with the numbers.
        "load_avg_start": load_avg(),
    }
    if backend == "cpu":
        meta["blas"] = "OpenBLAS" if blas_status().get("active") else "reference BLAS (slow)"
    return meta


def json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def load_json(path: str | Path) -> dict[str, Any]:
    from dspark_flow.errors import DsparkFlowError

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DsparkFlowError(f"cannot read bench results {path}: {e}") from e
    if not isinstance(data, dict) or not {"meta", "runs", "summary"} <= set(data):
        raise DsparkFlowError(f"{path} is not a bench.json (needs meta, runs and summary)")
    meta = data["meta"]
    if isinstance(meta, dict) and "schema" in meta and meta["schema"] != SCHEMA_VERSION:
        # a later version's fields would fail deep in the rendering, named as a Python error
        raise DsparkFlowError(
            f"{path} is bench.json format {meta['schema']!r}; this version renders format "
            f"{SCHEMA_VERSION}"
        )
    if data["runs"] == []:
        raise DsparkFlowError(f"{path} holds no runs: nothing to render")
    return data


# -- Markdown ----------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cell(stat: dict[str, float | None], digits: int = 1, scale: float = 1.0) -> str:
    med, lo, hi = (None if (v := stat[k]) is None else v * scale for k in ("median", "min", "max"))
    if med is None:
        return "-"
    if lo == hi:
        return _num(med, digits)
    return f"{_num(med, digits)} ({_num(lo, digits)}–{_num(hi, digits)})"


def _speedup(row: dict[str, Any], base: str | None) -> str:
    s = row["speedup"].get(base) if base else None
    if not s:
        return ""
    d = s["decode"]
    cell = f"{_num(d['ratio_of_medians'], 2)}× / {_num(d['median_of_ratios'], 2)}×"
    if "ratio_of_totals" in d:  # (absent from a bench.json written before it existed)
        cell += f" / {_num(d['ratio_of_totals'], 2)}×"
    return cell


def _spec_pair(row: dict[str, Any], baselines: list[str]) -> str | None:
    """The mlx-lm speculative baseline that mirrors this recipe, if any."""
    name = f"mlx-lm-spec[{row['mode']}]"
    return name if name in baselines else None


def summary_table(summary: list[dict[str, Any]]) -> list[str]:
    targets = list(dict.fromkeys(r["target"] for r in summary))
    many = len(targets) > 1
    head = ["category", "mode"] + (["target"] if many else [])
    head += ["decode tok/s", "end-to-end tok/s", "TTFT ms", "τ (mean accepted)", "tokens"]
    head += ["peak MB", "× greedy", "× mlx-lm", "× mlx-lm spec", "output = greedy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    categories = list(dict.fromkeys(r["category"] for r in summary))
    for category in categories:
        for row in (r for r in summary if r["category"] == category):
            baselines = [
                r["mode"] for r in summary if r["target"] == row["target"] and r["baseline"]
            ]
            checked = row.get("checked", 0)
            same = (
                "-"
                if not checked
                else ("yes" if not row["mismatches"] else f"**NO ({row['mismatches']}/{checked})**")
            )
            cells = [category if category != ALL else "**all**", row["mode"]]
            cells += [row["target"]] if many else []
            cells += [
                _cell(row["decode_tok_s"]),
                _cell(row["e2e_tok_s"]),
                _cell(row["ttft_s"], 0, 1000.0),
                _cell(row["mean_accept_len"], 2),
                _cell(row["num_tokens"], 0),
                _num(row["peak_memory_mb"]["median"], 0),
                _speedup(row, "greedy"),
                _speedup(row, "mlx-lm"),
                _speedup(row, _spec_pair(row, baselines)),
                same,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def verify_table(curves: list[dict[str, Any]]) -> list[str]:
    if not curves:
        return []
    ks = sorted({c["k"] for c in curves})
    shown = [k for k in ks if k in (1, 2, 4, 8, 12, 16)] or ks
    lines = [
        "## Verify cost: one target forward of K new tokens (median ms)",
        "",
        "| target | context | " + " | ".join(f"K={k}" for k in shown) + " | K=max / K=1 |",
        "|" + "---|" * (len(shown) + 3),
    ]
    for target in dict.fromkeys(c["target"] for c in curves):
        rows = {c["k"]: c for c in curves if c["target"] == target}
        ratio = (
            rows[ks[-1]]["median_ms"] / rows[ks[0]]["median_ms"]
            if rows[ks[0]]["median_ms"]
            else None
        )
        ctx = rows[ks[0]]["context"]
        cells = [_num(rows[k]["median_ms"], 1) for k in shown]
        lines.append(f"| {target} | {ctx} | " + " | ".join(cells) + f" | {_num(ratio, 2)} |")
    return lines + [""]


def mismatch_lines(mismatches: list[dict[str, Any]]) -> list[str]:
    if not mismatches:
        return []
    lines = [
        f"## ⚠ OUTPUT MISMATCHES: {len(mismatches)} run(s) differ from greedy at T=0",
        "",
        "A lossless mode must reproduce the greedy baseline token for token. These did not:",
        "",
    ]
    for m in mismatches:
        lines.append(
            f"- **{m['mode']}** on `{m['prompt_id']}` (trial {m['trial'] + 1}, {m['target']}): "
            f"first difference at token {m['first_difference']} "
            f"(greedy {m['expected_tokens']} tokens, this {m['got_tokens']}); "
            f"greedy {json.dumps(m['expected_text'])} vs {json.dumps(m['got_text'])}"
        )
    return lines + [""]


def render_markdown(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = ["# dspark-flow bench", ""]
    keys: tuple[str, ...] = (
        "interrupted",
        "date",
        "command",
        "machine",
        "cpu",
        "device",
        "backend",
        "blas",
    )
    keys += ("weight_format",)
    keys += ("load_avg_start", "load_avg_end")
    keys += ("mlx_version", "mlx_lm_version", "dspark_flow_version")
    lines += [f"- {k}: `{meta[k]}`" for k in keys if meta.get(k) is not None]
    runs = data.get("runs", [])
    if runs:
        trials = len({r["trial"] for r in runs})
        prompts = len({r["prompt_id"] for r in runs})
        lines.append(f"- {prompts} prompts × {trials} trials; figures are median (min–max)")
    lines += [
        "- × columns: decode speedup, ratio of medians / median of per-prompt ratios / ratio "
        "of total times (the whole prompt set; robust where speeds fall in clusters); τ counts "
        "tokens per target forward (our loop: after the first token; mlx-lm: every round)",
        "- end-to-end tok/s is the like-for-like figure across loops: they may charge work such "
        "as a draft model's prompt prefill to TTFT or to decode differently",
        "",
    ]
    lines += mismatch_lines(data.get("mismatches", []))
    lines += ["## Speed per mode and category", ""] + summary_table(data["summary"]) + [""]
    lines += verify_table(data.get("verify_cost", []))
    return "\n".join(lines)
