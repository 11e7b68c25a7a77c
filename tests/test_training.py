"""Drafter training on CPU with the real embedded target: the batched training pass equals the
inference drafter block by block, the loss falls, checkpoints round-trip, resume continues
exactly, exports load, and bad training recipes fail at validation with one clear line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import yaml
from mlx.utils import tree_flatten, tree_map

from dspark_flow.errors import ConfigError, DsparkFlowError, RecipeError
from dspark_flow.training.data import Sample
from dspark_flow.training.forward import block_hidden, rope_at
from dspark_flow.training.recipe import (
    DataSpec,
    DrafterArch,
    TrainRecipe,
    TrainSpec,
    check_against_target,
    loads_train_recipe,
)
from dspark_flow.training.trainer import DrafterTrainer, work_dir
from tests.conftest import cli_env

PROMPTS = ["What is 12 times 7?", "Write a Python function that reverses a string."]
REPO = Path(__file__).resolve().parent.parent


def small_recipe(kind: str = "dspark", layers: int = 1, **train: object) -> TrainRecipe:
    arch = dict(kind=kind, block_size=4, num_layers=layers, intermediate_size=64)
    arch["target_layer_ids"] = [1, 15, 29]
    if kind == "dspark":
        arch.update(markov_rank=8, confidence_head=True)
    settings = dict(batch_size=2, seq_len=96, anchors_per_seq=6, lr=3e-3, warmup_steps=0)
    settings.update(train)
    return TrainRecipe(
        name=f"test-{kind}",
        drafter=DrafterArch(**arch),
        data=DataSpec(self_prompts=1, max_prompt_tokens=64),
        train=TrainSpec(**settings),
    )


def run_spec(tmp_path: Path, name: str, steps: int, new_tokens: int) -> dict[str, object]:
    """A whole training recipe (data from two prompts, a tiny DFlash drafter) for run_training,
    its data, checkpoints' name and output under `tmp_path` or unique to this call."""
    import uuid

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["What is 2 + 2?"]}\n{"turns": ["Name a colour."]}\n')
    return {
        "name": f"test-{name}-{uuid.uuid4().hex[:8]}",
        "drafter": small_recipe("dflash").drafter.model_dump(),
        "data": {
            "prompts": [{"path": str(prompts)}],
            "self_prompts": 0,
            "max_new_tokens": new_tokens,
            "max_prompt_tokens": 64,
            "cache_dir": str(tmp_path / "data"),
        },
        "train": {"steps": steps, "batch_size": 2, "seq_len": 96, "anchors_per_seq": 6},
        "export": {"quantize": None},
        "output": str(tmp_path / "drafter"),
    }


@pytest.fixture(scope="module")
def samples(embedded):
    from dspark_flow.api import greedy_generate

    model, tok = embedded
    out = []
    for p in PROMPTS:
        ids = list(
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        )
        res = greedy_generate(model, tok, p, max_new_tokens=40)
        out.append(Sample(np.array(ids + res.token_ids, np.int32), len(ids), "test"))
    return out


def test_rope_at_matches_the_module_rope():
    import mlx.nn as nn

    rope = nn.RoPE(64, traditional=False, base=100000.0)
    x = mx.random.normal((2, 3, 5, 64))
    for offset in (0, 7, 301):
        pos = mx.broadcast_to(offset + mx.arange(5)[None], (2, 5))
        assert mx.allclose(rope_at(x, pos, 100000.0), rope(x, offset=offset), atol=1e-4).item()


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_training_pass_equals_the_inference_drafter(embedded, samples, tmp_path, kind):
    """Every block of a training batch gets the hidden states the loaded drafter computes for the
    same anchor at inference (context = features before the anchor, one block at a time)."""
    from dspark_flow.api import load_drafter
    from dspark_flow.models.drafter_backbone import ContextKV

    model, tok = embedded
    trainer = DrafterTrainer(
        small_recipe(kind, compile=False), progress=False, checkpoints=tmp_path / "c"
    )
    trainer.warm_up(model, tok)
    # Training starts with zeroed residual branches; give every trainable weight random values
    # so attention and the MLP really contribute to what is compared.
    mx.random.seed(3)
    trainer.model.update(
        tree_map(lambda p: 0.05 * mx.random.normal(p.shape), trainer.model.trainable_parameters())
    )
    batch = trainer.batch(samples, 0)
    feats, _ = trainer._target_pass(mx.array(batch.tokens), mx.array(batch.aligned))
    hidden = block_hidden(
        trainer.model,
        feats,
        trainer._embed(mx.array(batch.block_ids)),
        mx.array(batch.block_pos),
        mx.array(batch.mask),
    )
    out = trainer.export(tmp_path / "drafter", quantize=None, dtype="float32")
    drafter = load_drafter(str(out), model, quantize=None)
    bs = drafter.spec.block_size
    checked = 0
    for i in range(batch.tokens.shape[0]):
        for n in range(batch.labels.shape[1]):
            if batch.weights[i, n, 0] == 0:
                continue
            anchor = int(batch.block_pos[i, n * bs])
            state = ContextKV(len(drafter.model.layers))
            drafter.model.extend_context(state, feats[i : i + 1, :anchor])
            ids = mx.array(batch.block_ids[i, n * bs : (n + 1) * bs])
            want = drafter.model(state, drafter.embed(ids)[None])[0]
            got = hidden[i, n * bs : (n + 1) * bs]
            assert mx.allclose(got, want, atol=2e-4, rtol=1e-3).item(), (i, n)
            checked += 1
    assert checked >= 6


def test_loss_falls_checkpoints_round_trip_and_resume_continues(embedded, samples, tmp_path):
    model, tok = embedded
    recipe = small_recipe("dspark", steps=10, checkpoint_every=3)
    straight = DrafterTrainer(recipe, progress=False, checkpoints=tmp_path / "a").warm_up(
        model, tok
    )
    result = straight.train(samples)
    first, last = straight.history[0]["loss"], result.last["loss"]
    assert result.step == 10 and last < first, (first, last)

    # Interrupted at step 7, then resumed in a fresh trainer: same weights as the straight run.
    part = DrafterTrainer(recipe, progress=False, checkpoints=tmp_path / "b").warm_up(model, tok)
    part.train(samples, steps=7)
    saved = sorted(p.name for p in (tmp_path / "b").glob("step_*"))
    assert saved == ["step_0000006", "step_0000007"]
    resumed = DrafterTrainer(recipe, progress=False, checkpoints=tmp_path / "b").warm_up(model, tok)
    assert resumed.resume() and resumed.step == 7
    got = dict(tree_flatten(resumed.model.parameters()))
    want = dict(tree_flatten(part.model.parameters()))
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)  # round trip is exact
    resumed.train(samples)
    assert resumed.step == 10
    a = dict(tree_flatten(straight.model.parameters()))
    b = dict(tree_flatten(resumed.model.parameters()))
    worst = max(float(mx.abs(a[k] - b[k]).max()) for k in a)
    assert worst < 1e-5, worst


def test_a_failed_or_interrupted_checkpoint_save_leaves_no_half_checkpoint(
    embedded, monkeypatch, tmp_path
):
    from dspark_flow.errors import DsparkFlowError
    from dspark_flow.training import trainer as trainer_module

    model, tok = embedded
    trainer = DrafterTrainer(
        small_recipe("dspark", steps=2), progress=False, checkpoints=tmp_path / "c"
    ).warm_up(model, tok)
    for failure, raised in [
        (OSError("disk full"), DsparkFlowError),
        (KeyboardInterrupt(), KeyboardInterrupt),
    ]:

        def save(*_, failure=failure):
            raise failure

        monkeypatch.setattr(trainer_module.mx, "save_safetensors", save)
        with pytest.raises(raised):
            trainer.save_checkpoint()
        assert not list((tmp_path / "c").iterdir()), failure  # neither the temporary nor a step


def test_the_optimizer_is_bias_corrected_adamw_on_float32_weights_on_every_backend(
    embedded, samples, tmp_path, monkeypatch
):
    """In bfloat16 without a float32 master copy, AdamW rounded most updates away (the norm
    weights of the drafters trained on the H200 before 2026-12-04 never moved) and beta2 = 0.999
    rounded to 1; MLX's AdamW also leaves bias correction out unless asked."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dspark_flow.models import backend

    model, tok = embedded
    monkeypatch.setattr(backend, "backend_name", lambda: "cuda")  # what `auto` picks on a GPU
    trainer = DrafterTrainer(small_recipe("dspark", steps=1), progress=False, checkpoints=tmp_path)
    trainer.warm_up(model, tok)
    assert trainer.compute_dtype == mx.float32 and trainer.optimizer.bias_correction
    before = {k: mx.array(v) for k, v in tree_flatten(trainer.model.trainable_parameters())}
    monkeypatch.undo()
    trainer.train(samples)
    after = dict(tree_flatten(trainer.model.trainable_parameters()))
    norms = [k for k in before if "norm" in k]
    assert norms and all(not mx.array_equal(before[k], after[k]) for k in norms), norms


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler while the test runs: a suite started in the background
    (`cmd &`, nohup) inherits SIGINT ignored, which the trainer leaves alone by design."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_ends_the_step_saves_it_and_a_rerun_resumes_there(
    embedded, samples, tmp_path, python_sigint
):
    import signal

    model, tok = embedded
    recipe = small_recipe("dflash", steps=5, checkpoint_every=100)
    trainer = DrafterTrainer(recipe, progress=False, checkpoints=tmp_path).warm_up(model, tok)
    step = trainer.train_step

    def step_then_ctrl_c(batch: object) -> dict[str, float]:
        m = step(batch)
        if trainer.step == 2:
            signal.raise_signal(signal.SIGINT)  # as a user's Ctrl-C, mid-run
        return m

    trainer.train_step = step_then_ctrl_c  # type: ignore[method-assign]
    before = signal.getsignal(signal.SIGINT)
    result = trainer.train(samples)  # stops as a pause does; run_training records, then raises
    assert result.interrupted and result.paused and result.step == 2
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_0000002"]  # not 100 steps back
    again = DrafterTrainer(recipe, progress=False, checkpoints=tmp_path).warm_up(model, tok)
    assert again.resume() and again.step == 2
    assert again.train(samples).step == 5


def test_the_interrupt_guard_leaves_ignored_sigint_alone_and_stops_after_a_late_ctrl_c(
    python_sigint,
):
    import signal

    from dspark_flow.training.trainer import deferred_interrupt

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a script's background job
        with deferred_interrupt() as asked:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert not asked.is_set()
    finally:
        signal.signal(signal.SIGINT, before)
    # Asked after the loop's last look: the block still ends in the interrupt.
    with pytest.raises(KeyboardInterrupt), deferred_interrupt() as asked:
        signal.raise_signal(signal.SIGINT)
        assert asked.is_set()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_time_limit_pauses_at_a_checkpoint(embedded, samples, tmp_path):
    import time

    model, tok = embedded
    recipe = small_recipe("dflash", steps=5, checkpoint_every=100)
    trainer = DrafterTrainer(recipe, progress=False, checkpoints=tmp_path).warm_up(model, tok)
    result = trainer.train(samples, deadline=time.perf_counter())  # already past: one step
    assert result.step == 1 and result.paused
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_0000001"]
    again = DrafterTrainer(recipe, progress=False, checkpoints=tmp_path).warm_up(model, tok)
    assert again.resume() and not again.train(samples).paused and again.step == 5


@pytest.mark.slow
def test_time_limited_calls_add_up_in_the_summary(embedded, tmp_path):
    import json
    import shutil

    from dspark_flow.training.run import run_training, write_card
    from dspark_flow.training.trainer import work_dir

    recipe = TrainRecipe.model_validate(run_spec(tmp_path, "time-limit", steps=3, new_tokens=24))
    stages = ("data", "train", "export")
    try:
        first = run_training(recipe, stages=stages, progress=False, time_limit=0.0)
        assert first["train"]["paused"] and first["train"]["steps"] == 1
        assert "exported_step" not in first and not (tmp_path / "drafter").exists()
        second = run_training(recipe, stages=stages, progress=False)
        assert not second["train"]["paused"] and second["exported_step"] == 3
        assert second["train"]["calls"] == 2
        # Someone else's drafter (another recipe's, or a hub download): evaluating it leaves
        # its card alone; exporting over it needs `replace`.
        foreign = tmp_path / "foreign"
        shutil.copytree(tmp_path / "drafter", foreign)
        config = json.loads((foreign / "config.json").read_text())
        config["dspark_flow"]["recipe"] = "someone-else"
        (foreign / "config.json").write_text(json.dumps(config))
        (foreign / "README.md").write_text("theirs")
        theirs = recipe.model_copy(deep=True)
        theirs.output = str(foreign)
        theirs.eval.prompts, theirs.eval.max_new_tokens = recipe.data.prompts, 8
        judged = run_training(theirs, stages=("eval",), progress=False)
        assert judged["eval"]["shipped"] and (foreign / "README.md").read_text() == "theirs"
        assert json.loads((foreign / "train_summary.json").read_text()).get("eval") is None
        own_record = json.loads((work_dir(recipe) / "train_summary.json").read_text())
        assert "eval" not in own_record  # nor does this recipe's record take its figures
        with pytest.raises(DsparkFlowError, match="recipe 'someone-else' exported"):
            run_training(theirs, stages=("export",), progress=False)
        assert (foreign / "README.md").read_text() == "theirs"
        run_training(theirs, stages=("export",), progress=False, replace=True)
        assert "theirs" not in (foreign / "README.md").read_text()
        this_call = second["seconds"]  # the whole second call, its training included
        assert first["train"]["seconds"] < second["train"]["seconds"]
        assert second["train"]["seconds"] <= first["train"]["seconds"] + this_call + 0.1
        assert second["data"] == first["data"]  # the call that made the data keeps its record
        assert (tmp_path / "drafter" / "draft_vocab.npy").is_file()  # export counts the tokens
        assert second["vocab"]["answer_tokens"] == second["data"]["answer_tokens"]
        card = tmp_path / "drafter" / "train_summary.json"
        assert json.loads(card.read_text())["train"]["calls"] == 2
        # A later call (eval, export) with other overrides rewrites the model card: it still
        # states the data and settings the producing calls used.
        other = recipe.model_copy(deep=True)
        other.data.self_prompts, other.train.lr = 123, 0.5
        other.drafter.num_layers = recipe.drafter.num_layers + 2
        other.export.quantize, other.data.temperature = 8, 0.7
        other.data.prompts = other.data.prompts[:0]
        write_card(other, tmp_path / "drafter")
        text = (tmp_path / "drafter" / "README.md").read_text()
        assert "plus 0 prompts it wrote itself" in text
        assert f"AdamW lr {recipe.train.lr} " in text and "lr 0.5" not in text
        assert "float32 weights and state, bias-corrected)" in text
        assert "settings were not recorded" not in text  # (said of records that lack them)
        # A record from before the optimizer and export settings were recorded (the shipped
        # drafters'): the card says how to reproduce the old optimizer on the device it names,
        # and reads the export format from config.json, not from this call's overrides.
        legacy = tmp_path / "legacy"
        shutil.copytree(tmp_path / "drafter", legacy)
        record = json.loads((legacy / "train_summary.json").read_text())
        for key in ("dtype", "bias_correction"):
            del record["train"]["settings"][key]
        del record["export"]
        (legacy / "train_summary.json").write_text(json.dumps(record))
        write_card(other, legacy)
        text = (legacy / "README.md").read_text()
        assert record["train"]["device"].startswith("cpu")
        assert (
            "settings were not recorded" in text and "`--set train.bias_correction=false`" in text
        )
        assert "train.dtype=bfloat16" not in text and "Shipped unquantized" in text
        assert f"{recipe.drafter.num_layers} layers, block" in text
        assert "Shipped unquantized (bfloat16)" in text  # (the spec exports floats)
        assert f"at temperature {recipe.data.temperature} " in text
        assert f"- `{Path(recipe.data.prompts[0].path).name}`" in text
        # Starting over (--fresh) and pausing again: the new run's record forgets the old
        # drafter's export, and the exported drafter's own record is left as it was.
        third = run_training(recipe, stages=stages, progress=False, time_limit=0.0, fresh=True)
        assert third["train"]["paused"] and "exported_step" not in third
        assert "calls" in third["train"] and third["train"]["calls"] == 1
        shipped = json.loads(card.read_text())
        assert shipped["exported_step"] == 3 and shipped["train"]["calls"] == 2
    finally:
        shutil.rmtree(work_dir(recipe), ignore_errors=True)


@pytest.mark.slow
def test_ctrl_c_in_a_training_run_records_the_call_and_skips_export(
    embedded, tmp_path, python_sigint
):
    import json
    import signal

    from dspark_flow.training import trainer as trainer_module
    from dspark_flow.training.run import run_training
    from dspark_flow.training.trainer import work_dir

    recipe = TrainRecipe.model_validate(run_spec(tmp_path, "ctrl-c", steps=3, new_tokens=16))
    step = trainer_module.DrafterTrainer.train_step

    def step_then_ctrl_c(self, batch):  # noqa: ANN001, ANN202
        m = step(self, batch)
        if self.step == 1:
            signal.raise_signal(signal.SIGINT)
        return m

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(trainer_module.DrafterTrainer, "train_step", step_then_ctrl_c)
            with pytest.raises(KeyboardInterrupt):
                run_training(recipe, stages=("data", "train", "export"), progress=False)
        record = json.loads((work_dir(recipe) / "train_summary.json").read_text())
        assert record["train"]["steps"] == 1 and record["train"]["paused"]
        assert not (tmp_path / "drafter").exists()  # export waits for the run that finishes
        done = run_training(recipe, stages=("data", "train", "export"), progress=False)
        assert done["train"]["steps"] == 3 and done["train"]["calls"] == 2
    finally:
        shutil.rmtree(work_dir(recipe), ignore_errors=True)


@pytest.mark.slow
def test_a_damaged_shard_is_named_and_made_again_and_exports_keep_their_record(
    embedded, tmp_path, monkeypatch
):
    """A flipped byte in a data shard is one line where data is only read (it was an internal
    BadZipFile error) and the data stage makes the shard again; an export whose later stages
    fail leaves the drafter its card and summary (the export used to drop both until the end
    of the call, so a failure or Ctrl-C in between lost them)."""
    import json

    from dspark_flow.training import run as run_module
    from dspark_flow.training.run import run_training
    from dspark_flow.training.trainer import work_dir

    recipe = TrainRecipe.model_validate(run_spec(tmp_path, "damaged", steps=1, new_tokens=16))
    out = tmp_path / "drafter"
    try:
        run_training(recipe, stages=("data", "train", "export"), progress=False)
        shard = tmp_path / "data" / "shard_00000.npz"
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
        with pytest.raises(DsparkFlowError, match="damaged") as info:
            run_training(recipe, stages=("vocab",), progress=False)
        assert "\n" not in str(info.value)
        run_training(recipe, stages=("data",), progress=False)  # makes the shard again
        run_training(recipe, stages=("vocab",), progress=False)

        # An export-only call records the run its checkpoints came from (it took the output's
        # record), and no evaluation of the weights it replaced (it kept the old figures).
        old = json.loads((out / "train_summary.json").read_text())
        stale = {**old, "eval": {"shipped": {"all": {"tau": 9.9}}}, "train": {"steps": 99}}
        (out / "train_summary.json").write_text(json.dumps(stale))
        run_training(recipe, stages=("export",), progress=False)
        record = json.loads((out / "train_summary.json").read_text())
        assert "eval" not in record and record["train"]["steps"] == 1

        def fails(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise DsparkFlowError("the recount failed")

        monkeypatch.setattr(run_module, "write_vocab", fails)
        with pytest.raises(DsparkFlowError, match="the recount failed"):
            run_training(recipe, stages=("export",), progress=False)
        record = json.loads((out / "train_summary.json").read_text())
        assert record["exported_step"] == 1 and record["train"]["steps"] == 1
        card = (out / "README.md").read_text()
        assert card.startswith(f"# {recipe.name}\n") and "1 steps of 2 sequences" in card
    finally:
        shutil.rmtree(work_dir(recipe), ignore_errors=True)


def test_a_cards_lineage_names_each_parent_once_in_order():
    from dspark_flow.training.run import _lineage

    chain = {"path": "out/drafters/b", "recipe": "b", "steps": 5, "layers": 3}
    chain["init_from"] = {"path": "out/drafters/a", "recipe": "a", "steps": 7, "layers": 3}
    lines = _lineage(chain)
    assert lines[0] == "" and len(lines) == 3
    assert lines[1].startswith("Started from `b`") and "5 steps of recipe b" in lines[1]
    assert lines[2].startswith("That one started from `a`") and "7 steps of recipe a" in lines[2]
    assert _lineage(None) == []


@pytest.mark.slow
def test_failed_starts_and_corrupt_checkpoints_lose_nothing(embedded, tmp_path):
    """A warm start that is not there fails before the data is made and before --fresh
    removes anything; an unreadable checkpoint is named in one line, not an internal error."""

    from dspark_flow.training.run import run_training
    from dspark_flow.training.trainer import work_dir

    spec = run_spec(tmp_path, "lose-nothing", steps=1, new_tokens=16)
    recipe = TrainRecipe.model_validate(spec)
    nowhere = TrainRecipe.model_validate(
        {**spec, "train": {**spec["train"], "init_from": str(tmp_path / "nowhere")}}
    )
    try:
        with pytest.raises(DsparkFlowError, match="no drafter"):  # before the data stage
            run_training(nowhere, stages=("data", "train"), progress=False)
        assert not (tmp_path / "data").exists()
        run_training(recipe, stages=("data", "train"), progress=False)
        checkpoints = work_dir(recipe) / "checkpoints"
        saved = sorted(checkpoints.glob("step_*"))
        assert saved
        record = work_dir(recipe) / "train_summary.json"  # ours, of the wrong shape: rebuilt
        for wrong in ('{"train": 5, "data": "x"}', '{"train": {"steps": "x"}}'):
            record.write_text(wrong)  # were an AttributeError and a TypeError
            run_training(recipe, stages=("train",), progress=False)
            assert isinstance(json.loads(record.read_text())["train"]["steps"], int)
        with pytest.raises(DsparkFlowError, match="no drafter"):
            run_training(nowhere, stages=("train",), progress=False, fresh=True)
        assert sorted(checkpoints.glob("step_*")) == saved  # --fresh removed nothing

        (saved[-1] / "trainer.json").write_text("{garbage")
        with pytest.raises(DsparkFlowError, match="is unreadable") as info:
            run_training(recipe, stages=("train",), progress=False)
        assert str(saved[-1]) in str(info.value) and "\n" not in str(info.value)
        (saved[-1] / "trainer.json").write_text('{"step": 1, "history": 5}')  # was a TypeError
        with pytest.raises(DsparkFlowError, match="history is not a list"):
            run_training(recipe, stages=("train",), progress=False)
        (saved[-1] / "trainer.json").unlink()  # was skipped, and its weights overwritten
        weights = saved[-1] / "model.safetensors"
        intact = weights.read_bytes()
        with pytest.raises(DsparkFlowError, match="is unreadable .*trainer.json"):
            run_training(recipe, stages=("train",), progress=False)
        assert weights.read_bytes() == intact
        (saved[-1] / "trainer.json").write_text('{"step": 1}')
        weights.write_bytes(weights.read_bytes()[:100])
        with pytest.raises(DsparkFlowError, match="is unreadable"):
            run_training(recipe, stages=("export",), progress=False)
        assert not (tmp_path / "drafter").exists()
    finally:
        shutil.rmtree(work_dir(recipe), ignore_errors=True)
        shutil.rmtree(work_dir(nowhere), ignore_errors=True)


def test_a_data_stage_that_fails_before_writing_leaves_no_empty_cache(embedded, tmp_path):
    from dspark_flow.training.data import data_cache_dir
    from dspark_flow.training.run import run_training

    spec = run_spec(tmp_path, "no-fit", steps=1, new_tokens=8)
    tight = TrainRecipe.model_validate({**spec, "data": {**spec["data"], "max_prompt_tokens": 8}})
    try:
        with pytest.raises(DsparkFlowError, match="no training prompt fits"):
            run_training(tight, stages=("data",), progress=False)
        assert not data_cache_dir(tight).exists()
        # Nor does it delete data an earlier recipe made in that folder (it cleared it first).
        run_training(TrainRecipe.model_validate(spec), stages=("data",), progress=False)
        made = sorted(p.name for p in data_cache_dir(tight).iterdir())
        with pytest.raises(DsparkFlowError, match="no training prompt fits"):
            run_training(tight, stages=("data",), progress=False)
        assert sorted(p.name for p in data_cache_dir(tight).iterdir()) == made
        assert "shard_00000.npz" in made
    finally:  # the run's record lives in the user cache (its work dir)
        shutil.rmtree(work_dir(tight), ignore_errors=True)


def test_a_mask_id_outside_the_vocabulary_fails_before_the_data_stage(embedded, tmp_path):
    from dspark_flow.training.data import data_cache_dir
    from dspark_flow.training.run import run_training

    spec = run_spec(tmp_path, "bad-mask", steps=1, new_tokens=8)
    spec["drafter"] = {**spec["drafter"], "mask_token_id": 999_999}
    recipe = TrainRecipe.model_validate(spec)
    with pytest.raises(ConfigError, match="mask_token_id 999999 is outside the vocabulary"):
        run_training(recipe, stages=("data", "train"), progress=False)
    assert not data_cache_dir(recipe).exists()  # it used to surface after the data was made


def test_a_changed_recipe_refuses_to_resume(embedded, samples, tmp_path):
    model, tok = embedded
    DrafterTrainer(small_recipe("dflash", steps=2), progress=False, checkpoints=tmp_path).warm_up(
        model, tok
    ).train(samples)
    other = DrafterTrainer(
        small_recipe("dflash", steps=2, lr=1e-4), progress=False, checkpoints=tmp_path
    )
    with pytest.raises(Exception, match="different version of recipe"):
        other.warm_up(model, tok).resume()


def _hidden(trainer: DrafterTrainer, samples: list[Sample]) -> mx.array:
    batch = trainer.batch(samples, 0)
    feats, _ = trainer._target_pass(mx.array(batch.tokens), mx.array(batch.aligned))
    return block_hidden(
        trainer.model,
        feats,
        trainer._embed(mx.array(batch.block_ids)),
        mx.array(batch.block_pos),
        mx.array(batch.mask),
    )


def _warm(recipe: TrainRecipe, model, tok, where: Path) -> DrafterTrainer:  # noqa: ANN001
    trainer = DrafterTrainer(recipe, progress=False, checkpoints=where).warm_up(model, tok)
    trainer.start_from_init()
    return trainer


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_a_warm_start_adds_layers_and_begins_where_the_source_ends(
    embedded, samples, tmp_path, kind
):
    """init_from a 1-layer drafter into a 2-layer recipe: the first layer is the source's, the
    added one starts as identity, so step 0 computes what the source computes; a quantized
    source loads dequantized and training goes on from it."""
    model, tok = embedded
    source = DrafterTrainer(
        small_recipe(kind, compile=False), progress=False, checkpoints=tmp_path / "a"
    ).warm_up(model, tok)
    mx.random.seed(5)
    source.model.update(
        tree_map(lambda p: 0.05 * mx.random.normal(p.shape), source.model.trainable_parameters())
    )
    exported = source.export(tmp_path / "float", quantize=None, dtype="float32")
    recipe = small_recipe(kind, layers=2, compile=False, init_from=str(exported))
    grown = _warm(recipe, model, tok, tmp_path / "b")
    assert grown.started_from["layers"] == 1 and grown.started_from["added_layers"] == 1
    want, got = _hidden(source, samples), _hidden(grown, samples)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()
    if kind == "dspark":  # the frozen embedding is the target's, never the source's
        fresh = DrafterTrainer(small_recipe(kind, layers=2), progress=False).warm_up(model, tok)
        assert mx.array_equal(grown.model.embed_tokens.weight, fresh.model.embed_tokens.weight)

    quantized = source.export(tmp_path / "q4")  # the recipe's default: 4-bit, group 32
    again = _warm(
        small_recipe(kind, layers=2, steps=2, init_from=str(quantized)), model, tok, tmp_path / "c"
    )
    stored = mx.load(str(quantized / "model.safetensors"))
    name = "layers.0.mlp.up_proj"
    w, scales, biases = (stored[f"{name}.{k}"] for k in ("weight", "scales", "biases"))
    want = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), 32, 4)
    assert mx.array_equal(again.model.layers[0].mlp.up_proj.weight, want).item()
    assert again.started_from["weights_sha256"] != grown.started_from["weights_sha256"]
    assert np.isfinite(again.train(samples).last["loss"])


def test_a_resumed_warm_start_keeps_its_record_and_its_source(embedded, samples, tmp_path):
    """A resumed run takes its weights and its warm-start record from the checkpoint (the card
    still names the source); a source retrained in place since then is refused."""
    from dspark_flow.training.run import _lineage

    model, tok = embedded
    src = DrafterTrainer(small_recipe("dflash"), progress=False).warm_up(model, tok)
    src_dir = src.export(tmp_path / "src", quantize=None)
    recipe = small_recipe("dflash", layers=2, steps=2, init_from=str(src_dir))
    first = _warm(recipe, model, tok, tmp_path / "ck")
    first.train(samples, steps=1)
    later = DrafterTrainer(recipe, progress=False, checkpoints=tmp_path / "ck").warm_up(model, tok)
    assert later.resume() and later.started_from == first.started_from
    lines = _lineage({**first.started_from, "init_from": {"path": "/x/root", "layers": 3}})
    assert "`src`" in lines[1] and "1 layers added" in lines[1] and "`root`" in lines[2]

    src.model.update(tree_map(lambda p: p + 0.01, src.model.trainable_parameters()))
    src.export(src_dir, quantize=None)  # the source retrained in place
    again = DrafterTrainer(recipe, progress=False, checkpoints=tmp_path / "ck").warm_up(model, tok)
    with pytest.raises(DsparkFlowError, match="warm-started from other weights"):
        again.resume()


def test_a_warm_start_that_cannot_fit_fails_in_one_line(embedded, tmp_path):
    import json

    from dspark_flow.training.warm_start import check_init_from

    model, tok = embedded
    two = DrafterTrainer(small_recipe("dspark", layers=2), progress=False, checkpoints=tmp_path)
    src = two.warm_up(model, tok).export(tmp_path / "two", quantize=None)
    cases = [
        (small_recipe("dflash", layers=2, init_from=str(src)), "is a deepspec drafter"),
        (small_recipe("dspark", layers=1, init_from=str(src)), "layers can be added, not dropped"),
        (small_recipe("dspark", layers=2, init_from=str(tmp_path / "nowhere")), "no drafter"),
    ]
    other_taps = small_recipe("dspark", layers=2, init_from=str(src))
    other_taps.drafter.target_layer_ids = [1, 16, 29]
    cases.append((other_taps, "target_layer_ids"))
    # A setting that changes no tensor shape must still match.
    theta = tmp_path / "theta"
    shutil.copytree(src, theta)
    config = json.loads((theta / "config.json").read_text())
    (theta / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))
    cases.append((small_recipe("dspark", layers=2, init_from=str(theta)), "rope_theta 1234.0"))
    # A tensor the drafter does not have, and one of the wrong shape.
    for name, change in (("extra", "bogus.weight"), ("shape", "layers.0.mlp.up_proj.weight")):
        bad = tmp_path / name
        shutil.copytree(src, bad)
        weights = mx.load(str(bad / "model.safetensors"))
        weights[change] = mx.zeros((3, 5))
        mx.save_safetensors(str(bad / "model.safetensors"), weights)
        message = "does not use" if name == "extra" else "has shape"
        cases.append((small_recipe("dspark", layers=2, init_from=str(bad)), message))
    # A truncated weights file (an interrupted copy).
    cut = tmp_path / "cut"
    shutil.copytree(src, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases.append((small_recipe("dspark", layers=2, init_from=str(cut)), "cannot read"))
    for recipe, message in cases:
        trainer = DrafterTrainer(recipe, progress=False, checkpoints=tmp_path / "x")
        with pytest.raises(DsparkFlowError, match=message) as info:
            trainer.warm_up(model, tok).start_from_init()
        assert "\n" not in str(info.value)
    # What the recipe states (kind, depth, taps) and the weights' file are checked before any
    # work and by `train --check`, without the target (found by the CLI audit of 2026-12-05).
    early = [c for c in cases if c[1] not in ("rope_theta 1234.0", "does not use", "has shape")]
    for recipe, message in early:
        with pytest.raises(DsparkFlowError, match=message) as info:
            check_init_from(recipe)
        assert "\n" not in str(info.value)
    check_init_from(small_recipe("dspark", layers=2, init_from=str(src)))  # it fits


def test_quantized_export_loads_and_stays_lossless(embedded, samples, tmp_path):
    from dspark_flow.api import greedy_generate, load_drafter, speculative_generate

    model, tok = embedded
    trainer = DrafterTrainer(
        small_recipe("dspark", steps=3), progress=False, checkpoints=tmp_path / "c"
    )
    trainer.warm_up(model, tok).train(samples)
    out = trainer.export(tmp_path / "q")  # the recipe's default: 4-bit, group 32
    drafter = load_drafter(str(out), model)
    want = greedy_generate(model, tok, PROMPTS[0], max_new_tokens=30).token_ids
    got = speculative_generate(
        model, tok, drafter, PROMPTS[0], max_new_tokens=30, max_draft_tokens=None
    )
    assert got.token_ids == want


# -- bad training recipes: one clear line each, before any work -----------------------------------


def _recipe_text(**drafter: object) -> str:
    arch = "".join(f"\n  {k}: {v}" for k, v in drafter.items())
    return f"name: bad\ndrafter:\n  kind: dspark{arch}\ndata:\n  self_prompts: 4\n"


def test_export_never_replaces_a_directory_that_is_not_a_drafter(embedded, tmp_path):
    model, tok = embedded
    trainer = DrafterTrainer(small_recipe("dflash"), progress=False, checkpoints=tmp_path / "c")
    trainer.warm_up(model, tok)
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(DsparkFlowError, match=r"did not export \(notes.txt\)"):
        trainer.export(home)
    assert (home / "notes.txt").read_text() == "mine"
    card = tmp_path / "card"  # names a drafter might have are not enough: README.md is mine
    card.mkdir()
    (card / "README.md").write_text("mine")
    with pytest.raises(DsparkFlowError, match=r"did not export \(README.md\)"):
        trainer.export(card)
    assert (card / "README.md").read_text() == "mine"
    out = trainer.export(tmp_path / "d")
    assert trainer.export(out) == out  # this recipe's own drafter is replaced
    (out / "notes.txt").write_text("mine")  # ...but not with a user's file put inside it
    with pytest.raises(DsparkFlowError, match=r"did not export \(notes.txt\)"):
        trainer.export(out)
    assert (out / "notes.txt").read_text() == "mine"
    assert out.stat().st_mode & 0o005 == 0o005  # readable by others, not 0700 like mkdtemp
    (out / "notes.txt").unlink()
    (out / "config.json").write_text("{bad")  # it said the tool had not exported that file
    with pytest.raises(DsparkFlowError, match="config.json is unreadable: remove the folder"):
        trainer.export(out)


def test_seq_len_inside_the_prompt_budget_fails_validation_at_seq_len():
    text = _recipe_text() + "train:\n  seq_len: 128\n"
    line = text.splitlines().index("  seq_len: 128") + 1
    # A check across two fields is located at the one it names first, not at the recipe's top.
    with pytest.raises(
        RecipeError,
        match=rf"r\.yaml:{line}:12 train\.seq_len: 128 must exceed data\.max_prompt_tokens 384",
    ):
        loads_train_recipe(text, "r.yaml")


def test_block_size_zero_fails_validation():
    with pytest.raises(RecipeError) as e:
        loads_train_recipe(_recipe_text(block_size=0), "r.yaml")
    assert "drafter.block_size" in str(e.value) and "at least 1" in str(e.value)
    assert str(e.value).startswith("r.yaml:")


def test_an_empty_training_recipe_is_one_line():
    for text in ("", "# only a comment\n"):
        with pytest.raises(RecipeError) as e:
            loads_train_recipe(text, "r.yaml")
        assert str(e.value) == (
            "r.yaml: the training recipe is empty (it needs at least a name and a data section)"
        )


def test_missing_prompt_file_fails_validation(tmp_path):
    text = "name: bad\ndata:\n  prompts:\n    - {path: nowhere.jsonl}\n"
    with pytest.raises(RecipeError, match=r"data.prompts\[0\].path: prompt file not found"):
        loads_train_recipe(text, "r.yaml", base=tmp_path)


def test_evaluation_on_training_prompts_fails_validation(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"turns": ["a"]}\n{"turns": ["b"]}\n')
    (tmp_path / "held.jsonl").write_text('{"turns": ["c"]}\n{"turns": ["b"]}\n')
    text = "name: bad\ndata:\n  prompts:\n    - {path: train.jsonl}\neval:\n  prompts:\n"
    with pytest.raises(RecipeError) as e:
        loads_train_recipe(text + "    - {path: held.jsonl}\n", "r.yaml", base=tmp_path)
    assert "eval.prompts[0].path: 1 of its prompts are also training prompts" in str(e.value)
    held_out = text + "    - {path: held.jsonl, limit: 1}\n"  # only "c"
    assert loads_train_recipe(held_out, "r.yaml", base=tmp_path).eval.prompts[0].limit == 1


def test_width_mismatch_fails_before_any_work(embedded):
    model, _ = embedded
    recipe = loads_train_recipe(_recipe_text(hidden_size=512), "r.yaml")
    with pytest.raises(ConfigError, match="hidden_size 512 does not match the target's width 576"):
        check_against_target(recipe, model)


def test_a_moved_checkout_resumes_its_checkpoints_and_an_edited_prompt_file_does_not(tmp_path):
    from dspark_flow.training.trainer import recipe_key

    keys = []
    for where, text in (("a", "x\n"), ("b", "x\n"), ("c", "y\n")):
        prompts = tmp_path / where / "mine.jsonl"
        prompts.parent.mkdir()
        prompts.write_text(json.dumps({"turns": [text]}) + "\n")
        spec = run_spec(tmp_path / where, "moved", steps=1, new_tokens=8)
        spec["name"] = "test-moved"
        spec["data"]["prompts"] = [{"path": str(prompts)}]
        keys.append(recipe_key(TrainRecipe.model_validate(spec)))
    assert keys[0] == keys[1] != keys[2]


def test_train_check_checks_the_drafter_against_the_target_on_disk(embedded, tmp_path, capsys):
    """`--check` refused what a run would refuse 3 s in only for mistakes inside the recipe;
    the width and the tap layers are checked against the target too when it is on disk."""
    from dspark_flow.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(_recipe_text(hidden_size=512))
    assert main(["train", str(bad), "--check"]) == 2
    err = capsys.readouterr().err
    assert "hidden_size 512 does not match the target's width 576" in err
    assert err.count("\n") == 1


def test_cli_reports_a_bad_training_recipe_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(_recipe_text(block_size=0) + "train:\n  stepz: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_flow.cli.main", "train", str(bad)],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), proc.stderr
    assert "block_size" in lines[0] and "train.stepz: unknown field" in lines[1]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("section", ["data", "train"])
def test_a_negative_training_seed_is_refused_at_validation(section):
    # It used to pass validation and fail inside numpy's generator once the stage began.
    with pytest.raises(RecipeError, match=rf"{section}\.seed: .*greater than or equal to 0"):
        text = _recipe_text() + ("train:\n" if section == "train" else "")
        loads_train_recipe(text + "  seed: -1\n", "r.yaml")


TRAIN_DIR = Path(__file__).parent.parent / "recipes" / "train"
TRAIN_RECIPES = sorted(TRAIN_DIR.glob("*.yaml"))


def _repo_recipes(*kinds: str) -> list[TrainRecipe]:
    """recipes/train/smollm2-135m-KIND.yaml, schema-validated only (their prompt files live in
    ../shared, outside the repo)."""
    return [
        TrainRecipe.model_validate(
            yaml.safe_load((TRAIN_DIR / f"smollm2-135m-{k}.yaml").read_text())
        )
        for k in kinds
    ]


@pytest.mark.parametrize("path", TRAIN_RECIPES, ids=lambda p: p.stem)
def test_the_repos_training_recipes_validate(path):
    # Schema and cross-field checks only: their prompt files live in ../shared, outside the repo.
    recipe = TrainRecipe.model_validate(yaml.safe_load(path.read_text()))
    assert recipe.name == path.stem and recipe.output  # the repo's recipes say where they write
    source = recipe.train.init_from
    if source:  # a warm start never reads what it writes (a rerun would compound)
        assert (path.parent / source).resolve() != (path.parent / recipe.output).resolve()
        if "dspark_flow/data/drafters" in source:  # a shipped drafter: in the repo
            assert (path.parent / source / "config.json").is_file()


def test_the_candidates_share_one_data_set():
    assert len(TRAIN_RECIPES) >= 5
    a, b = (r.data for r in _repo_recipes("dspark-more", "dflash-grow"))
    assert a == b and a.seed == 1  # one generated set (the cache key) serves both


def test_the_dflash_candidate_continues_stage_1_on_its_data():
    base, more = _repo_recipes("dflash-base", "dflash-more")
    # one data section: the set made for stage 1 serves (a lease carries it)
    assert more.data == base.data
    assert (TRAIN_DIR / more.train.init_from).resolve() == (TRAIN_DIR / base.output).resolve()


def test_the_dflash_stages_chain_each_a_new_set_beside_the_last_ones():
    from dspark_flow.training.recipe import load_train_recipe

    base, stage2, shipped = _repo_recipes("dflash-base", "dflash-stage2", "dflash")
    # stage 2's own set: self prompts only (the prompt files are in stage 1's set), a second draw
    assert stage2.data.prompts == [] and stage2.data.seed != base.data.seed
    same = stage2.data.model_dump(exclude={"prompts", "seed", "self_prompts"})
    assert same == base.data.model_dump(exclude={"prompts", "seed", "self_prompts"})
    assert stage2.train.extra_data == ["smollm2-135m-dflash-base.yaml"]
    # stage 3 (shipped): a third draw begun otherwise, its own cache key, both sets beside it
    assert shipped.data.prompts == [] and shipped.data.seed not in {0, stage2.data.seed}
    assert shipped.data.self_prompt_starts != stage2.data.self_prompt_starts
    assert shipped.data not in (base.data, stage2.data)
    assert shipped.train.extra_data == [
        "smollm2-135m-dflash-base.yaml",
        "smollm2-135m-dflash-stage2.yaml",
    ]
    assert shipped.drafter == stage2.drafter == base.drafter
    # each stage warm-starts from the last one's output; only the last ships
    for earlier, later in ((base, stage2), (stage2, shipped)):
        assert (TRAIN_DIR / later.train.init_from).resolve() == (
            TRAIN_DIR / earlier.output
        ).resolve()
    assert "dspark_flow/data/drafters" in shipped.output
    assert "out/drafters" in base.output and "out/drafters" in stage2.output
    if (TRAIN_DIR / "../../../shared/data/prompts").is_dir():  # path checks need the prompt sets
        loaded = load_train_recipe(TRAIN_DIR / "smollm2-135m-dflash.yaml")
        assert loaded.train.extra_data == [
            str((TRAIN_DIR / f"smollm2-135m-dflash-{s}.yaml").resolve()) for s in ("base", "stage2")
        ]


def test_the_dspark_candidate_trains_on_both_stage_2_dflash_sets():
    stage2, candidate = _repo_recipes("dflash-stage2", "dspark-data2")
    # its own set is stage 2's (one cache key), stage 1's joins as extra data
    assert candidate.data == stage2.data
    assert candidate.train.extra_data == stage2.train.extra_data
    assert candidate.train.init_from.endswith("dspark_flow/data/drafters/smollm2-135m-dspark")
    assert "out/drafters" in candidate.output


def test_the_deeper_dflash_candidate_grows_stage_2_on_its_data():
    stage2, candidate = _repo_recipes("dflash-stage2", "dflash-deep")
    # stage 2's sets (one cache key, stage 1's as extra data), two layers added
    assert candidate.data == stage2.data
    assert candidate.train.extra_data == stage2.train.extra_data
    assert candidate.drafter.num_layers == stage2.drafter.num_layers + 2
    same = {"num_layers"}
    assert candidate.drafter.model_dump(exclude=same) == stage2.drafter.model_dump(exclude=same)
    assert (TRAIN_DIR / candidate.train.init_from).resolve() == (
        TRAIN_DIR / stage2.output
    ).resolve()
    assert "out/drafters" in candidate.output


# -- the drafters shipped in the wheel -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_shipped_drafters_load_fit_the_size_limit_and_stay_lossless(embedded, kind):
    from dspark_flow.api import load_drafter
    from dspark_flow.models.loading import resolve_model_path

    model, tok = embedded
    ref = f"builtin:smollm2-135m-{kind}"
    path = resolve_model_path(ref)
    assert sum(f.stat().st_size for f in path.iterdir()) <= 40 * 2**20
    drafter = load_drafter(ref, model)
    assert drafter.config.kind == kind and drafter.max_draft == 7
    _assert_equals_greedy_and_accepts(model, tok, drafter)


def _assert_equals_greedy_and_accepts(model, tok, drafter) -> None:
    """At T = 0 the drafter's speculative output is plain greedy output, with drafts accepted."""
    from dspark_flow.api import greedy_generate, speculative_generate

    for prompt in (
        "Natalia sold 48 clips in April and half as many in May. How many in all?",
        PROMPTS[1],
    ):
        want = greedy_generate(model, tok, prompt, max_new_tokens=48).token_ids
        got = speculative_generate(
            model, tok, drafter, prompt, max_new_tokens=48, max_draft_tokens=None
        )
        assert got.token_ids == want
        assert got.mean_accept_len > 1.0  # the trained drafter does get tokens accepted


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_shipped_drafters_with_the_shipped_recipes_settings_stay_lossless(embedded, kind):
    """The shipped recipes' drafter settings (`draft_vocab: 8192`, `prompt_lookup: true`) on the
    shipped drafters and the real target: T = 0 output is plain greedy output, drafts still get
    accepted, some rounds copy a run instead of running the drafter, and a seeded sampled run
    repeats."""
    from dspark_flow.api import load_drafter, speculative_generate
    from dspark_flow.models.draft_vocab import VOCAB_FILE
    from dspark_flow.models.loading import resolve_model_path
    from dspark_flow.recipe.load import load_recipe

    model, tok = embedded
    ref = f"builtin:smollm2-135m-{kind}"
    assert (resolve_model_path(ref) / VOCAB_FILE).is_file()
    shipped = load_recipe(REPO / "recipes" / f"{kind}.yaml").drafter
    assert shipped.draft_vocab == 8192 and shipped.prompt_lookup is not None
    drafter = load_drafter(ref, model, draft_vocab=8192, prompt_lookup=True)
    assert drafter.token_ids(mx.arange(8192)).shape == (8192,)
    passes = []
    own_pass = drafter.propose_block
    drafter.propose_block = lambda history, k: passes.append(k) or own_pass(history, k)
    _assert_equals_greedy_and_accepts(model, tok, drafter)
    passes.clear()
    echo = speculative_generate(  # an answer that repeats the prompt: runs to copy
        model, tok, drafter, "Repeat after me: the quick brown fox jumps over the lazy dog.",
        max_new_tokens=32, max_draft_tokens=None,
    )  # fmt: skip
    assert 0 < len(passes) < echo.num_rounds, (len(passes), echo.num_rounds)
    runs = [
        speculative_generate(
            model, tok, drafter, PROMPTS[0], max_new_tokens=24, temperature=0.7, seed=3
        ).token_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and 0 < len(runs[0]) <= 24  # (a sampled answer may end early)


@pytest.mark.slow
def test_the_vocab_stage_counts_the_answer_tokens(embedded, tmp_path):
    """`--stage vocab` writes draft_vocab.npy (all ids, most frequent answer token first) into
    the output directory from the cached data; without data it fails in one line."""
    from dspark_flow.models.draft_vocab import VOCAB_FILE
    from dspark_flow.training.data import data_cache_dir, load_samples
    from dspark_flow.training.run import run_training

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["What is 2 + 2?"]}\n{"turns": ["Name three colours."]}\n')
    recipe = TrainRecipe.model_validate(
        {
            "name": f"test-vocab-{tmp_path.name}",
            "drafter": small_recipe("dspark").drafter.model_dump(),
            "data": {
                "prompts": [{"path": str(prompts)}],
                "max_new_tokens": 24,
                "max_prompt_tokens": 64,
                "cache_dir": str(tmp_path / "data"),
            },
            "train": {"seq_len": 96},
            "output": str(tmp_path / "drafter"),
        }
    )
    with pytest.raises(DsparkFlowError, match="no training data") as info:
        run_training(recipe, stages=("vocab",), progress=False)
    assert "\n" not in str(info.value)
    run_training(recipe, stages=("data",), progress=False)
    summary = run_training(recipe, stages=("vocab",), progress=False)
    ids = np.load(tmp_path / "drafter" / VOCAB_FILE)
    answers = np.concatenate(
        [s.tokens[s.prompt_len :] for s in load_samples(data_cache_dir(recipe))]
    )
    counts = np.bincount(answers, minlength=49152)
    assert ids.dtype == np.int32 and sorted(ids.tolist()) == np.flatnonzero(counts).tolist()
    assert (np.diff(counts[ids]) <= 0).all()  # the tokens seen, most frequent first...
    tied = counts[ids][:-1] == counts[ids][1:]
    assert (ids[:-1][tied] < ids[1:][tied]).all()  # ...ties by id
    assert summary["vocab"]["answer_tokens"] == len(answers)
    assert summary["vocab"]["distinct"] == len(ids)
    # No drafter there: nothing claims to describe one. With one, its card gets the count.
    assert not (tmp_path / "drafter" / "README.md").exists()
    (tmp_path / "drafter" / "config.json").write_text("{}")  # a drafter someone else made
    kept = (tmp_path / "drafter" / VOCAB_FILE).read_bytes()
    with pytest.raises(DsparkFlowError, match="did not export"):
        run_training(recipe, stages=("vocab",), progress=False)
    assert (tmp_path / "drafter" / VOCAB_FILE).read_bytes() == kept
    mine = json.dumps({"dspark_flow": {"recipe": recipe.name}})
    (tmp_path / "drafter" / "config.json").write_text(mine)
    run_training(recipe, stages=("vocab",), progress=False)
    card = (tmp_path / "drafter" / "README.md").read_text()
    assert f"among the {len(answers)} answer tokens ({len(ids)} distinct)" in card
    shutil.rmtree(work_dir(recipe), ignore_errors=True)  # the run's record, in the user cache


def test_the_embedded_target_resolves_to_its_shipped_drafter():
    from dspark_flow.models.drafter_loading import resolve_drafter

    assert resolve_drafter("builtin:smollm2-135m")["drafter"] == "builtin:smollm2-135m-dspark"
    assert (
        resolve_drafter("builtin:smollm2-135m", "dflash")["drafter"]
        == "builtin:smollm2-135m-dflash"
    )


def test_a_file_where_the_checkpoints_go_is_named_before_any_work(tmp_path):
    # It was a NotADirectoryError ("internal error") at the first checkpoint, after the data.
    from dspark_flow.training.run import run_training
    from dspark_flow.training.trainer import work_dir

    recipe = TrainRecipe.model_validate(run_spec(tmp_path, "wd-file", steps=1, new_tokens=8))
    where = work_dir(recipe)
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text("mine")
    try:
        with pytest.raises(DsparkFlowError, match="is a file where this recipe keeps"):
            run_training(recipe, stages=("data", "train"), progress=False)
        assert where.read_text() == "mine" and not (tmp_path / "data").exists()
    finally:
        where.unlink()


def test_a_paused_run_says_so_on_the_command_line(embedded, tmp_path, capsys):
    # It exited 0 without a word, which reads as "trained".
    import shutil

    import yaml

    from dspark_flow.cli.main import main
    from dspark_flow.training.trainer import work_dir

    spec = run_spec(tmp_path, "paused-cli", steps=3, new_tokens=8)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(spec))
    try:
        assert main(["train", str(path), "--time-limit", "1e-9", "--quiet"]) == 0
        assert "paused" not in capsys.readouterr().err  # --quiet
        assert main(["train", str(path), "--time-limit", "1e-9", "--stage", "train"]) == 0
        assert "paused at step 2 of 3 (--time-limit); run the same command again" in (
            capsys.readouterr().err
        )
    finally:
        shutil.rmtree(work_dir(TrainRecipe.model_validate(spec)), ignore_errors=True)
