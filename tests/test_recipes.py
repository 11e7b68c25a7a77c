"""Recipes: validation with positions, overrides, schema, and the CLI's exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_flow.errors import RecipeError
from dspark_flow.recipe.load import load_recipe, loads_recipe

REPO = Path(__file__).resolve().parent.parent


def problems(text: str, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(RecipeError) as err:
        loads_recipe(text, source="r.yaml", overrides=overrides)
    return err.value.problems


def test_shipped_recipes_validate():
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        recipe = load_recipe(path)
        assert recipe.version == 1, path


def test_defaults_fill_missing_sections():
    recipe = loads_recipe("version: 1\n")
    assert recipe.target.model == "builtin:smollm2-135m"
    assert recipe.drafter.kind == "none" and recipe.sampler.kind == "greedy"
    assert [s.kind for s in recipe.stop] == ["eos", "max_tokens"]


def test_tool_defaults_fill_only_slots_the_user_left_out():
    from dspark_flow.recipe.schema import TOOL_DEFAULTS

    recipe = loads_recipe("version: 1\n", defaults=TOOL_DEFAULTS)
    assert recipe.verifier.kind == "kernels" and recipe.verifier.invariant
    assert recipe.verifier.compile_layers and recipe.verifier.fuse_projections
    library = loads_recipe("version: 1\n").verifier  # the library's default
    assert library.kind == "reference" and not library.compile_layers
    mine = loads_recipe("verifier: {kind: reference}\n", defaults=TOOL_DEFAULTS)
    assert mine.verifier.kind == "reference"
    for override in ["verifier.kind=reference", "verifier={kind: reference}"]:
        recipe = loads_recipe("version: 1\n", overrides=[override], defaults=TOOL_DEFAULTS)
        assert recipe.verifier.kind == "reference", override
    tuned = loads_recipe("version: 1\n", overrides=["verifier.max_rows=8"], defaults=TOOL_DEFAULTS)
    assert tuned.verifier.kind == "kernels" and tuned.verifier.max_rows == 8
    assert tuned.verifier.invariant  # an override refines the default section
    same = ["verifier.max_rows=8", "verifier.kind=kernels"]  # naming the default's own kind
    same_kind = loads_recipe("version: 1\n", overrides=same, defaults=TOOL_DEFAULTS).verifier
    assert same_kind.max_rows == 8 and same_kind.invariant
    # The user's settings stay whatever the order of the kind among them; the last kind wins,
    # and landing back on the default's kind keeps the default's settings.
    for order in (
        ["verifier.attention=fused", "verifier.kind=reference"],
        ["verifier.kind=reference", "verifier.attention=fused"],
    ):
        mine = loads_recipe("version: 1\n", overrides=order, defaults=TOOL_DEFAULTS).verifier
        assert mine.kind == "reference" and mine.attention == "fused", order
    back = ["verifier.kind=reference", "verifier.kind=kernels"]
    assert loads_recipe("version: 1\n", overrides=back, defaults=TOOL_DEFAULTS).verifier.invariant


def test_every_problem_reported_at_once_with_positions():
    text = (
        "version: 1\n"
        "drafter:\n"
        "  kind: lookpu\n"
        "sampler: {kind: sample, temperature: -1}\n"
        "stop:\n"
        "  - {kind: max_tokens, limit: many}\n"
        "  - {kind: strings, strings: [x], colour: red}\n"
        "extra_top: 1\n"
    )
    found = problems(text.replace("extra_top: 1\n", ""))
    assert found[0].startswith(
        "r.yaml:3:9 drafter.kind: unknown drafter 'lookpu'; did you mean 'lookup'?"
    )
    assert found[1].startswith(
        "r.yaml:4:38 sampler.temperature: Input should be greater than or equal to 0"
    )
    assert found[2].startswith("r.yaml:6:31 stop.0.limit: Input should be a valid integer")
    assert found[3] == "r.yaml:7:35 stop.1.colour: unknown field"
    assert len(found) == 4
    # A fault in the outer shape does not hide the slot sections' own problems.
    found = problems(text.replace("  - {kind: max_tokens, limit: many}", "  - 5"))
    assert "r.yaml:8:1 extra_top: unknown field" in found
    assert any(p.startswith("r.yaml:6:5 stop.0: Input should be a valid dictionary") for p in found)
    assert any(p.startswith("r.yaml:3:9 drafter.kind: unknown drafter 'lookpu'") for p in found)
    assert any(p.startswith("r.yaml:4:38 sampler.temperature:") for p in found)
    assert "r.yaml:7:35 stop.1.colour: unknown field" in found
    assert len(found) == 5


def test_unknown_slot_and_missing_kind():
    found = problems("verifierz: {kind: reference}\ncache: {}\n")
    assert found[0] == "r.yaml:1:1 verifierz: unknown field"
    assert found[1].startswith("r.yaml:2:8 cache.kind: missing 'kind'")
    found = problems("cache: {}\n")
    assert found[0].startswith("r.yaml:1:8 cache.kind: missing 'kind'")


def test_wrong_type_of_section():
    found = problems("drafter: lookup\n")
    assert found[0].startswith("r.yaml:1:10 drafter: Input should be a valid dictionary")


def test_malformed_yaml_is_one_line():
    found = problems("drafter: {kind: lookup\nsampler: x\n")
    assert len(found) == 1 and "malformed YAML" in found[0] and found[0].startswith("r.yaml:")


def test_yaml_aliases_are_walked_once():
    """`a: &x [*x]` is a list holding itself, and aliases of aliases expand exponentially:
    neither may hang or overflow the checks (a 450-byte file of eight levels used to)."""
    assert problems("a: &x [*x]\n") == ["r.yaml:1:1 a: unknown field"]
    lines = ["x0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"]
    lines += [f"x{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 10)}]" for n in range(1, 9)]
    assert len(problems("\n".join(lines))) == 9
    # ...nor may a message quote such a value whole (its repr is 10^9 items).
    found = problems("\n".join([*lines, "drafter: {kind: *a8}"]))
    assert len(found) == 10 and max(len(p) for p in found) < 300
    assert problems("stop: &s [{kind: eos}, *s]\n") == [
        "r.yaml:1:7 stop.1: Input should be a valid dictionary"
    ]


def test_text_that_is_not_utf8_and_an_empty_model_name_fail_validation():
    found = problems('prompt: {system: "\\ud800"}\ntarget: {model: ""}\n')
    assert any("system: not valid UTF-8 text (a lone surrogate at character 1)" in p for p in found)
    assert any("target.model: String should have at least 1 character" in p for p in found)
    found = problems('stop: [{kind: strings, strings: [ok, "\\udc80"]}]\n')
    assert found and "strings[1]: not valid UTF-8 text" in found[0]


def test_duplicate_keys_are_errors():
    found = problems("drafter: {kind: none}\ndrafter: {kind: lookup}\n")
    assert found == ["r.yaml:2:1 drafter: duplicate key"]


def test_cross_field_check_in_a_strategy():
    found = problems("drafter: {kind: lookup, min_ngram: 5, max_ngram: 2}\n")
    assert "min_ngram must not exceed max_ngram" in found[0]


def test_overrides_apply_and_revalidate():
    recipe = loads_recipe(
        "drafter: {kind: lookup}\n",
        overrides=[
            "drafter.max_draft=8",
            "draft_cap.kind=fixed",
            "draft_cap.k=3",
            "stop.1.limit=9",
        ],
    )
    assert recipe.drafter.max_draft == 8
    assert recipe.draft_cap.k == 3
    assert recipe.stop[1].limit == 9
    found = problems("drafter: {kind: lookup}\n", overrides=["drafter.max_draft=zero"])
    assert found == [
        "--set drafter.max_draft=zero drafter.max_draft: Input should be a valid integer, unable to parse string as an integer"
    ]
    with pytest.raises(RecipeError, match="expected KEY.PATH=VALUE"):
        loads_recipe("{}", overrides=["nonsense"])
    with pytest.raises(RecipeError, match="the recipe is empty"):
        loads_recipe("# nothing but a comment\n", "empty.yaml")


def test_recipe_round_trips_through_dict():
    for name in ("sample.yaml", "dspark.yaml"):
        recipe = load_recipe(REPO / "recipes" / name)
        again = type(recipe).from_dict(recipe.to_dict())
        assert again == recipe
    # A null that is not the default stays null (it came back as the default, 'auto').
    keep_float = loads_recipe("drafter: {kind: dspark, quantize: null}\n")
    assert keep_float.drafter.quantize is None
    assert type(keep_float).from_dict(keep_float.to_dict()).drafter.quantize is None


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dspark_flow", *args], capture_output=True, text=True
    )


def test_cli_validate_and_exit_codes(tmp_path):
    ok = run_cli("validate", *map(str, sorted((REPO / "recipes").glob("*.yaml"))))
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter: {kind: lookpu}\nsampler: {kind: greedy, temperature: 1}\n")
    out = run_cli("validate", str(bad))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(f"error: {bad}:") for line in lines)
    assert "Traceback" not in out.stderr
    missing = run_cli("validate", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "recipe file not found" in missing.stderr
    unknown = run_cli("run", str(bad), "--prompt", "hi")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    # validate reads a recipe as run does: the command line's verifier takes its settings
    tuned = run_cli("validate", str(REPO / "recipes/quickstart.yaml"), "--set",
                    "verifier.invariant=false")  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr


def test_cli_schema_has_every_installed_kind(tmp_path):
    out = run_cli("schema", "-o", str(tmp_path / "schema.json"))
    assert out.returncode == 0, out.stderr
    schema = json.loads((tmp_path / "schema.json").read_text())
    text = json.dumps(schema)
    for kind in ("lookup", "draft_model", "sample", "full_block", "strings", "kv", "reference"):
        assert f'"{kind}"' in text
    assert schema["additionalProperties"] is False


def test_the_schema_accepts_every_shipped_recipe_and_what_validate_refuses_it_refuses():
    """Editors check recipes against this schema: it must not flag what the tool accepts (the
    shipped `prompt_lookup: true`) nor pass what it refuses (another version, no kind)."""
    import jsonschema
    import yaml

    from dspark_flow.recipe.jsonschema import recipe_json_schema

    checker = jsonschema.Draft202012Validator(recipe_json_schema())
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        assert not list(checker.iter_errors(yaml.safe_load(path.read_text()))), path.name
    words = {"drafter": {"kind": "dspark", "quantize": "none", "prompt_lookup": "off"}}
    assert checker.is_valid(words)
    loads_recipe(yaml.safe_dump(words))  # and the tool takes them too
    for refused in (
        {"version": 2},
        {"drafter": {"max_draft": 3}},
        {"drafter": {"kind": "dspark", "draft_vocab": 0}},
    ):
        assert not checker.is_valid(refused), refused
        with pytest.raises(RecipeError):
            loads_recipe(yaml.safe_dump(refused))
