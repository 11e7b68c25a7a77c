"""`bench()`: the whole benchmark in one call - plan, run, summarise, write - for the CLI and for
Python callers (who may pass ready `Pipeline`s, e.g. with custom strategy objects)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark_flow.bench.prompts import (
    BenchPrompt,
    first_per_category,
    load_prompts,
    select_categories,
)
from dspark_flow.bench.runner import BenchConfig, Progress
from dspark_flow.errors import DsparkFlowError

MISMATCH_EXIT = 3


@dataclass
class BenchOutcome:
    data: dict[str, Any]
    files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. plots skipped

    @property
    def mismatches(self) -> list[dict[str, Any]]:
        return self.data.get("mismatches", [])


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a bench's trials: still a KeyboardInterrupt, carrying the report of the
    prompts every mode finished (written out first when the bench was given a folder)."""

    def __init__(self, outcome: BenchOutcome):
        super().__init__("bench interrupted")
        self.outcome = outcome


def write_outputs(
    data: dict[str, Any], out_dir: Path, plots: bool = True, whole_or_nothing: bool = False
) -> BenchOutcome:
    """bench.json, bench.md and (with matplotlib) the PNGs, from a complete results dict.

    Everything is rendered into a scratch folder first and moved in only once all of it
    rendered. A fresh run (`whole_or_nothing` false) saves bench.json before rendering anything,
    so a rendering bug cannot lose its results (`--from-json` renders them again); re-rendering
    a saved file (`whole_or_nothing`) replaces nothing unless every output rendered."""
    import shutil
    import tempfile

    from dspark_flow.bench import plots as plotting
    from dspark_flow.bench.report import json_text, render_markdown
    from dspark_flow.files import write_text_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    outcome = BenchOutcome(data)
    if not whole_or_nothing:
        outcome.files.append(write_text_atomic(json_text(data), out_dir / "bench.json"))
    scratch = Path(tempfile.mkdtemp(prefix=".render-", dir=out_dir))
    try:
        staged = [write_text_atomic(render_markdown(data), scratch / "bench.md")]
        if whole_or_nothing:
            staged.append(write_text_atomic(json_text(data), scratch / "bench.json"))
        if plots:
            if plotting.available():
                staged += plotting.make_plots(data, scratch)
            else:
                outcome.notes.append(plotting.MISSING)
        for path in staged:
            os.replace(path, out_dir / path.name)
            outcome.files.append(out_dir / path.name)
        # A figure of an earlier report in this folder that this one did not draw would sit
        # beside the new numbers as if it showed them.
        for name in set(plotting.FIGURES) - {path.name for path in staged}:
            (out_dir / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return outcome


def bench(
    recipes: Sequence[str | Path | Any],
    prompts: Sequence[str | Path] | Sequence[BenchPrompt] = (),
    *,
    config: BenchConfig | None = None,
    limit: int | None = None,
    categories: Sequence[str] = (),
    overrides: Sequence[str] = (),
    mlx_lm: bool = True,
    out_dir: str | Path | None = None,
    plots: bool = True,
    command: str = "",
    progress: Progress | None = None,
) -> BenchOutcome:
    """Run `recipes` (files or ready Pipelines) and the baselines on `prompts` (files, ready
    BenchPrompts, or nothing for the shipped set); write the report when `out_dir` is given."""
    cfg = config or BenchConfig()
    if cfg.trials < 1 or cfg.max_tokens < 1:
        raise DsparkFlowError("trials and max tokens must be at least 1")
    if cfg.warmup_trials < 0:
        raise DsparkFlowError("warm-up trials cannot be negative")
    if limit is not None and limit < 1:
        raise DsparkFlowError("--limit must be at least 1")
    if not recipes:
        raise DsparkFlowError("name at least one recipe")
    # Prompts first: a bad prompts file should fail before minutes of model loading.
    if isinstance(prompts, (str, Path)):  # one file, not its characters
        prompts = [prompts]
    ready = [p for p in prompts if isinstance(p, BenchPrompt)]
    files = [p for p in prompts if not isinstance(p, BenchPrompt)]
    if ready and files:
        raise DsparkFlowError("prompts: give prompt files or BenchPrompts, not a mix of both")
    items = first_per_category(ready, limit) if ready else load_prompts(files, limit)
    items = select_categories(items, categories)

    from dspark_flow.bench.plan import add_spec_baselines, plan_recipes
    from dspark_flow.bench.report import collect_meta, load_avg
    from dspark_flow.bench.runner import run_bench
    from dspark_flow.bench.summary import summarize

    groups = plan_recipes(recipes, overrides, mlx_lm=mlx_lm)
    if mlx_lm:
        for group in groups:
            for mode in group.modes:
                if mode.pipeline is not None:
                    mode.pipeline.warm_up()  # loads draft models, which mlx-lm-spec shares
            add_spec_baselines(group)
    targets = [{"label": g.label, "weight_format": g.weight_format} for g in groups]
    meta = collect_meta(targets, command)
    results = run_bench(groups, items, cfg, progress)
    data = {
        "meta": meta,
        "runs": results["runs"],
        "summary": summarize(results["runs"]),
        "mismatches": results["mismatches"],
        "verify_cost": results["verify_cost"],
    }
    data["meta"]["config"] = {
        "trials": cfg.trials,
        "warmup_trials": cfg.warmup_trials,
        "max_tokens": cfg.max_tokens,
        "prompts": len(items),
        "modes": [f"{m.name} ({g.label})" for g in groups for m in g.modes],
    }
    data["meta"]["load_avg_end"] = load_avg()
    interrupted = bool(results.get("interrupted"))
    if interrupted:  # Ctrl-C: the prompts finished so far, said so everywhere
        done = len({(r["prompt_id"], r["trial"]) for r in results["runs"]})
        data["meta"]["interrupted"] = (
            f"stopped by the user after {done} of {cfg.trials * len(items)} prompt runs; "
            "no verify cost curve"
        )
    outcome = BenchOutcome(data) if out_dir is None else write_outputs(data, Path(out_dir), plots)
    if interrupted:
        outcome.notes.append(f"interrupted: {data['meta']['interrupted']}")
        raise BenchInterrupted(outcome)
    return outcome
