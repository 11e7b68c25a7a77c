"""Bad input anywhere ends in one clear line (CLI: exit 2; API: a DsparkFlowError; HTTP: a 400
naming the parameter), never a traceback, a crash or a silent wrong result. The cases are those
a review found slipping through (2026-11-30); the commands that already held are tested where
their feature is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dspark_flow.cli.main import main
from dspark_flow.errors import ConfigError, DsparkFlowError, ModelError, PromptError

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = str(REPO / "recipes" / "quickstart.yaml")


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_an_unknown_log_level_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["validate", QUICKSTART, "--log-level", "bogus"])
    assert exit_.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    assert main(["validate", QUICKSTART, "--log-level", "INFO"]) == 0


def test_a_bad_set_value_is_one_line(capsys):
    assert main(["validate", QUICKSTART, "--set", "drafter={kind: lookup"]) == 2
    assert "value is not valid YAML" in _one_error_line(capsys)
    # An unknown section an override made is located at the override, not in the file.
    assert main(["validate", QUICKSTART, "--set", "nope.x=1"]) == 2
    assert _one_error_line(capsys) == "error: --set nope.x=1 nope: unknown field"
    assert main(["validate", QUICKSTART, "--set", "..=1"]) == 2
    assert "empty part in the key path" in _one_error_line(capsys)


def test_bench_from_a_malformed_json_or_into_a_file(tmp_path, capsys):
    for body in ({"meta": 1, "runs": 2, "summary": 3}, {"meta": {}, "runs": [{}], "summary": {}}):
        path = tmp_path / "bench.json"
        path.write_text(json.dumps(body))
        assert main(["bench", "--from-json", str(path), "--out", str(tmp_path / "o")]) == 2
        assert "is not a bench.json this version can render" in _one_error_line(capsys)
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    assert main(["bench", "--from-json", str(path), "--out", str(a_file)]) == 2
    assert "is a file" in _one_error_line(capsys)
    assert a_file.read_text() == "x"  # nothing lost


def test_a_bench_that_fails_early_leaves_no_folder_and_replaces_no_report(tmp_path, capsys):
    out = tmp_path / "fresh"
    assert main(["bench", QUICKSTART, "--trials", "0", "--out", str(out)]) == 2
    assert "at least 1" in _one_error_line(capsys) and not out.exists()
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"meta": {}, "runs": [], "summary": []}))
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "bench.md").write_text("an earlier report")
    assert main(["bench", "--from-json", str(empty), "--out", str(kept)]) == 2
    assert "holds no runs" in _one_error_line(capsys)
    assert (kept / "bench.md").read_text() == "an earlier report"


def test_argument_errors_empty_inputs_and_huge_drafts_are_one_line(tmp_path, capsys):
    for argv in (
        ["run", QUICKSTART],
        ["run", QUICKSTART, "--prompt", "x", "--max-tokens", "x"],
        ["train", "r.yaml", "--stage", "bogus"],
        [],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "--help)" in _one_error_line(capsys)  # no usage block before it
    assert main(["run", QUICKSTART, "--prompt", "  "]) == 2  # before any model loads
    assert "the prompt is empty" in _one_error_line(capsys)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# a recipe still to write\n")
    assert main(["validate", str(empty)]) == 2
    assert "the recipe is empty" in _one_error_line(capsys)
    huge = ["validate", QUICKSTART, "--set", "drafter={kind: lookup, max_draft: 99999999999}"]
    assert main(huge) == 2
    assert "less than or equal to 1024" in _one_error_line(capsys)


def test_a_draft_vocab_that_is_no_array_is_named_as_such(tmp_path):
    from dspark_flow.models.draft_vocab import VOCAB_FILE, read_draft_vocab

    (tmp_path / VOCAB_FILE).write_text("garbage")
    with pytest.raises(ConfigError, match="not a .npy array file") as info:
        read_draft_vocab(tmp_path, 10, 100)
    assert "pickle" not in str(info.value)


def test_zero_repeats_are_refused_not_replaced(capsys):
    recipe = str(REPO / "recipes" / "lookup_auto.yaml")
    assert main(["calibrate", recipe, "--repeats", "0", "--depths", "16"]) == 2
    assert "--repeats" in _one_error_line(capsys)
    assert main(["calibrate", recipe, "--depths", ""]) == 2  # not the defaults
    assert "--depths" in _one_error_line(capsys)
    assert main(["bench", QUICKSTART, "--verify-repeats", "0"]) == 2
    assert "--verify-repeats" in _one_error_line(capsys)


def _train_recipe(tmp_path: Path, prompt_path: str) -> str:
    path = tmp_path / "train.yaml"
    path.write_text(
        f"name: t\ndrafter: {{kind: dspark, block_size: 4}}\n"
        f"data: {{prompts: [{{path: {prompt_path}}}]}}\n"
    )
    return str(path)


def test_train_check_reads_the_prompt_files_and_the_flags(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text('{"turns": ["hello"]}\n')
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"turns": [\n')
    assert main(["train", _train_recipe(tmp_path, str(corrupt)), "--check"]) == 2
    assert "bad JSON" in _one_error_line(capsys)
    assert main(["train", _train_recipe(tmp_path, str(tmp_path)), "--check"]) == 2
    assert "is a directory" in _one_error_line(capsys)
    recipe = _train_recipe(tmp_path, str(good))
    assert main(["train", recipe, "--check"]) == 0
    capsys.readouterr()
    assert main(["train", recipe, "--check", "--time-limit", "-5"]) == 2
    assert "--time-limit" in _one_error_line(capsys)
    assert main(["train", recipe, "--check", "--data-worker", "foo"]) == 2
    assert "expected I/N" in _one_error_line(capsys)
    # --check refuses what the run would refuse (it used to say ok to both)
    assert main(["train", recipe, "--check", "--data-worker", "0/2"]) == 2
    assert "runs the data stage only" in _one_error_line(capsys)
    assert main(["train", recipe, "--check", "--stage", "eval"]) == 2
    assert "names no eval.prompts" in _one_error_line(capsys)
    # Output problems that export used to find only after training.
    afile = tmp_path / "afile"
    afile.write_text("mine")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    card = tmp_path / "card"  # a hub drafter's folder, say: only names a drafter might have
    card.mkdir()
    (card / "README.md").write_text("mine")
    drafter, other = tmp_path / "drafter", tmp_path / "other"
    for folder, name in ((drafter, "t"), (other, "someone-else")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"dspark_flow": {"recipe": name}}))
    for sets, why in [
        ([f"output={afile}"], "is a file"),
        ([f"output={afile / 'sub'}"], f"{afile} is a file, not a folder"),
        ([f"output={notes}"], "holds files this tool did not export (notes.txt)"),
        ([f"output={card}"], "holds files this tool did not export (README.md)"),
        ([f"output={other}"], "recipe 'someone-else' exported (--replace replaces it)"),
        ([f"output={drafter}", f"train.init_from={drafter}"], "is the output directory"),
    ]:
        argv = ["train", recipe, "--check"] + [a for s in sets for a in ("--set", s)]
        assert main(argv) == 2
        assert why in _one_error_line(capsys)
    assert afile.read_text() == "mine" and (notes / "notes.txt").read_text() == "mine"
    assert (card / "README.md").read_text() == "mine"
    assert main(["train", recipe, "--check", "--set", f"output={drafter}"]) == 0
    assert main(["train", recipe, "--check", "--replace", "--set", f"output={other}"]) == 0
    capsys.readouterr()
    # A prompt file or line range holding no prompts is a slip, found before any work.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["train", recipe, "--check", "--set", f"data.prompts.0.path={empty}"]) == 2
    assert f"no prompts in {empty}" in _one_error_line(capsys)
    assert main(["train", recipe, "--check", "--set", "data.prompts.0.lines=5-"]) == 2
    assert "no prompts in" in (line := _one_error_line(capsys)) and "within lines 5-" in line
    # More blocks a sequence than it has positions: refused, not a 149 GiB allocation later.
    assert main(["train", recipe, "--check", "--set", "train.anchors_per_seq=100000"]) == 2
    assert "exceeds train.seq_len" in _one_error_line(capsys)
    # A key given twice: the inference recipe's loader refuses it, and so does training's.
    twice = tmp_path / "twice.yaml"
    twice.write_text(Path(recipe).read_text() + "name: u\n")
    assert main(["train", str(twice), "--check"]) == 2
    assert "name: duplicate key" in _one_error_line(capsys)
    # A warm start that does not exist yet is noted (a later stage may be checked first).
    assert main(["train", recipe, "--check", "--set", f"train.init_from={tmp_path / 'no'}"]) == 0
    assert "does not exist yet" in capsys.readouterr().err


def test_http_content_errors_name_what_is_wrong():
    from dspark_flow.server import openai_api as o
    from dspark_flow.server.common import ApiError, parse_model

    def problem(model, body) -> str:
        with pytest.raises(ApiError) as err:
            parse_model(model, body)
        return str(err.value)

    user = {"role": "user"}
    chat = o.ChatCompletionRequest
    assert "'messages[0].content[0]'" in problem(
        chat, {"model": "m", "messages": [{**user, "content": ["hi"]}]}
    )
    assert "'messages[0].content[0].text'" in problem(
        chat, {"model": "m", "messages": [{**user, "content": [{"type": "text", "text": 5}]}]}
    )
    assert "'prompt[2]': Input should be a valid integer" in problem(
        o.CompletionRequest, {"model": "m", "prompt": [1, 2, "x"]}
    )
    assert "a text part needs its 'text'" in problem(
        chat, {"model": "m", "messages": [{**user, "content": [{"type": "text"}]}]}
    )


def test_the_api_refuses_bad_prompts_and_arguments(embedded):
    from dspark_flow import Pipeline, greedy_generate, load_pair, speculative_generate

    model, tok = embedded
    vocab = model.args.vocab_size
    for ids in ([vocab], [99_999_999], [-5, 3]):  # 99_999_999 crashed MLX's CPU gather
        with pytest.raises(PromptError, match="outside the vocabulary"):
            greedy_generate(model, tok, ids, max_new_tokens=2)
    for prompt, why in [
        (123, "got int"),
        (None, "got NoneType"),
        ([], "the prompt is empty"),
        ([{"content": "no role"}], "expected a chat message"),
        ([1, 2, True], r"prompt\[2\] is bool"),
        ([1, {"role": "user", "content": "hi"}], r"prompt\[1\] is dict"),
        ("abc\udcff", "the prompt is not valid UTF-8"),  # undecodable bytes, surrogateescaped
        ([{"role": "user", "content": "\ud800"}], r"prompt\[0\].content is not valid UTF-8"),
    ]:
        with pytest.raises(PromptError, match=why):
            greedy_generate(model, tok, prompt, max_new_tokens=2)
    ids = tok.encode("Hello")  # numpy integers are token ids too
    as_numpy = greedy_generate(model, tok, list(np.array(ids)), max_new_tokens=3, chat=False)
    assert as_numpy.token_ids == greedy_generate(model, tok, ids, max_new_tokens=3).token_ids
    with pytest.raises(ConfigError, match="needs a drafter"):
        speculative_generate(model, tok, None, "hi", max_new_tokens=2)
    with pytest.raises(ConfigError, match="expected a loaded model"):
        greedy_generate("notamodel", tok, "hi", max_new_tokens=2)
    with pytest.raises(ConfigError, match="drafter dspark: quantize"):
        load_pair(quantize=3)
    with pytest.raises(ConfigError, match="target is a model name or path"):
        load_pair(5)  # type: ignore[arg-type]
    with pytest.raises(ModelError, match="the model name is empty"):
        load_pair("")
    plain = Pipeline.from_dict({"drafter": {"kind": "none"}}, target=(model, tok))
    with pytest.raises(ConfigError, match="sampler: expected a recipe section"):
        plain.generate("hi", max_new_tokens=2, sampler=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="stop: expected a string or a list of strings"):
        plain.generate("hi", max_new_tokens=2, stop=5)  # type: ignore[arg-type]
    assert plain.generate("hi", max_new_tokens=2, stop={"zz"}).num_tokens >= 1  # any iterable
    # One stop string given bare is one string, not its characters.
    plain = greedy_generate(model, tok, "Say hello", max_new_tokens=8)
    bare = greedy_generate(model, tok, "Say hello", max_new_tokens=8, stop="zzHello")
    assert bare.token_ids == plain.token_ids
    # An empty stop string is refused however given (stop="" used to be dropped silently),
    # and a dict is no list of strings.
    for stop in ("", [""], ("a", "")):
        with pytest.raises(ConfigError, match="stop strings must not be empty"):
            greedy_generate(model, tok, "hi", max_new_tokens=2, stop=stop)
    with pytest.raises(ConfigError, match="expected a string or a list of strings"):
        greedy_generate(model, tok, "hi", max_new_tokens=2, stop={"a": 1})
    # And one override given bare is one override.
    pipeline = Pipeline.from_yaml(QUICKSTART, overrides="drafter.kind=lookup")
    assert pipeline.recipe.drafter.kind == "lookup"


def test_the_api_names_objects_of_the_wrong_kind(embedded):
    """What an audit of the Python API found ending in an AttributeError, a TypeError from
    inside a template, a misleading hub error or nothing at all (2026-12-03)."""
    from dspark_flow import Pipeline, calibrate, greedy_generate, load_drafter, speculative_generate
    from dspark_flow.pipeline import build_strategy

    model, tok = embedded
    cases = [
        (lambda: speculative_generate(model, tok, tok, "hi"), "drafter .*TokenizerWrapper"),
        (lambda: speculative_generate(model, tok, 5, "hi"), "drafter .*got int"),
        (lambda: load_drafter(None, model), "checkpoint is a drafter name or path"),
        (lambda: load_drafter("builtin:smollm2-135m-dspark", tok), "target is a loaded model"),
        (lambda: load_drafter("builtin:smollm2-135m-dspark", None), "target is a loaded model"),
        (lambda: load_drafter("builtin:smollm2-135m-dspark", model, kind="lookup"), "kind 'lookup' loads no checkpoint"),
        (lambda: load_drafter("no/such-drafter", model, kind="dspk"), "unknown drafter 'dspk'; did you mean 'dspark'"),
        (lambda: greedy_generate(model, tok, [{"role": "user", "content": None}]), r"prompt\[0\].content: expected text"),
        (lambda: greedy_generate(model, tok, [{"role": "user", "content": 5}]), r"got int"),
        (lambda: greedy_generate(model, tok, "hi", on_text=5), "on_text is a function"),
        (lambda: Pipeline.from_dict({}, target=(model, tok)).generate("hi", chat="no"), "chat is True, False or None"),
        (lambda: Pipeline.from_dict({}, target=tok).warm_up(), r"expected \(model, tokenizer\)"),
        (lambda: Pipeline.from_dict({}, target=(model, model)).warm_up(), "no tokenizer"),
        (lambda: Pipeline.from_dict({}, target=(model, tok), draftcap=1), "unknown strategy slot draftcap"),
        (lambda: Pipeline.from_dict({}, target=(model, tok), sampler="x"), "sampler is a strategy object"),
        (lambda: Pipeline.from_dict({}, drafter=build_strategy("sampler", {"kind": "greedy"})), r"drafter= takes a drafter strategy, got a sampler \(GreedySampler\)"),
        (lambda: build_strategy("drafter", {}), "drafter: missing 'kind' .installed: "),
        (lambda: calibrate((model, tok), acceptance=2), "calibrate: acceptance: Input should be less than 1"),
        (lambda: calibrate((model, tok), depths=[-1]), "calibrate: depths.0"),
        (lambda: calibrate((model, tok), depths=5), "calibrate: depths"),
        (lambda: calibrate(None), "calibrate: target is a loaded model"),
        (lambda: calibrate((model, tok), mode=None), "calibrate: mode"),
    ]  # fmt: skip
    for call, words in cases:
        with pytest.raises((ConfigError, PromptError), match=words) as info:
            call()
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="cap_controller is a draft cap"):
        speculative_generate(
            model, tok, "builtin:smollm2-135m-dspark", "hi", cap_controller="fixed"
        )
    # Recipe.model_validate (not from_dict) leaves the sections bare: they are checked against
    # their kinds' own configs when the pipeline builds them, not found lacking a field later.
    from dspark_flow import Recipe
    from dspark_flow.recipe.schema import SLOT_DEFAULTS

    bare = Recipe.model_validate({**SLOT_DEFAULTS, "drafter": {"kind": "lookup"}})
    pipeline = Pipeline(bare, target=(model, tok))
    assert pipeline.verifier.config.attention == "auto" and pipeline.drafter.config.max_draft > 0


def test_what_a_second_audit_of_the_api_found(embedded, tmp_path):
    """An AttributeError, an empty chat prompt answered, seeds unchecked when greedy, a garbled
    message and a misleading calibration error (2026-12-03, session 37)."""
    from dspark_flow import (
        Pipeline,
        calibrate,
        greedy_generate,
        load_drafter,
        load_target,
        speculative_generate,
    )
    from dspark_flow.errors import RecipeError

    model, tok = embedded
    assert Pipeline({"drafter": {"kind": "lookup"}}, target=(model, tok)).recipe.drafter.kind == (
        "lookup"
    )
    with pytest.raises(ConfigError, match="the recipe is a Recipe or a dict, got int"):
        Pipeline(5)  # type: ignore[arg-type]
    with pytest.raises(PromptError, match="the prompt is empty"):
        greedy_generate(model, tok, "", max_new_tokens=1)
    for seed in ("x", -1, 1.5):
        with pytest.raises(RecipeError, match="seed"):
            greedy_generate(model, tok, "hi", max_new_tokens=1, seed=seed)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="greedy_generate.. sets draft_cap itself"):
        greedy_generate(model, tok, "hi", draft_cap={"kind": "fixed", "k": 2})
    with pytest.raises(TypeError, match="decodes without a drafter"):
        greedy_generate(model, tok, "hi", objects={"drafter": object()})
    with pytest.raises(ConfigError, match=r"a loaded drafter \(load_pair.* got Model$"):
        speculative_generate(model, tok, model, "hi")  # type: ignore[arg-type]
    # A drafter loaded with another instance of the target reads that one's features; calibrate
    # said "use verifier 'reference'" (which it was using). It warms the drafter as a Pipeline does.
    other = load_target()[0]
    drafter = load_drafter("builtin:smollm2-135m-dspark", other)
    pipe = Pipeline.from_dict({}, target=(other, tok), drafter=drafter).warm_up()
    before = pipe.generate("What is 2+2?", max_new_tokens=6).token_ids
    cap = calibrate(
        (model, tok), drafter, mode="dspark", cache_dir=str(tmp_path), depths=[16],
        repeats=1, warmup=0, max_k=2,
    )  # fmt: skip
    assert cap.curves.block == 2
    # ...and goes back: a Pipeline warmed with it before still reads its own target.
    assert drafter.bound_to is other
    assert pipe.generate("What is 2+2?", max_new_tokens=6).token_ids == before


def test_the_wrappers_name_themselves_for_keywords_they_do_not_take(embedded):
    # Python's own TypeError named run_recipe, a function the caller never called.
    from dspark_flow import dflash_generate, greedy_generate, lookup_generate, speculative_generate

    model, tok = embedded
    cases = [
        (lambda: greedy_generate(model, tok, "hi", drafter={"kind": "lookup"}), r"greedy_generate\(\) sets drafter itself"),
        (lambda: greedy_generate(model, tok, "hi", max_tokens=3), r"greedy_generate\(\) .*'max_tokens'; did you mean max_new_tokens"),
        (lambda: lookup_generate(model, tok, "hi", draft_cap={"kind": "fixed"}), r"lookup_generate\(\) sets draft_cap itself"),
        (lambda: speculative_generate(model, tok, "builtin:smollm2-135m-dspark", "hi", objects={}), r"speculative_generate\(\) sets objects"),
        (lambda: dflash_generate(model, tok, "builtin:smollm2-135m-dflash", "hi", temprature=0.5), r"dflash_generate\(\) .*did you mean temperature"),
        (lambda: speculative_generate(model, tok, "builtin:smollm2-135m-dspark", "hi", max_draft_token=3), r"did you mean max_draft_tokens\?"),
        (lambda: lookup_generate(model, tok, "hi", max_draft=8), r"did you mean max_draft_tokens\?"),
    ]  # fmt: skip
    for call, words in cases:
        with pytest.raises(TypeError, match=words) as info:
            call()
        assert "run_recipe" not in str(info.value)


def test_a_drafter_kind_given_as_a_checkpoint_is_named_before_the_hub_is_asked(
    embedded, tmp_path, monkeypatch
):
    # speculative_generate(..., "lookup") went to the hub for a repo called 'lookup'.
    from dspark_flow import load_drafter, speculative_generate

    model, tok = embedded
    with pytest.raises(
        ConfigError, match="'lookup' is a drafter kind, not a checkpoint; use lookup_generate"
    ):
        speculative_generate(model, tok, "lookup", "hi", max_new_tokens=2)
    with pytest.raises(
        ConfigError, match="'dspark' is a drafter kind, not a checkpoint; pass its checkpoint"
    ):
        load_drafter("dspark", model)
    # A local folder of that name is still a checkpoint, read as one.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dspark").mkdir()
    with pytest.raises(ModelError, match="dspark"):
        load_drafter("dspark", model)


def test_a_revision_for_the_built_in_model_is_refused(capsys):
    from dspark_flow import load_target

    # It used to be ignored: the user believed the revision pinned something.
    with pytest.raises(ModelError, match="revision 'v2': builtin:smollm2-135m is built in"):
        load_target("builtin:smollm2-135m", revision="v2")
    assert main(["run", QUICKSTART, "--prompt", "hi", "--set", "target.revision=v2"]) == 2
    assert capsys.readouterr().err.startswith("error: revision 'v2': builtin:smollm2-135m")


def test_a_verdict_with_wrong_types_is_probed_again(tmp_path):
    from dspark_flow.kernels import probe

    store = probe.VerdictCache(tmp_path)
    key = probe.ProbeKey.make("qmm_small_m", "v", "fmt", 2, 8, 8, "float32")
    store.put(key, probe.Verdict(False, "slower", 1.0, 0.5, 0.0, correct=True))
    raw = json.loads(store.path.read_text())
    entry = next(iter(raw["entries"].values()))
    entry.update(enabled="false", correct="false")  # a string "false" reads as true
    store.path.write_text(json.dumps(raw))
    assert probe.VerdictCache(tmp_path).get(key) is None


def test_a_prompt_of_undecodable_bytes_is_one_line(capsys):
    import os
    import subprocess
    import sys

    # argv carries undecodable bytes as lone surrogates (surrogateescape), as a shell would.
    code = "import sys; from dspark_flow.cli.main import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "run", QUICKSTART, "--max-tokens", "2", "--prompt"]
    done = subprocess.run([*argv, b"abc\xff"], capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})  # fmt: skip
    err = done.stderr.decode("utf-8", "replace").strip().splitlines()
    assert done.returncode == 2, err
    assert err == ["error: the prompt is not valid UTF-8 text (at character 4)"], err


def test_infinite_or_nan_numbers_are_refused(tmp_path, capsys):
    """YAML spells them .inf and .nan; a temperature of .inf sampled uniform noise."""
    for value in (".inf", "-.inf", ".nan"):
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"version: 1\nsampler: {{kind: sample, temperature: {value}}}\n")
        assert main(["validate", str(recipe)]) == 2
        assert "sampler.temperature: Input should be a finite number" in _one_error_line(capsys)


def test_a_boolean_for_a_number_and_a_kind_that_is_no_name(tmp_path, capsys):
    """YAML's true would pass as 1 (`k: true`, `temperature: true`): a slip, refused."""
    for section, message in [
        ("draft_cap: {kind: fixed, k: true}", "draft_cap: k: expected a number, got true"),
        ("sampler: {kind: sample, temperature: false}", "sampler: temperature: expected a number"),
        ("drafter: {kind: 3}", "drafter.kind: expected a kind's name, got 3"),
        # a bool for a Literal of ints, a number for a bool, text for an integer: read as 1,
        # true and 3 before
        ("version: true", "version: expected a number, got true"),
        ("prompt: {chat: 1}", "chat: expected true or false, got 1"),
        ("draft_cap: {kind: fixed, k: '3'}", "draft_cap: k: expected a number, got the text '3'"),
    ]:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(section if section.startswith("version") else f"version: 1\n{section}\n")
        assert main(["validate", str(recipe)]) == 2
        assert message in _one_error_line(capsys)
    recipe.write_text("version: 1\nverifier: {kind: kernels, invariant: true}\n")  # real bools pass
    assert main(["validate", str(recipe)]) == 0
    # a float written as YAML 1.1 reads it (no dot: text) still passes
    recipe.write_text("version: 1\nsampler: {kind: sample, temperature: 7e-1}\n")
    assert main(["validate", str(recipe)]) == 0


def test_more_inputs_a_review_found_ending_in_a_traceback(tmp_path, capsys):
    # A size flag of inf overflowed int() inside argparse, before the CLI's error handling.
    with pytest.raises(SystemExit) as exit_:
        main(["serve", QUICKSTART, "--cache-bytes", "inf"])
    assert exit_.value.code == 2 and "not a size: 'inf'" in capsys.readouterr().err
    # schema -o into a folder that does not exist.
    assert main(["schema", "-o", str(tmp_path / "no" / "such" / "x.json")]) == 2
    assert "cannot write" in _one_error_line(capsys)
    # YAML nested deeper than Python's recursion limit.
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 3000 + "\n")
    assert main(["validate", str(deep)]) == 2
    assert "nested too deeply" in _one_error_line(capsys)
    # bench into a folder it cannot write: refused before the run, not after it.
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    assert main(["bench", QUICKSTART, "--out", str(blocker / "report")]) == 2
    assert "cannot write there" in _one_error_line(capsys)


def test_a_boolean_inside_a_list_of_numbers_is_refused(tmp_path, capsys):
    cases = {
        "draft_cap: {kind: auto, depths: [true, 512]}": "draft_cap: depths[0]: expected a number",
        "stop: [{kind: eos, extra_token_ids: [true]}]": "extra_token_ids[0]: expected a number",
    }
    for body, message in cases.items():
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"version: 1\n{body}\n")
        assert main(["validate", str(recipe)]) == 2
        assert message in _one_error_line(capsys)
    recipe.write_text("version: 1\ndraft_cap: {kind: auto, depths: [64, 512]}\n")
    assert main(["validate", str(recipe)]) == 0


def test_each_checker_names_the_other_for_the_other_kind_of_recipe(capsys):
    train = str(REPO / "recipes" / "train" / "smollm2-135m-dspark.yaml")
    assert main(["validate", train]) == 2
    assert "this is a training recipe" in _one_error_line(capsys)
    assert main(["train", QUICKSTART, "--check"]) == 2
    assert "this is an inference recipe" in _one_error_line(capsys)


def test_a_missing_dependency_is_named_in_one_line():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['fastapi'] = None\n"  # as if installed without dependencies
        "from dspark_flow.cli.main import main\n"
        f"sys.exit(main(['serve', {QUICKSTART!r}, '--port', '0', '--no-warmup']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: the Python package 'fastapi' is missing: install dspark-flow with its "
        "dependencies (pip install dspark-flow)"
    ], done.stderr


def test_train_output_set_on_the_command_line_is_relative_to_the_working_dir(tmp_path, monkeypatch):
    from dspark_flow.training.recipe import load_train_recipe

    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "p.jsonl").write_text('{"turns": ["hello"]}\n')
    path = tmp_path / "recipes" / "r.yaml"
    path.write_text(
        "name: t\ndrafter: {kind: dspark, block_size: 4}\n"
        "data: {prompts: [{path: p.jsonl}]}\noutput: out/from-file\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    in_file = load_train_recipe(path)
    assert Path(in_file.output) == tmp_path / "recipes" / "out" / "from-file"  # the file's dir
    (work / "q.jsonl").write_text('{"turns": ["hi"]}\n')
    typed = load_train_recipe(path, ["output=out/typed", "data.prompts.0.path=q.jsonl"])
    assert Path(typed.output) == work / "out" / "typed"  # where the user typed it
    assert Path(typed.data.prompts[0].path) == work / "q.jsonl"


def test_a_data_cache_folder_of_the_users_is_refused_before_anything_is_cleared(tmp_path):
    from dspark_flow.training.data import check_cache_folder

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"my": "notes"}')
    (mine / "notes.tmp").write_text("draft")
    with pytest.raises(
        DsparkFlowError,
        match=r"holds files the data stage did not write \(manifest.json, notes.tmp\)",
    ):
        check_cache_folder(mine)
    assert (mine / "notes.tmp").read_text() == "draft"
    torn = tmp_path / "torn"  # our own manifest, cut short: remade, not a reason to refuse
    torn.mkdir()
    (torn / "manifest.json").write_text('{"format": 1, "ke')
    (torn / "shard_00000.npz").write_bytes(b"")
    check_cache_folder(torn)
    ours = tmp_path / "ours"
    ours.mkdir()
    for name in (
        "shard_00000.npz",
        "self_prompts.jsonl",
        ".shard_00001.npz.x1.tmp",
        "share_0_of_2.json",
    ):
        (ours / name).write_text("")
    (ours / "manifest.json").write_text('{"key": "abc", "chunks": 1}')
    check_cache_folder(ours)  # everything there is the data stage's own
    check_cache_folder(tmp_path / "absent")


@pytest.mark.parametrize("text", ["[]", '{"chunks": "x", "key": "k"}', '{"key": "k"}'])
def test_a_malformed_data_manifest_is_one_line_not_an_internal_error(tmp_path, text):
    from dspark_flow.training.data import load_samples

    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(DsparkFlowError, match="not a data manifest this tool wrote"):
        load_samples(tmp_path)


def test_a_drafter_config_with_a_malformed_value_is_a_model_error(tmp_path):
    import shutil

    from dspark_flow.models.drafter_loading import read_spec

    shipped = Path(__file__).parents[1] / "dspark_flow/data/drafters/smollm2-135m-dspark"
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(shipped / "config.json", bad / "config.json")
    config = json.loads((bad / "config.json").read_text())
    config["block_size"] = "x"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"config.json: a malformed value"):
        read_spec(bad)
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match="is not a JSON object"):
        read_spec(bad)
    # Sizes the layers are built from: 0 heads divided by zero inside MLX, 1e999 overflowed.
    for key, value in (("num_attention_heads", 0), ("intermediate_size", -5)):
        (bad / "config.json").write_text(json.dumps({**config, "block_size": 7, key: value}))
        with pytest.raises(ModelError, match=f"{key} is {value}, not positive"):
            read_spec(bad)
    (bad / "config.json").write_text(
        json.dumps({**config, "block_size": 7}).replace(
            '"hidden_size": 576', '"hidden_size": 1e999'
        )
    )
    with pytest.raises(ModelError, match="a malformed value"):
        read_spec(bad)


def test_a_drafter_whose_weights_are_a_git_lfs_pointer_is_named_not_out_of_memory(tmp_path):
    """A clone without git-lfs leaves pointers: the header's first 8 bytes then read as a size
    of ~2e18 bytes, and reading that many was a MemoryError ("out of memory" on the CLI)."""
    import shutil

    from dspark_flow.models.drafter_loading import read_spec

    shipped = Path(__file__).parents[1] / "dspark_flow/data/drafters/smollm2-135m-dspark"
    bad = tmp_path / "lfs"
    bad.mkdir()
    shutil.copy(shipped / "config.json", bad / "config.json")
    (bad / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 31457280\n"
    )
    with pytest.raises(ModelError, match="not a safetensors file .*Git LFS pointer") as info:
        read_spec(bad)
    assert "\n" not in str(info.value)


def test_the_api_names_what_is_wrong_with_messages_drafts_recipes_and_long_prompts(embedded):
    from dspark_flow import (
        Pipeline,
        draft_model_generate,
        greedy_generate,
        load_dflash_pair,
        load_target,
    )
    from dspark_flow.errors import RecipeError
    from tests.tiny import tiny_model

    model, tok = embedded
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]  # a list of parts
    with pytest.raises(PromptError, match="the model's chat template failed on these messages"):
        greedy_generate(model, tok, parts, max_new_tokens=2)
    with pytest.raises(PromptError, match=r"stop strings\[1\] is not valid UTF-8"):
        greedy_generate(model, tok, "hi", max_new_tokens=2, stop=["ok", "\udcff"])
    for draft in (None, "builtin:smollm2-135m", tok):
        with pytest.raises(ConfigError, match="draft_model_generate: draft is a loaded model"):
            draft_model_generate(model, tok, draft, "hi", max_new_tokens=2)
    plain = greedy_generate(model, tok, "Say hi", max_new_tokens=6).token_ids
    full = draft_model_generate(
        model, tok, model, "Say hi", max_new_tokens=6, max_draft_tokens=None
    )
    assert full.token_ids == plain  # None: the draft model's own cap, as speculative_generate's
    for args, kwargs, why in [
        ((None,), {}, "recipe: expected a file path, got NoneType"),
        (("recipes/lookup.yaml", [5]), {}, "overrides: expected 'path=value' strings"),
        (("recipes/lookup.yaml",), {"defaults": {"verifier": "x"}}, "defaults: expected recipe"),
    ]:
        with pytest.raises(RecipeError, match=why):
            Pipeline.from_yaml(*args, **kwargs)
    # A table entry naming only a target family ('qwen3-8b') has no repo to load: say so
    # instead of looking a made-up id up on the hub.
    with pytest.raises(ConfigError, match="names no target; use load_pair"):
        load_dflash_pair("z-lab/Qwen3-4B-DFlash-b16")
    with pytest.raises(PromptError, match=r"prompt\[0\] is float, not an integer id"):
        greedy_generate(model, tok, [1.0, 2.0], max_new_tokens=2)
    with pytest.raises(ConfigError, match="chat is True, False or None, got 'no'"):
        greedy_generate(model, tok, "hi", max_new_tokens=2, chat="no")  # type: ignore[arg-type]
    assert greedy_generate(model, tok, "hi", max_new_tokens=2, chat=None).num_tokens >= 1
    with pytest.raises(
        ModelError, match="revision: expected a branch, tag or commit name, got int"
    ):
        load_target("someone/model", revision=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no dflash drafter is known for /nonexistent/x"):
        load_dflash_pair(Path("/nonexistent/x"))  # a path is a name, as load_pair takes it
    # A prompt that fills the model's context is refused, as the server does, not run past it.
    short = tiny_model(seed=1)
    short.args.max_position_embeddings = 16
    with pytest.raises(
        PromptError, match="the prompt has 20 tokens; this model's context holds 16"
    ):
        greedy_generate(short, tok, list(range(20)), max_new_tokens=2)


def test_max_draft_and_a_set_of_the_cap_s_kind_are_refused_together(capsys):
    # The error quoted a --set the user never typed: "--set draft_cap={kind: fixed, k: 4} ...".
    args = ["run", QUICKSTART, "--prompt", "hi", "--max-draft", "4", "--set", "draft_cap.kind=auto"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "error: --max-draft 4 and --set draft_cap.kind=auto both choose the draft cap; keep one\n"
    )
    # Nor may its bound be reported as a --set's.
    assert main(["run", QUICKSTART, "--prompt", "hi", "--max-draft", "2000"]) == 2
    assert capsys.readouterr().err == (
        "error: --max-draft 2000: expected auto or a count from 1 to 1024\n"
    )


def test_run_says_when_no_stop_rule_bounds_the_output(capsys):
    """`stop: []` or end rules only are valid, but the output then runs to the context's end:
    a run that looks hung says so first (found by the CLI audit of 2026-12-05)."""
    prompt = "What is the capital of France?"
    assert main(["run", QUICKSTART, "--prompt", prompt, "--set", "stop=[{kind: eos}]"]) == 0
    out = capsys.readouterr()
    assert "note: no stop rule sets a token budget" in out.err and "Paris" in out.out
    assert main(["run", QUICKSTART, "--prompt", prompt, "--max-tokens", "2"]) == 0
    assert "no stop rule" not in capsys.readouterr().err
