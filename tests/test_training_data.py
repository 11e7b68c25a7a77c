"""Self-distilled training data: prompt files, Magpie self prompts, the batched answer loop
(equal to plain greedy decoding), and the resumable shard cache."""

from __future__ import annotations

import json
import re

import pytest

from dspark_flow.errors import DsparkFlowError, RecipeError
from dspark_flow.training import data as tdata
from dspark_flow.training.recipe import PromptFile, TrainRecipe

PROMPTS = ["What is 7 times 8?", "Name three primary colors.", "Say hello in French."]
MAX_NEW = 12


def _jsonl(path, objs, blank_after: int | None = None):
    lines = [json.dumps(o) for o in objs]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_prompts_ranges_and_limit(tmp_path):
    objs = [{"turns": [f"q{i}", "a later turn"]} for i in range(1, 6)] + [{"prompt": "q6"}]
    f = _jsonl(tmp_path / "set.jsonl", objs, blank_after=2)  # ranges count non-empty lines
    read = tdata.read_prompts
    assert read(PromptFile(path=str(f))) == ["q1", "q2", "q3", "q4", "q5", "q6"]
    assert read(PromptFile(path=str(f), lines="2-4")) == ["q2", "q3", "q4"]
    assert read(PromptFile(path=str(f), lines="5-")) == ["q5", "q6"]
    assert read(PromptFile(path=str(f), lines="-2")) == ["q1", "q2"]
    assert read(PromptFile(path=str(f), lines="2-", limit=2)) == ["q2", "q3"]
    assert read(PromptFile(path=str(f), limit=1)) == ["q1"]


def test_read_prompts_errors(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"turns": ["ok"]}\n\n{"turns": ["ok"]\n{"turns": ["fine"]}\n', encoding="utf-8")
    with pytest.raises(RecipeError) as err:
        tdata.read_prompts(PromptFile(path=str(f)))
    msg = str(err.value)
    assert "\n" not in msg and f"{f}:3: bad JSON" in msg
    # Lines outside the range are not read.
    assert tdata.read_prompts(PromptFile(path=str(f), lines="1-1")) == ["ok"]

    g = _jsonl(tmp_path / "shape.jsonl", [{"turns": []}])
    with pytest.raises(RecipeError, match=rf"{g.name}:1: expected"):
        tdata.read_prompts(PromptFile(path=str(g)))
    with pytest.raises(DsparkFlowError, match="cannot read prompt file"):
        tdata.read_prompts(PromptFile(path=str(tmp_path / "missing.jsonl")))


def _recipe(tmp_path, **data) -> TrainRecipe:
    f = _jsonl(tmp_path / "tiny.jsonl", [{"turns": [p]} for p in PROMPTS])
    spec = {
        "prompts": [{"path": str(f)}],
        "self_prompts": 2,
        "self_prompt_max_tokens": 24,
        "max_new_tokens": MAX_NEW,
        "batch_size": 8,
        "cache_dir": str(tmp_path / "cache"),
    }
    spec.update(data)
    return TrainRecipe.model_validate({"name": "tiny", "data": spec})


@pytest.fixture(scope="module")
def built(embedded, tmp_path_factory):
    model, tok = embedded
    tmp = tmp_path_factory.mktemp("data")
    recipe = _recipe(tmp)
    cache = tdata.build_dataset(recipe, model, tok, progress=False)
    return recipe, cache


def _spy(monkeypatch):
    calls = []
    real = tdata.generate_batch

    def counting(*args, **kwargs):
        calls.append(len(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(tdata, "generate_batch", counting)
    return calls


@pytest.mark.slow
def test_build_matches_plain_greedy(embedded, built):
    from dspark_flow.api import greedy_generate

    model, tok = embedded
    recipe, cache = built
    assert cache == tdata.data_cache_dir(recipe)
    samples = tdata.load_samples(cache)
    assert sorted(s.source for s in samples) == ["self", "self", "tiny", "tiny", "tiny"]

    selfs = [
        json.loads(x)["prompt"] for x in (cache / "self_prompts.jsonl").read_text().splitlines()
    ]
    assert len(selfs) == 2 and all(len(p) >= tdata.MIN_SELF_PROMPT_CHARS for p in selfs)
    expected = {
        tuple(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        for p in PROMPTS + selfs
    }
    assert {tuple(s.tokens[: s.prompt_len].tolist()) for s in samples} == expected

    eos = set(tdata._eos_ids(tok).tolist())
    for s in samples:
        assert s.tokens.dtype.name == "int32"
        answer = s.tokens[s.prompt_len :].tolist()
        ref = greedy_generate(model, tok, s.tokens[: s.prompt_len].tolist(), max_new_tokens=MAX_NEW)
        if ref.finish_reason == "stop":  # ended on EOS: the sample keeps the EOS id
            assert answer[-1] in eos
            answer = answer[:-1]
        else:
            assert len(answer) == MAX_NEW and not eos & set(answer)
        assert answer == list(ref.token_ids), tok.decode(s.tokens.tolist())


@pytest.mark.slow
def test_rerun_resumes_without_generating(embedded, built, monkeypatch):
    model, tok = embedded
    recipe, cache = built
    shards = sorted(cache.glob("shard_*.npz"))
    assert shards
    stamps = {p: p.stat().st_mtime_ns for p in shards}
    calls = _spy(monkeypatch)
    assert tdata.build_dataset(recipe, model, tok, progress=False) == cache
    assert calls == []
    assert {p: p.stat().st_mtime_ns for p in sorted(cache.glob("shard_*.npz"))} == stamps

    # An interrupted run (one shard lost) regenerates just that shard.
    shards[0].unlink()
    with pytest.raises(DsparkFlowError, match="incomplete"):
        tdata.load_samples(cache)
    tdata.build_dataset(recipe, model, tok, progress=False)
    assert calls and len(tdata.load_samples(cache)) == 5


@pytest.mark.slow
def test_changed_key_regenerates(embedded, built, monkeypatch):
    model, tok = embedded
    recipe, cache = built
    before = {s.tokens[: s.prompt_len].tobytes(): s for s in tdata.load_samples(cache)}
    changed = recipe.model_copy(deep=True)
    changed.data.max_new_tokens = 8
    calls = _spy(monkeypatch)
    tdata.build_dataset(changed, model, tok, progress=False)
    assert sum(calls) == 5  # answers only: the self prompts are still valid and reused
    after = tdata.load_samples(cache)
    assert len(after) == 5
    for s in after:
        old = before[s.tokens[: s.prompt_len].tobytes()]
        answer = s.tokens[s.prompt_len :].tolist()
        assert answer == old.tokens[old.prompt_len :].tolist()[:8] or len(answer) < 8
        assert len(answer) <= 8
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["complete"] and manifest["chunks"] == len(list(cache.glob("shard_*.npz")))


@pytest.mark.slow
def test_data_workers_split_the_answers_and_the_last_completes_the_set(
    embedded, tmp_path, monkeypatch
):
    from dspark_flow.cli.main import main

    model, tok = embedded
    monkeypatch.setattr(tdata, "CHUNK_PROMPTS", 2)  # 5 prompts in 3 chunks of batch 2
    recipe = _recipe(tmp_path, batch_size=2, cache_dir=str(tmp_path / "split"))
    calls = _spy(monkeypatch)
    first = tdata.DataWorker.parse("0/2")
    cache = tdata.build_dataset(recipe, model, tok, progress=False, worker=first)
    assert sorted(p.name for p in cache.glob("shard_*.npz")) == [
        "shard_00000.npz",
        "shard_00002.npz",
    ]
    with pytest.raises(DsparkFlowError, match="incomplete"):  # share 1 is not there yet
        tdata.load_samples(cache)
    assert not json.loads((cache / "manifest.json").read_text())["complete"]

    # Worker 1 from the command line: its one chunk (the self prompts are worker 0's), exit 0.
    calls.clear()
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe.model_dump(mode="json")))
    assert main(["train", str(path), "--stage", "data", "--data-worker", "1/2", "--quiet"]) == 0
    assert calls == [2]
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["complete"]
    assert sorted(r["worker"] for r in manifest["shares"]) == ["0/2", "1/2"]
    assert sum(r["generated_chunks"] for r in manifest["shares"]) == 3
    # Same prompts (same seeds), same greedy answers as one process makes.
    alone = _recipe(tmp_path, batch_size=2, cache_dir=str(tmp_path / "alone"))
    whole = tdata.load_samples(tdata.build_dataset(alone, model, tok, progress=False))
    assert sorted(s.tokens.tobytes() for s in tdata.load_samples(cache)) == sorted(
        s.tokens.tobytes() for s in whole
    )


def test_other_workers_wait_for_worker_0s_self_prompts(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(tdata, "WORKER_POLL_SECONDS", 0.01)
    path = tmp_path / tdata.SELF_PROMPTS
    got: list[list[str]] = []
    waiter = threading.Thread(
        target=lambda: got.append(
            tdata._wait_for_self_prompts(path, "k", 3, tdata.DataWorker(1, 2))
        ),
        daemon=True,  # a failing test must not leave the run waiting on it
    )
    waiter.start()
    rows = [{"prompt": f"p{i}", "batch": 0, "key": "k"} for i in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    waiter.join(0.3)
    assert waiter.is_alive()  # two of three: not yet
    # Worker 0 declares two final (it fell short of the number asked): the waiter takes them.
    (tmp_path / tdata.SELF_PROMPTS_DONE).write_text(json.dumps({"key": "k", "count": 2}))
    waiter.join(5)
    assert got == [["p0", "p1"]]

    # A declaration under another key is not this data's; with no worker 0 the wait ends in one line.
    (tmp_path / tdata.SELF_PROMPTS_DONE).write_text(json.dumps({"key": "other", "count": 2}))
    monkeypatch.setattr(tdata, "WORKER_WAIT_SECONDS", 0.05)
    with pytest.raises(DsparkFlowError, match="no self prompts from worker 0") as err:
        tdata._wait_for_self_prompts(path, "k", 3, tdata.DataWorker(1, 2))
    assert "\n" not in str(err.value)


def test_the_data_folder_follows_the_prompts_contents_not_their_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_FLOW_HOME", str(tmp_path / "home"))
    text = '{"turns": ["What is 2 + 2?"]}\n'
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "p.jsonl").write_text(text)

    def recipe(folder: str) -> TrainRecipe:
        prompts = [{"path": str(tmp_path / folder / "p.jsonl")}]
        return TrainRecipe.model_validate({"name": "x", "data": {"prompts": prompts}})

    moved = tdata.data_cache_dir(recipe("b"))
    assert tdata.data_cache_dir(recipe("a")) == moved  # same prompts elsewhere: same data
    # A folder named the old way (by the prompt file's path) is adopted, with its contents.
    old = moved.parent / tdata._cache_name(recipe("a"), by_content=False)
    old.mkdir(parents=True)
    (old / tdata.MANIFEST).write_text("{}")
    assert tdata.data_cache_dir(recipe("a")) == moved
    assert (moved / tdata.MANIFEST).is_file() and not old.exists()
    (tmp_path / "b" / "p.jsonl").write_text(text + '{"turns": ["Name a colour."]}\n')
    assert tdata.data_cache_dir(recipe("b")) != moved  # other contents: other data


def test_free_only_data_keeps_its_cache_folder_and_key():
    # Digests computed by the code before self_prompt_starts existed: caches made then are reused.
    recipe = TrainRecipe.model_validate({"name": "pin", "data": {"self_prompts": 100}})
    assert tdata.data_cache_dir(recipe).name == "5c45c9bb21b95dc6"
    assert tdata._self_key(recipe) == (
        "cb8b44f8e560a7b0005da19e0f9eb838f7de4643f89c3b9c3bf6820672a86cab"
    )
    both_free = {"self_prompts": 100, "self_prompt_starts": ["", ""]}
    same = TrainRecipe.model_validate({"name": "pin", "data": both_free})
    assert tdata.data_cache_dir(same) == tdata.data_cache_dir(recipe)
    steered = {"self_prompts": 100, "self_prompt_starts": ["", "Write a Python function"]}
    other = TrainRecipe.model_validate({"name": "pin", "data": steered})
    assert tdata.data_cache_dir(other) != tdata.data_cache_dir(recipe)
    assert tdata._self_key(other) != tdata._self_key(recipe)
    with pytest.raises(Exception, match="ends in a space"):
        TrainRecipe.model_validate(
            {"name": "pin", "data": {"self_prompts": 1, "self_prompt_starts": ["Write a "]}}
        )


def test_data_worker_parse_errors(tmp_path):
    from dspark_flow.training.run import run_training

    assert tdata.DataWorker.parse("1/3") == tdata.DataWorker(1, 3)
    for bad in ("2/2", "x/2", "1", "0/0", "-1/2", ""):  # "" used to mean "all of it"
        with pytest.raises(DsparkFlowError, match="data worker"):
            tdata.DataWorker.parse(bad)
    # A share is data only: refused before any model is loaded.
    with pytest.raises(DsparkFlowError, match="runs the data stage only"):
        run_training(_recipe(tmp_path), stages=("data", "train"), data_worker="0/2")
    with pytest.raises(DsparkFlowError, match="data worker ''"):
        run_training(_recipe(tmp_path), stages=("data",), data_worker="")


@pytest.mark.slow
def test_self_prompt_starts_begin_the_user_turns_in_turn(embedded, tmp_path):
    model, tok = embedded
    start = "Write a Python function"
    recipe = _recipe(tmp_path, batch_size=1, self_prompt_starts=["", start])
    cache = tdata.data_cache_dir(recipe)
    cache.mkdir(parents=True)
    made = tdata._self_prompts(recipe, model, tok, cache, set(), False, tdata.DataWorker())
    assert len(made) == 2
    assert not made[0].startswith(start) and made[1].startswith(start)
    assert len(made[1]) >= len(start) + tdata.MIN_SELF_PROMPT_CHARS


def _write_recipe(path, name, data, **train):
    import yaml

    body = {"name": name, "data": data, **({"train": train} if train else {})}
    path.write_text(yaml.safe_dump(body), encoding="utf-8")
    return path


@pytest.mark.slow
def test_extra_data_trains_on_both_sets_a_repeated_prompt_once(embedded, built, tmp_path):
    from dspark_flow.training.recipe import load_train_recipe

    model, tok = embedded
    first, first_cache = built
    a = _write_recipe(tmp_path / "a.yaml", "a", first.data.model_dump(mode="json"))
    assert tdata.data_cache_dir(load_train_recipe(a)) == first_cache
    # The second set: one prompt of the first set again and one new.
    f = _jsonl(tmp_path / "b.jsonl", [{"turns": [PROMPTS[0]]}, {"turns": ["Count to five."]}])
    data = {"prompts": [{"path": str(f)}], "max_new_tokens": MAX_NEW, "batch_size": 8}
    data["cache_dir"] = str(tmp_path / "b-cache")
    b = load_train_recipe(_write_recipe(tmp_path / "b.yaml", "b", data, extra_data=["a.yaml"]))
    with pytest.raises(DsparkFlowError, match=r"b's data|no training data"):
        tdata.training_samples(b)  # its own set not made yet
    own = tdata.load_samples(tdata.build_dataset(b, model, tok, progress=False))
    samples, extra = tdata.training_samples(b)
    theirs = tdata.load_samples(first_cache)
    assert len(own) == 2 and len(samples) == len(own) + len(theirs) - 1
    assert extra == [
        {
            "recipe": "a",
            "cache": str(first_cache),
            "samples": len(theirs) - 1,
            "repeats_left_out": 1,
        }
    ]
    prompts = [s.tokens[: s.prompt_len].tobytes() for s in samples]
    assert len(set(prompts)) == len(prompts)
    assert [s.tokens.tobytes() for s in samples[:2]] == [s.tokens.tobytes() for s in own]


def test_extra_data_not_made_says_which_stage_to_run(tmp_path, monkeypatch):
    from dspark_flow.training.recipe import load_train_recipe

    monkeypatch.setenv("DSPARK_FLOW_HOME", str(tmp_path / "home"))
    f = _jsonl(tmp_path / "p.jsonl", [{"turns": ["What is 2 + 2?"]}])
    _write_recipe(tmp_path / "a.yaml", "a", {"prompts": [{"path": str(f)}]})
    b = load_train_recipe(
        _write_recipe(tmp_path / "b.yaml", "b", {"self_prompts": 4}, extra_data=["a.yaml"])
    )
    with pytest.raises(DsparkFlowError) as err:
        tdata.training_samples(b, own=[])
    msg = str(err.value)
    assert "a's data set is not ready" in msg and f"train {tmp_path / 'a.yaml'} --stage data" in msg
    assert "\n" not in msg
    # The run checks it before making its own data (minutes), not after.
    with pytest.raises(DsparkFlowError, match=r"a's data set is not made .*--stage data$"):
        tdata.require_extra_data(b)
    from dspark_flow.training.run import run_training

    with pytest.raises(DsparkFlowError, match="a's data set is not made"):
        run_training(b, stages=("data", "train"), progress=False)
    assert not tdata.data_cache_dir(b).exists()  # nothing made for b


def test_extra_data_refused_at_validation(tmp_path):
    from dspark_flow.training.recipe import extra_data_recipes, load_train_recipe

    f = _jsonl(tmp_path / "p.jsonl", [{"turns": ["What is 2 + 2?"]}])
    data = {"prompts": [{"path": str(f)}]}
    _write_recipe(tmp_path / "plain.yaml", "plain", data)
    other = _write_recipe(tmp_path / "other.yaml", "other", data)
    text = other.read_text() + "target: {model: some/other-model}\n"
    other.write_text(text)
    (tmp_path / "broken.yaml").write_text("name: broken\ndata: {self_prompts: -1}\n")
    cases = {
        "missing.yaml": "training recipe not found",
        "other.yaml": "other's target (some/other-model) is not this recipe's",
        "broken.yaml": "is not a valid training recipe",
        "self.yaml": "names this recipe itself",
    }
    # A named recipe's own extra data is not followed: two recipes naming each other load
    # (each adds the other's own set), rather than loading each other back and forth.
    _write_recipe(tmp_path / "ping.yaml", "ping", data, extra_data=["pong.yaml"])
    _write_recipe(tmp_path / "pong.yaml", "pong", data, extra_data=["ping.yaml"])
    ping = load_train_recipe(tmp_path / "ping.yaml")
    assert [r.name for r in extra_data_recipes(ping)] == ["pong"]
    for name, why in cases.items():
        path = _write_recipe(tmp_path / "self.yaml", "self", data, extra_data=[name])
        with pytest.raises(RecipeError, match=re.escape(why)) as err:
            load_train_recipe(path)
        assert str(err.value).startswith(f"{path} train.extra_data[0]: ")
        assert "\n" not in str(err.value)
    # A recipe without the setting keeps the checkpoint key it had before the setting existed
    # (computed then), so its checkpoints still resume; one with it has another key.
    from dspark_flow.training.trainer import recipe_key

    plain = load_train_recipe(tmp_path / "plain.yaml")
    assert recipe_key(plain) == "4a5052d8d8bea664"
    assert recipe_key(ping) != recipe_key(plain)
