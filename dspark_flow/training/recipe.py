"""The training recipe: pydantic models (`extra="forbid"`), loaded with the same one-line,
position-carrying errors as decoding recipes (`dspark_flow.recipe.load`).

Checks that need the target (drafter width vs target width, tap ids vs depth) run in
`check_against_target`, still before any data is generated or step taken.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dspark_flow.errors import ConfigError, RecipeError
from dspark_flow.recipe.schema import DEFAULT_MODEL, WeightFormat
from dspark_flow.recipe.section import Section

_LINES = re.compile(r"^\s*(\d+)?\s*-\s*(\d+)?\s*$")


class TrainTarget(Section):
    model: str = Field(DEFAULT_MODEL, description="builtin:<name>, hub repo id or local dir")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) to pin")
    weights: WeightFormat = Field(
        "auto",
        description="format the frozen target runs in while training: auto = float32 on CPU, "
        "bfloat16 on GPUs (fast batched forward; 4-bit MLX matmuls grow with rows)",
    )


class PromptFile(Section):
    path: str = Field(description="JSONL file: {'turns': [...]} or {'prompt': ...} per line")
    lines: str | None = Field(
        None, description="1-based inclusive line range, e.g. '1-1000' or '1001-' (default: all)"
    )
    limit: int | None = Field(None, ge=1, description="use at most this many prompts")
    category: str | None = Field(None, description="label for per-category evaluation")

    @field_validator("lines")
    @classmethod
    def _range(cls, value: str | None) -> str | None:
        if value is None:
            return value
        m = _LINES.match(value)
        if not m or not (m.group(1) or m.group(2)):
            raise ValueError(f"lines {value!r}: expected 'A-B', 'A-' or '-B' (1-based)")
        lo, hi = int(m.group(1) or 1), int(m.group(2) or 10**12)
        if lo < 1 or hi < lo:
            raise ValueError(f"lines {value!r}: empty or non-positive range")
        return value

    def line_range(self) -> tuple[int, int]:
        """0-based [start, stop) over the file's non-empty lines."""
        if self.lines is None:
            return 0, 10**12
        m = _LINES.match(self.lines)
        assert m is not None
        return int(m.group(1) or 1) - 1, int(m.group(2) or 10**12)


class DrafterArch(Section):
    kind: Literal["dspark", "dflash"] = Field("dspark", description="which drafter to train")
    block_size: int = Field(
        7, description="DSpark: drafts per round; DFlash: block incl. the anchor (block-1 drafts)"
    )
    num_layers: int = Field(3, ge=1, le=16, description="the drafter's decoder layers")
    target_layer_ids: list[int] = Field(
        default_factory=lambda: [1, 8, 15, 22, 29],
        description="target layers whose outputs feed the drafter (-1: the embedding output)",
    )
    hidden_size: int | None = Field(
        None, description="must equal the target's width when set (default: the target's)"
    )
    intermediate_size: int | None = Field(None, ge=1, description="default: the target's")
    num_heads: int | None = Field(None, ge=1, description="default: the target's")
    num_kv_heads: int | None = Field(None, ge=1, description="default: the target's")
    head_dim: int | None = Field(None, ge=1, description="default: the target's")
    mask_token_id: int | None = Field(None, ge=0, description="default: the tokenizer's pad/unk")
    markov_rank: int = Field(0, ge=0, description="DSpark: low-rank Markov head (0: off)")
    markov_head_type: Literal["vanilla", "gated"] = Field(
        "vanilla", description="training supports the per-slot heads (rnn: not yet)"
    )
    confidence_head: bool = Field(True, description="DSpark: train the acceptance predictor")

    @field_validator("block_size")
    @classmethod
    def _block(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"block_size must be at least 1, got {value}")
        if value > 64:
            raise ValueError(f"block_size {value} is larger than 64")
        return value

    @field_validator("target_layer_ids")
    @classmethod
    def _taps(cls, value: list[int]) -> list[int]:
        if not value:
            raise ValueError("target_layer_ids must name at least one layer")
        if any(b <= a for a, b in zip(value, value[1:], strict=False)):
            raise ValueError(f"target_layer_ids {value} must be strictly increasing")
        if value[0] < -1:
            raise ValueError("target_layer_ids: -1 (embedding output) is the smallest id")
        return value

    @model_validator(mode="after")
    def _kind_rules(self) -> DrafterArch:
        if self.kind == "dflash":
            if self.block_size < 2:
                raise ValueError("dflash block_size must be at least 2 (slot 0 is the anchor)")
            if self.markov_rank or self.confidence_head:
                # Only DSpark checkpoints carry these heads; keep the recipe honest.
                self.markov_rank, self.confidence_head = 0, False
        return self

    @property
    def drafts_per_round(self) -> int:
        return self.block_size - (1 if self.kind == "dflash" else 0)


class DataSpec(Section):
    prompts: list[PromptFile] = Field(
        default_factory=list, description="prompt files the target answers (self-distillation)"
    )
    self_prompts: int = Field(
        0, ge=0, description="prompts the target writes itself (Magpie-style) on top of the files"
    )
    self_prompt_starts: list[str] = Field(
        default_factory=lambda: [""],
        min_length=1,
        description="how self-written user turns begin, one per batch in turn ('' = free); "
        "steers Magpie toward the kinds of request the drafter will serve",
    )
    self_prompt_temperature: float = Field(
        1.0, gt=0.0, description="temperature at which the target writes its own prompts"
    )
    self_prompt_max_tokens: int = Field(96, ge=8, description="longest self-written prompt")
    temperature: float = Field(0.0, ge=0.0, description="temperature of the target's answers")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="nucleus for sampled answers/prompts")
    max_prompt_tokens: int = Field(
        384, ge=8, description="prompts longer than this (chat template included) are left out"
    )
    max_new_tokens: int = Field(384, ge=8, description="longest answer the target writes")
    batch_size: int = Field(64, ge=1, description="sequences generated side by side")
    system: str | None = Field(None, description="system message for the chat template")
    cache_dir: str | None = Field(
        None, description="where samples are cached (default: <home>/train/<name>/data)"
    )
    seed: int = Field(0, ge=0, lt=2**63, description="same seed, same data")

    @field_validator("self_prompt_starts")
    @classmethod
    def _starts_end_cleanly(cls, starts: list[str]) -> list[str]:
        # A start ending in a space leaves the model to continue after a lone space token,
        # which its tokenizer would never have produced there: out-of-distribution prompts.
        for start in starts:
            if start != start.rstrip(" \t"):
                raise ValueError(f"self prompt start {start!r} ends in a space; drop it")
        return starts

    @model_validator(mode="after")
    def _some_prompts(self) -> DataSpec:
        if not self.prompts and not self.self_prompts:
            raise ValueError("data needs prompt files or self_prompts > 0")
        return self


class LossSpec(Section):
    ce: float = Field(1.0, ge=0.0, description="cross entropy on the target's tokens")
    l1: float = Field(
        1.0, ge=0.0, description="DSpark: L1 distance of the drafter's and target's distributions"
    )
    confidence: float = Field(0.5, ge=0.0, description="DSpark: BCE of the confidence head")
    decay_gamma: float | None = Field(
        None, gt=0.0, description="position decay exp(-j/gamma) (default: DSpark 4, DFlash 7)"
    )


class TrainSpec(Section):
    steps: int = Field(1000, ge=1, description="optimizer steps in all (a resumed run included)")
    batch_size: int = Field(16, ge=1, description="sequences per step")
    seq_len: int = Field(512, ge=16, description="sequences are cut/padded to this many tokens")
    anchors_per_seq: int = Field(
        32, ge=1, description="blocks sampled per sequence per step (at most seq_len)"
    )
    lr: float = Field(6e-4, gt=0.0, description="AdamW's peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine decays to lr * this")
    warmup_steps: int = Field(50, ge=0, description="linear warmup from lr / 100 to lr")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW's decoupled weight decay")
    grad_clip: float = Field(1.0, gt=0.0, description="gradients are clipped to this global norm")
    bias_correction: bool = Field(
        True,
        description="AdamW's bias correction, as in the papers (MLX's own default is off, which "
        "scales the first steps 2-6x; the drafters shipped before 2026-12-04 trained without it)",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="the drafter's weights, AdamW state and compute: auto = float32 everywhere. "
        "bfloat16 keeps the weights and AdamW's state in bfloat16 too (no float32 master copy): "
        "updates below a weight's bfloat16 spacing are lost (norm weights near 1 never move) "
        "and beta2 = 0.999 rounds to 1; the drafters shipped before 2026-12-04 trained so",
    )
    loss: LossSpec = Field(LossSpec(), description="weights of the loss terms")
    checkpoint_every: int = Field(250, ge=1, description="steps between checkpoints")
    log_every: int = Field(10, ge=1, description="steps between loss records")
    seed: int = Field(0, ge=0, lt=2**63, description="same seed, same batches and init")
    compile: bool = Field(True, description="mx.compile the step (off: easier debugging)")
    init_from: str | None = Field(
        None,
        description="a drafter directory (published layout, same kind, taps and block) to start "
        "a fresh run from (a resumed run continues its checkpoint); the recipe may add layers "
        "after the source's (they start as identity)",
    )
    extra_data: list[str] = Field(
        default_factory=list,
        description="other training recipes whose own data sets this run trains on too, after "
        "its own (each made first by that recipe's data stage; same target; not the sets they "
        "name in turn; a prompt met twice is trained on once)",
    )


class EvalSpec(Section):
    prompts: list[PromptFile] = Field(
        default_factory=list,
        description="held-out prompt files whose decoded acceptance (τ) is measured per category",
    )
    max_new_tokens: int = Field(128, ge=1, description="tokens decoded per evaluation prompt")


class ExportSpec(Section):
    quantize: Literal[4, 8] | None = Field(
        4, description="bits of the shipped matrices (embedding included); null keeps floats"
    )
    group_size: Literal[32, 64, 128] = Field(32, description="weights per quantization scale")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="type of the shipped float tensors: norms, quantization scales and biases, and "
        "every matrix when quantize is null",
    )


class TrainRecipe(Section):
    version: Literal[1] = Field(1, description="recipe format version")
    name: str = Field(description="names the output and cache directories")
    description: str | None = Field(None, description="free text for the reader")
    target: TrainTarget = Field(TrainTarget(), description="the frozen model drafts are for")
    drafter: DrafterArch = Field(DrafterArch(), description="the drafter's architecture")
    data: DataSpec = Field(description="prompts and how the target answers them")
    train: TrainSpec = Field(TrainSpec(), description="the optimisation")
    eval: EvalSpec = Field(EvalSpec(), description="acceptance on held-out prompts after training")
    export: ExportSpec = Field(ExportSpec(), description="the shipped drafter's weight format")
    output: str | None = Field(None, description="drafter directory (default: ./drafters/<name>)")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*", value):
            raise ValueError(f"name {value!r}: letters, digits, '.', '_' and '-' only")
        return value

    @model_validator(mode="after")
    def _room_for_answers(self) -> TrainRecipe:
        if self.train.anchors_per_seq > self.train.seq_len:  # (memory grows with it)
            raise ValueError(
                f"train.anchors_per_seq: {self.train.anchors_per_seq} exceeds train.seq_len "
                f"{self.train.seq_len}: a sequence has at most one block per position"
            )
        if self.train.seq_len <= self.data.max_prompt_tokens:
            raise ValueError(
                f"train.seq_len: {self.train.seq_len} must exceed data.max_prompt_tokens "
                f"{self.data.max_prompt_tokens}: a sequence cut inside its prompt teaches nothing"
            )
        return self

    def output_dir(self) -> Path:
        return Path(self.output) if self.output else Path("drafters") / self.name

    def decay_gamma(self) -> float:
        if self.train.loss.decay_gamma is not None:
            return self.train.loss.decay_gamma
        return 4.0 if self.drafter.kind == "dspark" else 7.0


def _resolve_paths(
    recipe: TrainRecipe, base: Path, typed: Collection[tuple[str | int, ...]] = ()
) -> None:
    """Prompt files, data cache and output are relative to the recipe file's directory, except
    those set on the command line (`typed`: the locations `--set` touched), which are relative
    to the working directory, as a shell user expects."""

    def resolved(path: str, *loc: str | int) -> str:
        p = Path(path).expanduser()
        here = Path.cwd() if any(loc[: len(t)] == t for t in typed) else base
        return str(p if p.is_absolute() else (here / p).resolve())

    for section in ("data", "eval"):
        for i, spec in enumerate(getattr(recipe, section).prompts):
            spec.path = resolved(spec.path, section, "prompts", i, "path")
    if recipe.output:
        recipe.output = resolved(recipe.output, "output")
    if recipe.data.cache_dir:
        recipe.data.cache_dir = resolved(recipe.data.cache_dir, "data", "cache_dir")
    if recipe.train.init_from:
        recipe.train.init_from = resolved(recipe.train.init_from, "train", "init_from")
    recipe.train.extra_data = [
        resolved(path, "train", "extra_data", i) for i, path in enumerate(recipe.train.extra_data)
    ]


def check_prompt_files(recipe: TrainRecipe, source: str) -> None:
    """Every prompt file exists and reads as prompts within its line range (a corrupt file
    fails here, at validation, not minutes into data generation)."""
    from dspark_flow.training.data import read_prompts

    problems = []
    trained_on: set[str] = set()
    for section, specs in (("data", recipe.data.prompts), ("eval", recipe.eval.prompts)):
        for i, spec in enumerate(specs):
            where, path = f"{source} {section}.prompts[{i}].path", Path(spec.path)
            if path.is_dir():
                problems.append(f"{where}: {spec.path} is a directory, not a prompt file")
            elif not path.is_file():
                problems.append(f"{where}: prompt file not found: {spec.path}")
            else:
                try:
                    prompts = read_prompts(spec)
                except RecipeError as exc:
                    problems.append(f"{where}: {exc}")
                    continue
                if not prompts:  # data or evaluation of nothing is a slip
                    within = f" within lines {spec.lines}" if spec.lines else ""
                    problems.append(f"{where}: no prompts in {spec.path}{within}")
                if section == "data":
                    trained_on.update(prompts)
                elif seen := [p for p in prompts if p in trained_on]:
                    # τ on prompts the drafter trained on is not a held-out figure
                    problems.append(
                        f"{where}: {len(seen)} of its prompts are also training prompts "
                        f"(data.prompts), e.g. {seen[0][:60]!r}: evaluate on held-out prompts"
                    )
    if problems:
        raise RecipeError(problems)


def loads_train_recipe(
    text: str,
    source: str = "<train recipe>",
    overrides: list[str] | None = None,
    base: Path | None = None,
    follow_extra_data: bool = True,
) -> TrainRecipe:
    """`follow_extra_data`: also load and check the recipes `train.extra_data` names (off for
    those recipes themselves: extra data is one level deep)."""
    from dspark_flow.recipe.load import apply_overrides, parse_yaml, validate_model

    data, root = parse_yaml(text, source)
    if data is None and not overrides:  # an empty or all-comment file: one line, not one a field
        raise RecipeError(
            f"{source}: the training recipe is empty (it needs at least a name and a data section)"
        )
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a training recipe is a mapping, got {type(data).__name__}")
    if "data" not in data and {"verifier", "sampler", "draft_cap", "cache", "stop"} & data.keys():
        raise RecipeError(
            f"{source}: this is an inference recipe (no data section): check it with "
            f"`dspark-flow validate {source}`"
        )
    overridden = apply_overrides(data, overrides or [])
    recipe = validate_model(TrainRecipe, data, source, root, overridden, "a training recipe")
    _resolve_paths(recipe, base or Path.cwd(), overridden)
    check_prompt_files(recipe, source)
    if follow_extra_data:
        check_extra_data(recipe, source)
    return recipe


def extra_data_recipes(recipe: TrainRecipe) -> list[TrainRecipe]:
    """The recipes named by `train.extra_data`, loaded (their paths already resolved)."""
    return [load_train_recipe(path, follow_extra_data=False) for path in recipe.train.extra_data]


def check_extra_data(recipe: TrainRecipe, source: str) -> None:
    """Each `train.extra_data` entry is a valid training recipe whose data suits this run: the
    same target (another model's answers teach another model) and prompts that fit this run's
    sequences. Only its own set counts, not the sets it names in turn (list those here too)."""
    problems = []
    here = Path(source).resolve() if Path(source).is_file() else None
    for i, path in enumerate(recipe.train.extra_data):
        where = f"{source} train.extra_data[{i}]"
        if not Path(path).is_file():
            problems.append(f"{where}: training recipe not found: {path}")
            continue
        if here is not None and Path(path).resolve() == here:
            problems.append(
                f"{where}: names this recipe itself (its own data is trained on anyway)"
            )
            continue
        try:  # (its own extra data is not followed: two recipes naming each other would
            # otherwise load each other without end)
            other = load_train_recipe(path, follow_extra_data=False)
        except (RecipeError, ConfigError) as exc:
            why = "; ".join(str(exc).splitlines())
            problems.append(f"{where}: {path} is not a valid training recipe ({why})")
            continue
        if other.target != recipe.target:
            problems.append(
                f"{where}: {other.name}'s target ({other.target.model}) is not this recipe's "
                f"({recipe.target.model}): its data holds another model's answers"
            )
        elif other.data.max_prompt_tokens >= recipe.train.seq_len:
            problems.append(
                f"{where}: {other.name}'s data.max_prompt_tokens {other.data.max_prompt_tokens} "
                f"reaches this recipe's train.seq_len {recipe.train.seq_len}"
            )
    if problems:
        raise RecipeError(problems)


def check_output(recipe: TrainRecipe, source: str, replace: bool = False) -> None:
    """Problems with `output` that export would only find after training: a path it may not
    write into (`export.refusal`: a file, someone else's files, another recipe's drafter
    without `replace`), a folder it cannot create or write, or `train.init_from` naming it (the
    export would replace the drafter the run started from). For runs that may write there (the
    CLI's --check, the train, export and vocab stages); evaluating a drafter found there needs
    none of it. Whether init_from exists is checked when a fresh run needs it."""
    from dspark_flow.files import unwritable
    from dspark_flow.training.export import refusal

    out = recipe.output_dir()
    if why := refusal(out, recipe.name, replace):
        raise RecipeError(f"{source}: output {out} {why}; name a new directory")
    # Export writes beside the folder and renames it into place: both must be writable.
    if why := unwritable(out) or unwritable(out.absolute().parent):
        raise RecipeError(f"{source}: output {out}: {why}")
    start = recipe.train.init_from
    if start and Path(start).resolve() == out.resolve():
        raise RecipeError(
            f"{source}: train.init_from is the output directory {out}: the export would "
            "replace the drafter the run starts from (copy it elsewhere and start from the copy)"
        )


def load_train_recipe(
    path: str | Path, overrides: list[str] | None = None, *, follow_extra_data: bool = True
) -> TrainRecipe:
    from dspark_flow.recipe.load import read_recipe_text

    path = Path(path)
    text = read_recipe_text(path, "training recipe")
    return loads_train_recipe(
        text, str(path), overrides, base=path.resolve().parent, follow_extra_data=follow_extra_data
    )


def target_dims(target: Any) -> dict[str, Any]:
    """The target's width, depth and attention shape (what a drafter copies by default)."""
    from dspark_flow.models.taps import find_layers, target_hidden_size, target_vocab_size

    args = getattr(target, "args", None)
    hidden = target_hidden_size(target)
    heads = int(getattr(args, "num_attention_heads", 0) or max(1, hidden // 64))
    return {
        "hidden_size": hidden,
        "num_layers": len(find_layers(target)),
        "vocab_size": target_vocab_size(target),
        "num_heads": heads,
        "num_kv_heads": int(getattr(args, "num_key_value_heads", 0) or heads),
        "head_dim": int(getattr(args, "head_dim", 0) or hidden // heads),
        "intermediate_size": int(getattr(args, "intermediate_size", 0) or 4 * hidden),
        "rms_norm_eps": float(getattr(args, "rms_norm_eps", 1e-6)),
        "rope_theta": float(getattr(args, "rope_theta", 10000.0)),
        "max_position_embeddings": int(getattr(args, "max_position_embeddings", 0) or 8192),
    }


def check_against_target(recipe: TrainRecipe, target: Any) -> dict[str, Any]:
    """Refuse a drafter that cannot read this target; returns the target's dims."""
    dims = target_dims(target)
    arch = recipe.drafter
    if arch.hidden_size is not None and arch.hidden_size != dims["hidden_size"]:
        raise ConfigError(
            f"drafter.hidden_size {arch.hidden_size} does not match the target's width "
            f"{dims['hidden_size']} ({recipe.target.model}): a drafter reads the target's hidden "
            "states and shares its embedding width"
        )
    depth = dims["num_layers"]
    bad = [i for i in arch.target_layer_ids if i >= depth]
    if bad:
        raise ConfigError(
            f"drafter.target_layer_ids {bad} out of range: {recipe.target.model} has {depth} "
            f"layers (ids -1..{depth - 1})"
        )
    heads = arch.num_heads or dims["num_heads"]
    kv = arch.num_kv_heads or dims["num_kv_heads"]
    if heads % kv:
        raise ConfigError(f"drafter num_heads {heads} is not a multiple of num_kv_heads {kv}")
    mask = arch.mask_token_id  # None: the tokenizer's unknown token, checked when it is read
    if mask is not None and not 0 <= mask < dims["vocab_size"]:
        raise ConfigError(
            f"drafter.mask_token_id {mask} is outside the vocabulary [0, {dims['vocab_size']}) "
            f"of {recipe.target.model}"
        )
    return dims
