"""`dspark-flow train RECIPE`: data -> train -> export -> evaluate, each stage resumable.

The `vocab` stage (also part of export) counts the answer tokens of the training data and writes
the drafter's draft vocabulary (`draft_vocab.npy`, dspark_flow/models/draft_vocab.py).

The frozen target is loaded once (float32 on CPU, bfloat16 on GPUs) and serves both data
generation and training; evaluation loads it again in the product's runtime format (what users
decode with), so the τ it reports is the τ they get.
"""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_flow.errors import DsparkFlowError
from dspark_flow.files import write_atomic, write_text_atomic
from dspark_flow.log import get_logger
from dspark_flow.training.recipe import TrainRecipe, check_against_target

if TYPE_CHECKING:
    from dspark_flow.training.data import DataWorker

log = get_logger(__name__)
STAGES = ("data", "train", "export", "eval")  # the default run; export writes the vocab too
# The training settings the model card states, recorded by the call that trains.
CARD_TRAIN_SETTINGS = {
    "batch_size",
    "anchors_per_seq",
    "seq_len",
    "lr",
    "warmup_steps",
    "min_lr_ratio",
    "grad_clip",
    "dtype",
    "bias_correction",
}


def legacy_optimizer_note(device: str) -> str:
    """For weights whose record lacks the optimizer's settings (recorded since 2026-12-04):
    before commit 2e18193 (2026-12-04 11:05 UTC) AdamW had no bias correction, and a GPU kept
    the weights and state in bfloat16 (a CPU in float32)."""
    gpu = not device.startswith("cpu")
    sets = "--set train.bias_correction=false"
    if gpu:
        sets = "--set train.dtype=bfloat16 " + sets
    then = (
        "a GPU kept the drafter's weights and AdamW state in bfloat16, without bias correction"
        if gpu
        else "AdamW ran without bias correction"
    )
    return (
        "The optimizer's settings were not recorded with these weights. If they were trained "
        f"before 2026-12-04 11:05 UTC (commit 2e18193), when {then}, add `{sets}` to each "
        "`train` command below to reproduce them (without it the commands train with float32 "
        "state and bias-corrected AdamW; docs/training.md)."
    )


# The data settings the model card states, recorded by the call that makes the data.
CARD_DATA_SETTINGS = {
    "prompts",
    "temperature",
    "max_new_tokens",
    "self_prompt_temperature",
    "self_prompt_starts",
}
SUMMARY = "train_summary.json"
# What an evaluation adds to a summary (figures that belong to the weights evaluated)
EVAL_KEYS = ("eval", "eval_device", "eval_command")


def device_name() -> str:
    import mlx.core as mx

    from dspark_flow.models.backend import backend_name, mlx_version

    backend = backend_name()
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else {}
    except Exception:  # device_info is backend-specific; a name is a nicety
        info = {}
    name = (
        info.get("device_name")
        or info.get("architecture")
        or platform.processor()
        or platform.machine()
    )
    return f"{backend} ({name}, mlx {mlx_version()})"


def run_training(
    recipe: TrainRecipe,
    *,
    stages: tuple[str, ...] = STAGES,
    fresh: bool = False,
    progress: bool = True,
    command: str | None = None,
    time_limit: float | None = None,
    data_worker: str | None = None,
    replace: bool = False,
) -> dict[str, Any]:
    """Run the named stages; returns a summary (also written as train_summary.json).

    With `time_limit` (seconds from the start of this call) training pauses at a checkpoint
    once past it, and the later stages wait for a rerun, which resumes where it paused.
    `data_worker` 'I/N' makes only share I of N of the data (one process per GPU) and stops.
    `replace` lets export replace a drafter another recipe exported in `output`."""
    from dspark_flow.models.loading import load
    from dspark_flow.training.data import require_extra_data, training_samples
    from dspark_flow.training.recipe import check_output
    from dspark_flow.training.trainer import DrafterTrainer, training_weight_format, work_dir
    from dspark_flow.training.warm_start import check_init_from

    t_start = time.perf_counter()
    worker = check_call(recipe, stages, data_worker)
    if {"train", "export", "vocab"} & set(stages):  # before hours of work, not after
        check_output(recipe, "recipe " + recipe.name, replace)
        for folder in (work_dir(recipe), work_dir(recipe) / "checkpoints"):
            if folder.exists() and not folder.is_dir():
                raise DsparkFlowError(
                    f"{folder} is a file where this recipe keeps its checkpoints: move it"
                )
    summary: dict[str, Any] = {"recipe": recipe.name, "device": device_name(), "command": command}
    target, tok = load(
        recipe.target.model, training_weight_format(recipe.target.weights), recipe.target.revision
    )
    check_against_target(recipe, target)  # a drafter that cannot fit fails before any work
    trainer = DrafterTrainer(recipe, progress=progress)
    if "train" in stages and (fresh or trainer.latest_checkpoint() is None):
        # A new drafter's warm start must be there before hours of data making, not after.
        check_init_from(recipe)
    if "train" in stages:
        require_extra_data(recipe)  # (the same: before this recipe's own data is made)
    out = recipe.output_dir()
    # Stages run in separate calls (data and training on a GPU, evaluation elsewhere, training
    # paused by time limits) add to one summary: keep what earlier runs recorded. The work dir's
    # copy is written by every call; the output's only once the drafter is exported there.
    running = work_dir(recipe) / SUMMARY
    # Evaluating a drafter trained elsewhere: its own summary is the record. An export writes
    # this recipe's checkpoints, whose record is the work dir's.
    producing = "data" in stages or "train" in stages
    shipped = _read_record(out / SUMMARY)
    previous = (_read_record(running) or shipped) if producing or "export" in stages else shipped
    samples: list[Any] | None = None
    if producing:
        samples = _data_stage(recipe, target, tok, stages, worker, progress, summary, previous)
        if samples is None:  # one data worker's share: the whole set may not be there yet
            return summary
        if recipe.train.extra_data and {"train", "export", "vocab"} & set(stages):
            samples, extra = training_samples(recipe, samples)
            summary["data"] = {**summary["data"], "extra": extra}
            log.info("extra data", samples_in_all=len(samples), sets=extra)
    interrupted = False
    if "train" in stages:
        assert samples is not None
        deadline = t_start + time_limit if time_limit is not None else None
        previous, interrupted = _train_stage(
            trainer, target, tok, samples, fresh, deadline, summary, previous
        )
    if summary.get("train", {}).get("paused") or interrupted:
        log.info(
            f"training {'interrupted' if interrupted else 'paused by the time limit'}: run the "
            "same command again to resume" + (" (without --fresh)" if fresh else ""),
            step=summary["train"]["steps"],
            of=recipe.train.steps,
        )
        later = ("export", "eval", "vocab") if interrupted else ("export", "eval")
        stages = tuple(s for s in stages if s not in later)
    if "export" in stages:
        _export_stage(trainer, target, tok, replace, summary, previous)
    if "export" in stages or "vocab" in stages:
        if samples is None:
            try:
                samples = training_samples(recipe)[0]
            except DsparkFlowError:
                if "vocab" in stages:
                    raise
                log.warning("no training data here: the draft vocabulary was not recounted")
        if samples is not None:
            floats = work_dir(recipe) / "float"
            dirs = (out, floats) if (floats / "config.json").is_file() else (out,)
            summary["vocab"] = write_vocab(target, samples, dirs)
    if "export" in stages:
        from dspark_flow.training.export import size_mb

        summary["size_mb"] = round(size_mb(out), 2)
    if "eval" in stages and recipe.eval.prompts:
        del target  # evaluation loads the target again, in the runtime's format
        _eval_stage(recipe, progress, command, summary)
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    summary = _record_call(recipe, stages, summary, previous, producing)
    if interrupted:  # Ctrl-C: the step, its checkpoint and this call's record are saved
        raise KeyboardInterrupt
    return summary


def _data_stage(
    recipe: TrainRecipe,
    target: Any,
    tok: Any,
    stages: tuple[str, ...],
    worker: DataWorker,
    progress: bool,
    summary: dict[str, Any],
    previous: dict[str, Any],
) -> list[Any] | None:
    """The training samples, made where the data stage runs or the set is incomplete (None: a
    data worker made its share, and the set is sealed by a later call); records `data`."""
    from dspark_flow.training.data import build_dataset, data_cache_dir, data_shares, load_samples

    t0 = time.perf_counter()
    cache = data_cache_dir(recipe)
    try:
        samples = load_samples(cache)
        complete_before = True
    except DsparkFlowError:
        complete_before = False
    # A train-only run uses complete data as it is; the data stage checks and finishes it.
    if "data" in stages or not complete_before:
        cache = build_dataset(recipe, target, tok, progress=progress, worker=worker)
        if worker.count > 1:
            summary["data"] = {
                "worker": str(worker),
                "cache": str(cache),
                "seconds": round(time.perf_counter() - t0, 1),
                "device": summary["device"],
            }
            return None
        samples = load_samples(cache)
    summary["data"] = {
        # The card is written again by later calls (eval, export), whose --set overrides may
        # differ: it reads what made the data and the drafter from here.
        "self_prompts": recipe.data.self_prompts,
        "settings": recipe.data.model_dump(mode="json", include=CARD_DATA_SETTINGS),
        "samples": len(samples),
        "tokens": int(sum(len(s.tokens) for s in samples)),
        "answer_tokens": int(sum(len(s.tokens) - s.prompt_len for s in samples)),
        "seconds": round(time.perf_counter() - t0, 1),
        "cache": str(cache),
        "device": summary["device"],
    }
    if shares := data_shares(cache):  # made by data workers: their figures, not this call's
        summary["data"]["shares"] = shares
    before = previous.get("data", {})
    same = before.get("cache") == str(cache) and before.get("samples") == len(samples)
    if complete_before and same:
        summary["data"] = before  # the run that generated the data keeps its figures
    log.info("data ready", **summary["data"])
    return samples


def _train_stage(
    trainer: Any,
    target: Any,
    tok: Any,
    samples: list[Any],
    fresh: bool,
    deadline: float | None,
    summary: dict[str, Any],
    previous: dict[str, Any],
) -> tuple[dict[str, Any], bool]:
    """Train (resuming unless `fresh`) until done, paused by `deadline` or interrupted; records
    `train`. Returns the earlier record (cleared for a new drafter) and whether Ctrl-C stopped
    it (recorded by the caller, then raised)."""
    recipe = trainer.recipe
    trainer.warm_up(target, tok)
    if not fresh and trainer.resume():
        summary["resumed_from_step"] = trainer.step
    resumed_from = trainer.step
    if not resumed_from:  # a new drafter: what was recorded about an earlier one is stale
        previous = {k: v for k, v in previous.items() if k in ("recipe", "data")}
        if recipe.train.init_from:  # before --fresh clears: a start that fails loses nothing
            trainer.start_from_init()
    if fresh:
        trainer.clear_checkpoints()
    t0 = time.perf_counter()
    result = trainer.train(samples, deadline=deadline)
    summary["train"] = {
        "steps": result.step,
        "paused": result.paused,
        "seconds": round(time.perf_counter() - t0, 1),
        "calls": 1,
        "last": result.last,
        "checkpoints": str(trainer.checkpoints),
        "device": summary["device"],
        "command": summary["command"],
        "settings": recipe.train.model_dump(mode="json", include=CARD_TRAIN_SETTINGS),
        "drafter": recipe.drafter.model_dump(mode="json"),  # the checkpoints' architecture
    }
    if trainer.started_from:
        summary["train"]["init_from"] = trainer.started_from
    # Training spread over calls (time limits, preemption): add this call to the earlier ones;
    # a call with nothing left to train leaves their record as it is.
    before = previous.get("train", {})
    # (a call killed between checkpoints wrote no record: its steps count in the next one)
    if resumed_from and 0 < before.get("steps", 0) <= resumed_from:
        if result.step == resumed_from:
            summary["train"] = {**before, "paused": result.paused}
        else:
            summary["train"]["seconds"] = round(
                before.get("seconds", 0.0) + summary["train"]["seconds"], 1
            )
            summary["train"]["calls"] = before.get("calls", 1) + 1
    return previous, result.interrupted


def _export_stage(
    trainer: Any,
    target: Any,
    tok: Any,
    replace: bool,
    summary: dict[str, Any],
    previous: dict[str, Any],
) -> None:
    """Write the newest checkpoint's drafter (as shipped, and unquantized to the work dir) and
    its record at once."""
    from dspark_flow.models.draft_vocab import VOCAB_FILE
    from dspark_flow.training.export import size_mb
    from dspark_flow.training.trainer import work_dir

    recipe = trainer.recipe
    out = recipe.output_dir()
    if trainer.model is None:
        trainer.warm_up(target, tok)
    summary["exported_step"] = trainer.load_weights_from()
    summary["export"] = recipe.export.model_dump(mode="json")
    # Export replaces the directory: keep the draft vocabulary (recounted after it if it can be).
    kept = (out / VOCAB_FILE).read_bytes() if (out / VOCAB_FILE).is_file() else None
    trainer.export(work_dir(recipe) / "float", quantize=None)
    trainer.export(out, replace=replace)
    if kept is not None:
        write_atomic(out / VOCAB_FILE, lambda f: f.write(kept))
    # The export replaced the card and the summary with the folder: record the new weights at
    # once (without the old weights' evaluation), so that a failure or Ctrl-C in the stages
    # after it leaves no drafter without its record. The end of the call rewrites it.
    exported = {**previous, **summary, "size_mb": round(size_mb(out), 2)}
    _write_record(recipe, out, {k: v for k, v in exported.items() if k not in EVAL_KEYS})


def _eval_stage(
    recipe: TrainRecipe, progress: bool, command: str | None, summary: dict[str, Any]
) -> None:
    """τ of the exported drafter (and its unquantized twin) on the eval prompts, with the target
    in the runtime's format; records `eval`."""
    from dspark_flow.models.loading import load
    from dspark_flow.training.evaluate import evaluate_drafter, format_eval
    from dspark_flow.training.trainer import work_dir

    out = recipe.output_dir()
    if not (out / "config.json").is_file():
        raise DsparkFlowError(f"nothing to evaluate: {out} has no drafter (run the train stage)")
    runtime, rtok = load(recipe.target.model, "auto", recipe.target.revision)
    summary["eval"] = {}
    summary["eval_device"], summary["eval_command"] = summary["device"], command
    for label, path in (("shipped", out), ("float", work_dir(recipe) / "float")):
        if (path / "config.json").is_file():
            summary["eval"][label] = evaluate_drafter(
                runtime,
                rtok,
                path,
                recipe.eval.prompts,
                max_new_tokens=recipe.eval.max_new_tokens,
                progress=progress,
                system=recipe.data.system,  # the context the drafter was trained in
            )
            print(f"{label} ({path}):\n{format_eval(summary['eval'][label])}", file=sys.stderr)


def _read_record(path: Path) -> dict[str, Any]:
    """A summary this tool wrote; {} (rebuilt by this call) when it is missing, torn, or holds
    sections of the wrong shape (it is a record, not an input: never a reason to fail)."""
    from dspark_flow.training.data import read_json_object

    record = read_json_object(path)
    sections_ok = all(isinstance(record.get(k, {}), dict) for k in ("data", "train", "vocab"))
    train = record.get("train", {}) if sections_ok else {}
    numbers_ok = all(
        isinstance(train.get(k, 0), int | float) and not isinstance(train.get(k, 0), bool)
        for k in ("steps", "seconds", "calls")
    )
    if sections_ok and numbers_ok:
        return record
    log.warning("summary of the wrong shape: rebuilt", path=str(path))
    return {}


def _record_call(
    recipe: TrainRecipe,
    stages: tuple[str, ...],
    summary: dict[str, Any],
    previous: dict[str, Any],
    producing: bool,
) -> dict[str, Any]:
    """Write this call's record into the work dir's summary and, where it exported or evaluated
    the drafter there, the output's; returns the merged summary."""
    from dspark_flow.training.export import exported_by
    from dspark_flow.training.trainer import work_dir

    out = recipe.output_dir()
    running = work_dir(recipe) / SUMMARY
    # A call that trains nothing (vocab, export, eval) adds to each record its own: the work
    # dir's (a run perhaps still in progress) and the output's (the drafter shipped there).
    own_running = {} if producing else _read_record(running)
    evaluated = "eval" in summary  # by this call (an eval stage without prompts evaluates nothing)
    running_record = {**(own_running or previous), **summary}
    summary = {**previous, **summary}
    if "export" in stages and not evaluated:  # new weights: the old figures are not theirs
        for key in EVAL_KEYS:
            running_record.pop(key, None)
            summary.pop(key, None)
    running_text = json.dumps(running_record, indent=2) + "\n"
    # Someone else's drafter evaluated (a hub download, another recipe's; the stages that
    # write into `output` refuse one): its figures are printed and returned, and neither its
    # card nor this recipe's records take them.
    if not producing and (out / "config.json").is_file() and exported_by(out) != recipe.name:
        log.info("results not recorded: not a drafter this recipe exported", output=str(out))
        return summary
    try:
        running.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(running_text, running)
    except OSError as exc:  # the summary is a record, not a result: never fail the run for it
        log.warning("could not write the running summary", path=str(running), error=str(exc))
    # The output's copy describes the drafter in it: only a call that exported or evaluated
    # it may rewrite it (a paused or data-only call must not relabel older weights).
    # A vocab call records its count with the drafter it belongs to (when there is one).
    recount = "vocab" in stages and (out / "config.json").is_file()
    if out.is_dir() and ("export" in stages or "eval" in stages or recount):
        _write_record(recipe, out, summary)
    return summary


def check_call(recipe: TrainRecipe, stages: tuple[str, ...], data_worker: str | None) -> DataWorker:
    """What a call asks for that cannot run, in one line before anything loads (`--check`
    too); returns the data worker it names."""
    from dspark_flow.training.data import DataWorker

    worker = DataWorker.parse(data_worker) if data_worker is not None else DataWorker()
    if worker.count > 1 and set(stages) != {"data"}:
        raise DsparkFlowError("a data worker (I/N) runs the data stage only: add --stage data")
    if set(stages) == {"eval"} and not recipe.eval.prompts:  # nothing to do, nothing recorded
        raise DsparkFlowError("--stage eval: the recipe names no eval.prompts to evaluate on")
    return worker


def _write_record(recipe: TrainRecipe, out: Path, summary: dict[str, Any]) -> None:
    """The drafter's train_summary.json and, from it, its model card."""
    write_text_atomic(json.dumps(summary, indent=2) + "\n", out / SUMMARY)
    write_card(recipe, out)


def write_vocab(target: Any, samples: list[Any], dirs: tuple[Path, ...]) -> dict[str, Any]:
    """Count the samples' answer tokens and write the draft vocabulary into each of `dirs`."""
    from dspark_flow.models.draft_vocab import count_answer_tokens, coverage, write_draft_vocab
    from dspark_flow.models.taps import target_vocab_size

    counts = count_answer_tokens(samples, target_vocab_size(target))
    paths = [write_draft_vocab(d, counts) for d in dirs]
    record = {
        "file": str(paths[0]),  # the drafter directory's copy (dirs[0]), the one users load
        "answer_tokens": int(counts.sum()),
        "distinct": int((counts > 0).sum()),
        "coverage": coverage(counts),  # share of the answer tokens inside the top N
    }
    log.info("draft vocabulary written", **record)
    return record


def _starts_text(starts: list[str]) -> str:
    """How the self-written user turns began, for the card ('' for free prompts only)."""
    if not any(starts):  # free prompts only, as before starts existed
        return ""
    counts = Counter(starts)
    said = ", ".join(
        (json.dumps(s).replace("`", "\\`") if s else "free") + (f" x{n}" if n > 1 else "")
        for s, n in counts.items()
    )  # (backticks escaped: the card is Markdown)
    return f"; each batch's user turns begun in turn as: {said}"


def _lineage(start: dict[str, Any] | None) -> list[str]:
    """Card lines for a warm start: where training began, down to the first drafter."""
    lines: list[str] = []
    while start:
        added = start.get("added_layers") or 0
        lead = "That one started from" if lines else "Started from"  # each line its parent
        lines.append(
            f"{lead} `{Path(start.get('path', '?')).name}` (weights sha256 "
            f"{str(start.get('weights_sha256', '?'))[:16]}...: {start.get('layers', '?')} layers, "
            f"{start.get('steps', '?')} steps of recipe {start.get('recipe') or '?'})"
            + (f", {added} layers added (starting as identity)." if added else ".")
        )
        start = start.get("init_from")
    return ["", *lines] if lines else []


def _export_from_config(out: Path) -> dict[str, Any]:
    """The export format as the drafter's config.json states it (records from before the
    export settings were recorded); {} when there is no readable config."""
    from dspark_flow.models.drafter_loading import QUANT_GROUP
    from dspark_flow.training.data import read_json_object

    config = read_json_object(out / "config.json")
    if not config:
        return {}
    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q:  # a missing group size means what the loader reads
        return {"quantize": q["bits"], "group_size": q.get("group_size", QUANT_GROUP)}
    return {"quantize": None}


def _extra_data_text(extra: list[dict[str, Any]]) -> list[str]:
    if not extra:
        return []
    sets = "; ".join(
        f"`{e.get('recipe', '?')}` ({e.get('samples', '?')} samples, "
        f"{e.get('repeats_left_out', 0)} repeated prompts left out)"
        for e in extra
    )
    return ["", f"Trained also on the data sets of {sets} (`train.extra_data`)."]


def write_card(recipe: TrainRecipe, out: Path) -> None:
    """The model card (README.md) from out/train_summary.json: what was trained, on what, how
    long, and what it reaches."""
    from dspark_flow.training.evaluate import format_eval

    summary = json.loads((out / SUMMARY).read_text())
    prev = out / "README.md"
    data = summary.get("data") or {}
    train = summary.get("train") or {}
    ev = summary.get("eval") or {}
    # What the producing calls recorded wins over this call's recipe (its overrides may differ;
    # records written before a setting was recorded fall back to the recipe).
    self_prompts = data.get("self_prompts", recipe.data.self_prompts)
    d = recipe.data.model_copy(update=data.get("settings") or {})
    a = recipe.drafter.model_copy(update=train.get("drafter") or {})
    recorded = train.get("settings") or {}
    t = recipe.train.model_copy(update=recorded)
    x = recipe.export.model_copy(update=summary.get("export") or _export_from_config(out))
    legacy = bool(train.get("steps")) and "bias_correction" not in recorded
    optimizer = (
        ""
        if legacy
        else f"; {'float32' if t.dtype == 'auto' else t.dtype} weights and state, "
        + ("bias-corrected" if t.bias_correction else "no bias correction")
    )
    shipped_as = (
        f"Shipped with matrices at {x.quantize}-bit (group {x.group_size}), "
        if x.quantize
        else f"Shipped unquantized ({x.dtype}), "
    ) + f"{summary.get('size_mb', '?')} MB."
    prompts = [p if isinstance(p, dict) else p.model_dump(mode="json") for p in d.prompts]
    files = "\n".join(
        f"- `{Path(p['path']).name}`"
        + (f" lines {p['lines']}" if p.get("lines") else "")
        + (f" (at most {p['limit']})" if p.get("limit") else "")
        for p in prompts
    )
    parts = [
        f"# {recipe.name}",
        "",
        f"A {a.kind} drafter for `{recipe.target.model}`, trained by `dspark-flow train`.",
        "",
        "## Architecture",
        f"{a.num_layers} layers, block {a.block_size} ({a.drafts_per_round} drafts per round), taps at target layers "
        f"{a.target_layer_ids}, Markov rank {a.markov_rank}, confidence head {'on' if a.confidence_head else 'off'}. "
        + shipped_as,
        "",
        "## Data (self-distilled)",
        f"The target answered these prompts with its own chat template at temperature {d.temperature} "
        f"(at most {d.max_new_tokens} new tokens), plus {self_prompts} prompts it wrote itself (Magpie-style, "
        f"temperature {d.self_prompt_temperature}{_starts_text(d.self_prompt_starts)}):",
        files or "- (no prompt files: only the prompts it wrote)",
        "",
        f"Samples: {data.get('samples', '?')}, tokens: {data.get('tokens', '?')} (answers: {data.get('answer_tokens', '?')}).",
        *_extra_data_text(data.get("extra") or []),
        "",
        "## Training",
        f"{train.get('steps', '?')} steps of {t.batch_size} sequences x {t.anchors_per_seq} blocks "
        f"(sequence length {t.seq_len}), AdamW lr {t.lr} (warmup {t.warmup_steps}, cosine "
        f"to {t.min_lr_ratio}x{optimizer}), clip {t.grad_clip}; {train.get('seconds', '?')} s on {train.get('device', '?')}.",
        *_lineage(train.get("init_from")),
        "",
        "## Acceptance (greedy, full block, held-out prompts, the product's own loop)",
        "",
        f"Measured on {summary.get('eval_device', '?')}; 'float' is the same drafter unquantized.",
    ]
    if summary.get("notes"):
        parts += ["", *(f"- {note}" for note in summary["notes"])]
    for label, rows in ev.items():
        parts += ["", f"{label}:", "", format_eval(rows)]
    vocab = summary.get("vocab") or {}
    if vocab and (out / "draft_vocab.npy").is_file():
        cover = ", ".join(f"{n}: {100 * c:.1f}%" for n, c in vocab.get("coverage", {}).items())
        parts += [
            "",
            "## Draft vocabulary",
            f"`draft_vocab.npy`: token ids by frequency among the {vocab.get('answer_tokens', '?')} "
            f"answer tokens ({vocab.get('distinct', '?')} distinct); share of them in the top N: "
            f"{cover}. Drafter setting `draft_vocab: N` drafts among the top N only (lossless).",
        ]
    parts += ["", "## Reproduce"]
    if legacy:
        parts.append(legacy_optimizer_note(str(train.get("device", ""))))
    parts.append("```")
    parts.append(train.get("command") or f"dspark-flow train {shlex.quote(recipe.name)}.yaml")
    if summary.get("eval_command") and summary.get("eval_command") != train.get("command"):
        parts.append(summary["eval_command"])
    parts += ["```", ""]
    write_text_atomic("\n".join(parts), prev)
