"""The training loop: a frozen target run online for its tap features (nothing dumped to disk),
blocks sampled per step (blocks.py), the drafter's batched pass (forward.py), the losses
(losses.py), AdamW with warmup + cosine decay, gradient clipping, checkpoints and resume.

Cheap `__init__`, heavy `warm_up()` (loads the target, builds the drafter). Batches are a pure
function of (seed, step), so a resumed run draws exactly the batches the interrupted one would
have: resume restores weights, optimizer state and the step, nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from dspark_flow.arrays import load_arrays, named_arrays
from dspark_flow.errors import DsparkFlowError
from dspark_flow.files import replace_folder
from dspark_flow.log import get_logger
from dspark_flow.models.backend import dense_weight
from dspark_flow.models.drafter_backbone import DrafterBackbone
from dspark_flow.training.blocks import BlockBatch, sample_blocks
from dspark_flow.training.export import WEIGHTS, drafter_config, write_drafter
from dspark_flow.training.forward import block_hidden
from dspark_flow.training.losses import LossWeights, draft_losses
from dspark_flow.training.recipe import TrainRecipe, check_against_target

if TYPE_CHECKING:
    from collections.abc import Iterator

    from dspark_flow.training.data import Sample

log = get_logger(__name__)
STATE = "trainer.json"
OPTIMIZER = "optimizer.safetensors"


# 2 (2026-12-04): bias-corrected AdamW, float32 weights and optimizer state on every backend.
TRAINER_VERSION = 2


def work_dir(recipe: TrainRecipe) -> Path:
    from dspark_flow.models.embedded import cache_root

    return cache_root() / "train" / recipe.name


def recipe_key(recipe: TrainRecipe) -> str:
    """What makes a checkpoint resumable: everything but lengths, logging and evaluation."""
    data = recipe.model_dump(
        exclude={"eval": True, "export": True, "output": True, "description": True}
    )
    for k in ("steps", "checkpoint_every", "log_every", "compile"):
        data["train"].pop(k)
    # Where files are is no part of it (a moved checkout resumes): prompt files by content,
    # the warm start by its weights' digest (checked on resume: _check_same_source).
    from dspark_flow.training.data import file_digest

    for spec in data["data"]["prompts"]:
        spec["path"] = file_digest(Path(spec["path"]))
    data["data"].pop("cache_dir", None)
    data["train"]["init_from"] = bool(data["train"].get("init_from"))
    # Extra data by the sets it names (a key from before the setting stays as it was).
    if data["train"].pop("extra_data", None):
        from dspark_flow.training.data import data_cache_dir
        from dspark_flow.training.recipe import extra_data_recipes

        data["train"]["extra_data"] = [data_cache_dir(r).name for r in extra_data_recipes(recipe)]
    data["trainer"] = TRAINER_VERSION  # a checkpoint of another optimizer does not resume
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def training_weight_format(requested: str) -> str:
    """auto: float32 on CPU, bfloat16 on GPUs (MLX's 4-bit matmul grows with rows; training
    runs thousands of rows per forward)."""
    from dspark_flow.models.backend import backend_name

    if requested != "auto":
        return requested
    return "float32" if backend_name() == "cpu" else "bfloat16"


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[threading.Event]:
    """Within: a first Ctrl-C only sets the flag yielded (the training loop finishes its step,
    saves a checkpoint, clears the flag and stops there, so a rerun resumes from it instead of
    from the last regular checkpoint, up to `checkpoint_every` steps back); a second interrupts
    at once. Outside the main thread, where signals cannot be caught, or where SIGINT is
    ignored (a background job of a script), the flag never rises. A flag still set when the
    block ends (a Ctrl-C after the loop's last look) raises KeyboardInterrupt there."""
    asked = threading.Event()
    previous = (
        signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread()
        else signal.SIG_IGN
    )
    if previous is signal.SIG_IGN:
        yield asked
        return

    def first(signum: int, frame: Any) -> None:
        asked.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, first)
    try:
        yield asked
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if asked.is_set():  # asked after the loop's last look
        raise KeyboardInterrupt


@dataclass
class TrainResult:
    step: int
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    total: int = 0  # the steps asked for
    interrupted: bool = False  # stopped by Ctrl-C (at a checkpoint, as a pause)

    @property
    def paused(self) -> bool:
        """Stopped by a time limit or Ctrl-C before the last step."""
        return self.step < self.total

    @property
    def last(self) -> dict[str, float]:
        return self.history[-1] if self.history else {}


class DrafterTrainer:
    def __init__(
        self, recipe: TrainRecipe, *, progress: bool = True, checkpoints: Path | None = None
    ):
        self.recipe = recipe
        self.progress = progress
        self.checkpoints = Path(checkpoints) if checkpoints else work_dir(recipe) / "checkpoints"
        self.target: Any = None
        self.tokenizer: Any = None
        self.model: Any = None
        self.optimizer: Any = None
        self.config: dict[str, Any] = {}
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.started_from: dict[str, Any] | None = None  # the warm start's source, if any

    @cached_property
    def key(self) -> str:
        """`recipe_key`, computed once: it digests the prompt files (and loads the extra data's
        recipes), and every checkpoint of the run records the same value."""
        return recipe_key(self.recipe)

    # -- setup ---------------------------------------------------------------------------------

    def warm_up(self, target: Any = None, tokenizer: Any = None) -> DrafterTrainer:
        """Load the target (or take a loaded one), build the drafter and its optimizer."""
        from dspark_flow.models.loading import load
        from dspark_flow.models.taps import install_taps, target_embedding, target_lm_head

        r = self.recipe
        if target is None:
            target, tokenizer = load(
                r.target.model, training_weight_format(r.target.weights), r.target.revision
            )
        target.freeze()
        self.target, self.tokenizer = target, tokenizer
        dims = check_against_target(r, target)
        mask_id = r.drafter.mask_token_id
        if mask_id is None:
            mask_id = int(getattr(tokenizer, "unk_token_id", None) or 0)
        if not 0 <= mask_id < dims["vocab_size"]:
            raise DsparkFlowError(f"drafter.mask_token_id {mask_id} is outside the vocabulary")
        self.config = drafter_config(r, dims, mask_id)
        self.mask_id = mask_id
        self.pad_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
        self.taps = install_taps(target, r.drafter.target_layer_ids)
        self.inner = _inner_model(target)
        self.head = target_lm_head(target)
        self.embedding = target_embedding(target)
        self.model = self._build_drafter(dims)
        self.optimizer = self._build_optimizer()
        self._step_fn = self._make_step()
        return self

    def _build_drafter(self, dims: dict[str, Any]) -> DrafterBackbone:
        import tempfile

        from dspark_flow.models.drafter_loading import read_spec

        # The drafter is built from the very config.json it will ship with.
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(self.config))
            spec = read_spec(Path(tmp))
        spec.path = Path(self.recipe.name)
        self.spec = spec
        mx.random.seed(self.recipe.train.seed)
        if self.recipe.drafter.kind == "dspark":
            from dspark_flow.strategies.drafters.dspark import DSparkModel

            model: DrafterBackbone = DSparkModel(spec)
        else:
            model = DrafterBackbone(spec.backbone)
        model.set_dtype(self.compute_dtype)
        if "embed_tokens" in model:
            # DSpark's embedding (and tied head) starts as the target's, frozen, seen through the
            # export quantization so training sees the matrix that ships.
            model.embed_tokens.weight = _as_shipped(
                dense_weight(self.embedding), self.recipe
            ).astype(self.compute_dtype)
            model.embed_tokens.freeze()
        for layer in model.layers:
            # Residual branches start at zero: the block's output is then the (target-normed)
            # embedding of its tokens, a sane start; random branches fed by the target's massive
            # activations start with logits in the hundreds.
            layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
            layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
        final_norm = getattr(self.inner, "norm", None)
        if final_norm is not None and final_norm.weight.shape == model.norm.weight.shape:
            # The drafter's output norm starts at a tenth of the target's: the head sees hidden
            # states of the target's per-channel shape but small, so first logits are near
            # uniform (a unit-scale start on a rarely used mask token's embedding gives logits
            # in the hundreds and a first CE near 150).
            model.norm.weight = (0.1 * final_norm.weight).astype(self.compute_dtype)
        mx.eval(model.parameters())
        n_train = sum(v.size for _, v in named_arrays(model.trainable_parameters()))
        n_all = sum(v.size for _, v in named_arrays(model.parameters()))
        log.info("drafter built", kind=self.recipe.drafter.kind, trainable=n_train, total=n_all)
        return model

    @property
    def compute_dtype(self) -> mx.Dtype:
        want = self.recipe.train.dtype
        if want == "auto":
            # float32 on GPUs too: in bfloat16 without a float32 master copy, AdamW lost most
            # updates (every norm weight of the drafters shipped before 2026-12-04 stayed at
            # its initial value) and its second moment never decayed.
            want = "float32"
        return {"float32": mx.float32, "bfloat16": mx.bfloat16}[want]

    def _build_optimizer(self) -> optim.Optimizer:
        t = self.recipe.train
        decay_steps = max(t.steps - t.warmup_steps, 1)
        cosine = optim.cosine_decay(t.lr, decay_steps, end=t.lr * t.min_lr_ratio)
        if t.warmup_steps:
            warm = optim.linear_schedule(t.lr / 100, t.lr, t.warmup_steps)
            schedule = optim.join_schedules([warm, cosine], [t.warmup_steps])
        else:
            schedule = cosine
        # Bias-corrected by default, as the papers' (PyTorch's) AdamW: MLX's default leaves it out,
        # which made the early steps 2-6x the scheduled learning rate.
        return optim.AdamW(
            learning_rate=schedule, weight_decay=t.weight_decay, bias_correction=t.bias_correction
        )

    def start_from_init(self) -> dict[str, Any]:
        """A fresh run's warm start from `train.init_from` (warm_start.py); a resumed run
        takes its weights, and this record, from its checkpoint instead."""
        from dspark_flow.training.warm_start import start_from

        r = self.recipe
        if not r.train.init_from:
            raise DsparkFlowError("this recipe names no train.init_from")
        self.started_from = start_from(
            self.model,
            self.spec,
            Path(r.train.init_from),
            r.drafter.kind,
            self.mask_id,
            self.compute_dtype,
        )
        self._step_fn = self._make_step()  # the compiled step captured the old state objects
        log.info("warm start", **{k: v for k, v in self.started_from.items() if k != "init_from"})
        return self.started_from

    # -- one step ------------------------------------------------------------------------------

    @property
    def first_slot(self) -> int:
        return 1 if self.recipe.drafter.kind == "dflash" else 0

    def _embed(self, ids: mx.array) -> mx.array:
        if "embed_tokens" in self.model:
            return self.model.embed_tokens(ids)
        return self.embedding(ids)

    def _logits(self, hidden: mx.array) -> mx.array:
        m = self.model
        if "embed_tokens" in m:
            return m.lm_head(hidden) if "lm_head" in m else m.embed_tokens.as_linear(hidden)
        return self.head(hidden)

    def _target_pass(self, tokens: mx.array, aligned: mx.array) -> tuple[mx.array, mx.array | None]:
        """Tap features (B, L, taps * hidden) and, for DSpark, the target's logits at the
        positions whose next token each draft predicts (B, N, S, V)."""
        hidden = self.inner(tokens)
        feats = self.taps.take(self.recipe.drafter.target_layer_ids)
        assert feats is not None, "the forward above fills every tap"
        if self.recipe.drafter.kind != "dspark":
            return mx.stop_gradient(feats), None
        b, n, s = aligned.shape
        picked = mx.take_along_axis(hidden, aligned.reshape(b, n * s)[..., None], axis=1)
        logits = self.head(picked).reshape(b, n, s, -1)
        return mx.stop_gradient(feats), mx.stop_gradient(logits)

    def _loss(
        self,
        model: DrafterBackbone,
        feats: mx.array,
        t_logits: mx.array | None,
        block_ids: mx.array,
        block_pos: mx.array,
        mask: mx.array,
        labels: mx.array,
        prev: mx.array,
        weights: mx.array,
    ) -> tuple[mx.array, dict[str, mx.array]]:
        b, n, s = labels.shape
        bs = self.recipe.drafter.block_size
        h = block_hidden(model, feats, self._embed(block_ids), block_pos, mask)
        h = h.reshape(b, n, bs, -1)[:, :, self.first_slot : self.first_slot + s]
        logits = self._logits(h).astype(mx.float32)
        markov = model.get("markov_head")
        if markov is not None:
            e = markov.markov_w1(prev)
            if markov.kind == "gated":
                e = (
                    mx.sigmoid(markov.gate_proj(mx.concatenate([h, e.astype(h.dtype)], axis=-1)))
                    * e
                )
            logits = logits + markov.markov_w2(e).astype(mx.float32)
        conf_head = model.get("confidence_head")
        conf = conf_head(h) if conf_head is not None else None
        r = self.recipe
        lw = LossWeights(
            r.train.loss.ce,
            r.train.loss.l1 if t_logits is not None else 0.0,
            r.train.loss.confidence,
            r.decay_gamma(),
        )
        return draft_losses(logits, labels, weights, lw, t_logits, conf)

    def _make_step(self) -> Any:
        model, opt, clip = self.model, self.optimizer, self.recipe.train.grad_clip
        loss_and_grad = nn.value_and_grad(model, partial(self._loss))

        def step(feats, t_logits, block_ids, block_pos, mask, labels, prev, weights):  # noqa: ANN001
            (_, metrics), grads = loss_and_grad(
                model, feats, t_logits, block_ids, block_pos, mask, labels, prev, weights
            )
            grads, norm = optim.clip_grad_norm(grads, clip)
            opt.update(model, grads)
            metrics["grad_norm"] = norm
            return metrics

        target_pass = self._target_pass
        if self.recipe.train.compile:
            state = [model.state, opt.state]
            step = mx.compile(step, inputs=state, outputs=state)
            target_pass = mx.compile(target_pass)
        self._target_fn = target_pass
        return step

    def batch(self, samples: list[Sample], step: int) -> BlockBatch:
        """The batch of `step`: a pure function of (seed, step)."""
        t, d = self.recipe.train, self.recipe.drafter
        n = len(samples)
        epoch, offset = divmod(step * t.batch_size, n)
        picks: list[int] = []
        while len(picks) < t.batch_size:
            order = np.random.default_rng([t.seed, epoch]).permutation(n)
            picks.extend(order[offset : offset + t.batch_size - len(picks)].tolist())
            epoch, offset = epoch + 1, 0
        return sample_blocks(
            [samples[i] for i in picks],
            seq_len=t.seq_len,
            anchors=t.anchors_per_seq,
            block_size=d.block_size,
            first_slot=self.first_slot,
            mask_token_id=self.mask_id,
            pad_id=self.pad_id,
            rng=np.random.default_rng([t.seed, 1_000_003, step]),
        )

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        b = self.batch(samples, self.step)
        feats, t_logits = self._target_fn(mx.array(b.tokens), mx.array(b.aligned))
        metrics = self._step_fn(
            feats,
            t_logits,
            mx.array(b.block_ids),
            mx.array(b.block_pos),
            mx.array(b.mask),
            mx.array(b.labels),
            mx.array(b.prev),
            mx.array(b.weights),
        )
        mx.eval(self.model.parameters(), self.optimizer.state, metrics)
        self.step += 1
        out = {k: float(v) for k, v in metrics.items()}
        out["step"] = self.step
        out["lr"] = float(self.optimizer.learning_rate)
        return out

    # -- the loop ------------------------------------------------------------------------------

    def train(
        self, samples: list[Sample], steps: int | None = None, deadline: float | None = None
    ) -> TrainResult:
        """Train up to `steps` (default: the recipe's); with `deadline` (a time.perf_counter()
        value) stop after the first step past it, checkpointed, so a rerun resumes there."""
        from tqdm import tqdm

        if not samples:
            raise DsparkFlowError("no training samples (the data stage produced nothing)")
        usable = sum(
            s.prompt_len < min(len(s.tokens), self.recipe.train.seq_len) - 1 for s in samples
        )
        if not usable:
            raise DsparkFlowError(
                f"no sample has answer tokens within train.seq_len {self.recipe.train.seq_len}: "
                "raise train.seq_len or lower data.max_prompt_tokens"
            )
        t = self.recipe.train
        total = steps if steps is not None else t.steps
        start, t0 = self.step, time.perf_counter()
        ema: dict[str, float] = {}
        bar = tqdm(
            total=total,
            initial=start,
            desc=f"train {self.recipe.name}",
            unit="step",
            disable=not self.progress,
        )
        positions, stop = 0, False
        with deferred_interrupt() as interrupted:
            try:
                while self.step < total:
                    m = self.train_step(samples)
                    positions += (
                        t.batch_size * t.anchors_per_seq * self.recipe.drafter.drafts_per_round
                    )
                    for k in ("loss", "tau", "acc0"):
                        ema[k] = m[k] if k not in ema else 0.95 * ema[k] + 0.05 * m[k]
                    if not math.isfinite(m["loss"]):
                        raise DsparkFlowError(
                            f"training diverged at step {self.step} (loss {m['loss']}); lower train.lr"
                        )
                    if self.step % t.log_every == 0 or self.step in (total, start + 1):
                        m["seconds"] = time.perf_counter() - t0
                        self.history.append(m)
                        log.info("train", **{k: round(v, 4) for k, v in m.items()})
                    bar.set_postfix(
                        loss=f"{ema['loss']:.3f}", tau=f"{ema['tau']:.2f}", lr=f"{m['lr']:.1e}"
                    )
                    bar.update(1)
                    past_deadline = deadline is not None and time.perf_counter() > deadline
                    stop = interrupted.is_set()
                    if (
                        self.step % t.checkpoint_every == 0
                        or self.step == total
                        or past_deadline
                        or stop
                    ):
                        self.save_checkpoint()
                    if stop:  # the step ended and is saved: a rerun resumes here
                        log.info("interrupted: checkpoint saved", step=self.step, of=total)
                        interrupted.clear()  # handled: the caller records, then stops
                        break
                    if past_deadline and self.step < total:
                        log.info("time limit: paused", step=self.step, of=total)
                        break
            finally:
                bar.close()
        seconds = time.perf_counter() - t0
        log.info(
            "trained",
            steps=self.step - start,
            seconds=round(seconds, 1),
            positions_per_s=round(positions / max(seconds, 1e-9)),
        )
        return TrainResult(
            step=self.step,
            seconds=seconds,
            history=list(self.history),
            total=total,
            interrupted=stop,
        )

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """checkpoints/step_NNNNNN: weights, optimizer state, step; written to a temp dir and
        renamed, so a crash never leaves a half checkpoint; the two newest are kept."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        final = self.checkpoints / f"step_{self.step:07d}"
        tmp = self.checkpoints / f".tmp_step_{self.step:07d}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            mx.save_safetensors(str(tmp / WEIGHTS), dict(tree_flatten(self.model.parameters())))
            mx.save_safetensors(str(tmp / OPTIMIZER), dict(tree_flatten(self.optimizer.state)))
            (tmp / "config.json").write_text(json.dumps(self.config, indent=2))
            state = {
                "step": self.step,
                "key": self.key,
                "history": self.history,
                "init_from": self.started_from,
            }
            (tmp / STATE).write_text(json.dumps(state))
            replace_folder(tmp, final)  # durably: a power cut leaves no torn newest checkpoint
        except BaseException as e:  # no half checkpoint left behind, whatever stopped the save
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError | RuntimeError):  # disk full, permissions (mlx: RuntimeError)
                raise DsparkFlowError(f"cannot write checkpoint {final}: {e}") from e
            raise  # a second Ctrl-C mid-save, say
        for old in sorted(self.checkpoints.glob("step_*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest_checkpoint(self) -> Path | None:
        # One without its state is damaged (saves are atomic): reading it names it, where
        # skipping it let the next save overwrite the step's intact weights without a word.
        found = sorted(p for p in self.checkpoints.glob("step_*") if p.is_dir())
        return found[-1] if found else None

    def resume(self) -> bool:
        """Continue from the newest checkpoint of this recipe; False when there is none."""
        ckpt = self.latest_checkpoint()
        if ckpt is None:
            return False
        state = _read_state(ckpt)
        if state.get("key") != self.key:
            raise DsparkFlowError(
                f"checkpoint {ckpt} belongs to a different version of recipe {self.recipe.name!r}; "
                "pass --fresh to start over (it is then replaced)"
            )
        self.started_from = state.get("init_from")
        self._check_same_source(ckpt)
        with _unreadable(ckpt):
            self.model.load_weights(str(ckpt / WEIGHTS), strict=True)
            opt_state = tree_unflatten(list(load_arrays(ckpt / OPTIMIZER).items()))
        self.optimizer.state = opt_state
        self.step = int(state["step"])
        self.history = list(state.get("history", []))
        mx.eval(self.model.parameters(), self.optimizer.state)
        self._step_fn = self._make_step()  # the compiled step captured the old state objects
        log.info("resumed", checkpoint=str(ckpt), step=self.step)
        return True

    def _check_same_source(self, ckpt: Path) -> None:
        """A checkpoint warm-started from other weights than `train.init_from` now holds (the
        source retrained in place) is not resumed; a source no longer there is not needed."""
        from dspark_flow.training.warm_start import weights_digest

        start, source = self.started_from, self.recipe.train.init_from
        if not start or not source or not (Path(source) / "config.json").is_file():
            return
        if weights_digest(Path(source)) != start.get("weights_sha256"):
            raise DsparkFlowError(
                f"checkpoint {ckpt} was warm-started from other weights than {source} now "
                "holds; pass --fresh to start over from them"
            )

    def load_weights_from(self, ckpt: Path | None = None) -> int:
        """Drafter weights of a checkpoint (the newest when None), for export; returns its step.

        Frozen tensors may be missing (DSpark's embedding is rebuilt from the target), so a
        checkpoint stripped to its trained weights for transfer still loads."""
        ckpt = ckpt or self.latest_checkpoint()
        if ckpt is None:
            raise DsparkFlowError(f"no checkpoint in {self.checkpoints} (run the train stage)")
        with _unreadable(ckpt):
            weights = load_arrays(Path(ckpt) / WEIGHTS)
        frozen = {k for k, _ in named_arrays(self.model.parameters())} - {
            k for k, _ in named_arrays(self.model.trainable_parameters())
        }
        shapes = {k: tuple(v.shape) for k, v in named_arrays(self.model.parameters())}
        expected = set(shapes)
        wrong = [k for k, v in weights.items() if k in shapes and tuple(v.shape) != shapes[k]]
        if wrong:
            raise DsparkFlowError(
                f"checkpoint {ckpt} was trained with other shapes than this recipe's drafter "
                f"({wrong[0]}: {tuple(weights[wrong[0]].shape)} vs {shapes[wrong[0]]})"
            )
        missing = expected - set(weights) - frozen
        if missing or set(weights) - expected:
            raise DsparkFlowError(
                f"checkpoint {ckpt} does not fit this recipe's drafter (missing "
                f"{sorted(missing)[:3]}, unknown {sorted(set(weights) - expected)[:3]})"
            )
        self.model.load_weights(list(weights.items()), strict=False)
        mx.eval(self.model.parameters())
        self.step = int(_read_state(ckpt)["step"]) if (Path(ckpt) / STATE).is_file() else 0
        return self.step

    def clear_checkpoints(self) -> None:
        shutil.rmtree(self.checkpoints, ignore_errors=True)

    # -- export --------------------------------------------------------------------------------

    def export(
        self,
        out: Path,
        *,
        quantize: int | None | str = "recipe",
        dtype: str | None = None,
        extra_files: dict[str, str] | None = None,
        replace: bool = False,
    ) -> Path:
        """Write the drafter (the recipe's export settings unless overridden); `replace` lets
        it replace a drafter another recipe exported."""
        e = self.recipe.export
        bits = e.quantize if quantize == "recipe" else quantize
        return write_drafter(
            self.model,
            self.config,
            out,
            quantize=bits,  # type: ignore[arg-type]
            group_size=e.group_size,
            dtype=dtype or e.dtype,
            extra_files=extra_files,
            replace=replace,
        )


def _inner_model(target: Any) -> Any:
    """The target's decoder stack returning final normed hidden states (mlx-lm: `model.model`)."""
    for holder in (target, getattr(target, "language_model", None)):
        inner = getattr(holder, "model", None) if holder is not None else None
        if inner is not None and callable(inner):
            return inner
    raise DsparkFlowError(f"cannot find the decoder stack of {type(target).__name__} (no .model)")


def _as_shipped(w: mx.array, recipe: TrainRecipe) -> mx.array:
    """`w` after the export's quantize/dequantize round trip (unchanged when it keeps floats)."""
    e = recipe.export
    if not e.quantize or w.shape[-1] % e.group_size:
        return w
    q = mx.quantize(w, group_size=e.group_size, bits=e.quantize)
    return mx.dequantize(*q, group_size=e.group_size, bits=e.quantize)


@contextlib.contextmanager
def _unreadable(ckpt: Path) -> Iterator[None]:
    """A truncated or corrupt checkpoint file as one line naming the checkpoint (mlx raises
    RuntimeError or ValueError from its loaders)."""
    try:
        yield
    except (OSError, RuntimeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DsparkFlowError(
            f"checkpoint {ckpt} is unreadable ({first}): remove it to use the one before, or "
            "pass --fresh to start over"
        ) from e


def _read_state(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's trainer state (step, recipe key, history)."""
    with _unreadable(ckpt):
        state = json.loads((Path(ckpt) / STATE).read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError(f"{STATE} holds no step")
        history = state.get("history", [])
        if not isinstance(history, list) or not all(isinstance(m, dict) for m in history):
            raise ValueError(f"{STATE}'s history is not a list of records")
    return state
