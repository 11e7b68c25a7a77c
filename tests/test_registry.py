"""The strategy registry: entry-point discovery, lazy import, errors that name what is installed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspark_flow import registry
from dspark_flow.errors import RegistryError
from dspark_flow.strategy import SLOTS

ACME = """
from typing import Literal
from dspark_flow.strategy import Draft, Drafter, StrategyConfig

class TreeConfig(StrategyConfig):
    kind: Literal["acme_tree"] = "acme_tree"
    width: int = 2

class TreeDrafter(Drafter):
    Config = TreeConfig
    def propose(self, history, k):
        return Draft(tokens=history[-1:] * min(k, self.config.width))
"""


# A draft cap written against the contract before rounds named their source.
OLD_CAP = """
from typing import Literal
from dspark_flow.strategy import DraftCap, StrategyConfig

class SteadyConfig(StrategyConfig):
    kind: Literal["acme_steady"] = "acme_steady"

class SteadyCap(DraftCap):
    Config = SteadyConfig
    rounds = []
    def choose(self, drafter_max):
        return 3
    def observe(self, proposed, accepted, seconds):
        SteadyCap.rounds.append((proposed, accepted))
"""


def test_builtins_cover_every_slot_through_entry_points():
    for slot in SLOTS:
        infos = registry.installed(slot)
        assert infos, f"no {slot} kinds installed"
        assert all(i.distribution == "dspark-flow" for i in infos)
    assert {"none", "lookup", "draft_model"} <= set(registry.kind_names("drafter"))
    assert set(registry.kind_names("stop")) >= {"eos", "max_tokens", "strings"}


def test_listing_does_not_import_strategy_modules():
    code = (
        "import sys; from dspark_flow import registry; registry.installed();"
        "print(any(m.startswith('dspark_flow.strategies.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_kind_names_installed_and_nearest():
    with pytest.raises(RegistryError) as err:
        registry.load_kind("drafter", "lookpu")
    msg = str(err.value)
    assert "did you mean 'lookup'" in msg
    assert "none" in msg and "draft_model" in msg


def test_third_party_kind_is_found_and_loaded(fake_plugin):
    fake_plugin("acme-spec", "0.1.0", {"drafter.acme_tree": "acme_spec:TreeDrafter"}, ACME)
    assert "acme_tree" in registry.kind_names("drafter")
    assert "acme_tree (acme-spec 0.1.0)" in registry.describe_installed("drafter")
    cls = registry.load_kind("drafter", "acme_tree")
    assert cls.__name__ == "TreeDrafter"
    assert cls(cls.Config(width=3)).propose([5, 6], 4).tokens == [6, 6, 6]


def test_two_distributions_claiming_one_kind(fake_plugin):
    fake_plugin("acme-spec", "0.1.0", {"drafter.lookup": "acme_spec:TreeDrafter"}, ACME)
    with pytest.raises(RegistryError) as err:
        registry.load_kind("drafter", "lookup")
    assert "acme-spec 0.1.0" in str(err.value) and "dspark-flow" in str(err.value)
    assert any(kind == "lookup" for _, kind, _ in registry.conflicts())


def test_disable_plugins_hides_third_party(fake_plugin, monkeypatch):
    fake_plugin("acme-spec", "0.1.0", {"drafter.acme_tree": "acme_spec:TreeDrafter"}, ACME)
    monkeypatch.setenv("DSPARK_FLOW_DISABLE_PLUGINS", "1")
    registry.refresh()
    assert "acme_tree" not in registry.kind_names("drafter")
    assert "lookup" in registry.kind_names("drafter")


@pytest.mark.parametrize(("value", "on"), [("1", True), ("Yes", True), (" on ", True),
                                           ("0", False), ("off", False), ("False", False), ("", False)])  # fmt: skip
def test_every_switch_reads_yes_and_no_alike(fake_plugin, monkeypatch, value, on):
    # DSPARK_FLOW_DISABLE_PLUGINS=off used to disable plugins, and DSPARK_FLOW_DEBUG=0 to
    # turn tracebacks on: every yes/no variable now reads through env_flag.
    from dspark_flow.env import env_flag

    fake_plugin("acme-spec", "0.1.0", {"drafter.acme_tree": "acme_spec:TreeDrafter"}, ACME)
    monkeypatch.setenv("DSPARK_FLOW_DISABLE_PLUGINS", value)
    registry.refresh()
    assert ("acme_tree" not in registry.kind_names("drafter")) == on
    monkeypatch.setenv("DSPARK_FLOW_DEBUG", value)
    assert env_flag("DSPARK_FLOW_DEBUG") == on


def test_broken_plugin_fails_with_one_line(fake_plugin):
    fake_plugin("acme-spec", "0.1.0", {"drafter.broken": "acme_spec:Missing"}, ACME)
    with pytest.raises(RegistryError) as err:
        registry.load_kind("drafter", "broken")
    assert "failed to import" in str(err.value) and "\n" not in str(err.value)


def test_plugin_that_exits_at_import_fails_with_one_line(fake_plugin):
    # sys.exit() raises SystemExit, no Exception: it used to end the command without a word.
    source = "import sys\nsys.exit('needs torch')\n"
    fake_plugin("acme-exit", "0.1.0", {"drafter.exits": "acme_exit:Drafter"}, source)
    with pytest.raises(RegistryError) as err:
        registry.load_kind("drafter", "exits")
    assert "acme-exit 0.1.0 failed to import" in str(err.value) and "needs torch" in str(err.value)


def test_the_schema_leaves_out_a_broken_plugin_kind_not_every_kind(fake_plugin):
    from dspark_flow.recipe.jsonschema import recipe_json_schema

    fake_plugin("acme-spec", "0.1.0", {"drafter.broken": "acme_spec:Missing"}, ACME)
    text = json.dumps(recipe_json_schema())
    assert '"lookup"' in text and '"broken"' not in text  # the built-ins are all there


def test_entry_point_that_is_not_a_strategy(fake_plugin):
    fake_plugin("acme-spec", "0.1.0", {"sampler.wrong": "acme_spec:TreeDrafter"}, ACME)
    with pytest.raises(RegistryError, match="not a sampler strategy class"):
        registry.load_kind("sampler", "wrong")


def test_cli_list_shows_six_slots():
    out = subprocess.run(
        [sys.executable, "-m", "dspark_flow", "list"], capture_output=True, text=True, check=True
    )
    slots = {line.split(".")[0] for line in out.stdout.splitlines() if line.strip()}
    assert slots == set(SLOTS)
    assert "dspark-flow 0.1.0" in out.stdout


def test_a_third_party_cap_written_before_sources_still_runs(fake_plugin, embedded):
    """`DraftCap.choose`/`observe` gained the round's source; a plugin's cap that declares the
    old signatures is adapted, not failed mid-generation."""
    from dspark_flow.pipeline import Pipeline

    fake_plugin("acme-caps", "0.1.0", {"draft_cap.acme_steady": "acme_caps:SteadyCap"}, OLD_CAP)
    cls = registry.load_kind("draft_cap", "acme_steady")
    assert cls(cls.Config()).choose(7, "copy") == 3
    stops = [{"kind": "max_tokens", "limit": 24}]
    prompt = "Say it three times: one two three four, one two three four, one two three four."
    spec = Pipeline.from_dict(
        {"drafter": {"kind": "lookup"}, "draft_cap": {"kind": "acme_steady"}, "stop": stops},
        target=embedded,
    ).warm_up()
    greedy = Pipeline.from_dict({"drafter": {"kind": "none"}, "stop": stops}, target=embedded)
    got = spec.generate(prompt, max_new_tokens=24)
    assert got.token_ids == greedy.warm_up().generate(prompt, max_new_tokens=24).token_ids
    assert len(cls.rounds) == got.num_rounds and all(p <= 3 for p, _ in cls.rounds)


# Plugins with bugs of their own: each is reported naming the plugin, never as an internal error.
FAULTY = """
from typing import Literal
from pydantic import Field
from dspark_flow.strategy import Draft, Drafter, StrategyConfig

class PlainConfig:  # not a pydantic model
    kind = "acme_plain"

class Plain(Drafter):
    Config = PlainConfig

class InitConfig(StrategyConfig):
    kind: Literal["acme_init"] = "acme_init"

class FailsInInit(Drafter):
    Config = InitConfig
    def __init__(self, config=None):
        raise KeyError("width")

class WarmConfig(StrategyConfig):
    kind: Literal["acme_warm"] = "acme_warm"

class FailsInWarmUp(Drafter):
    Config = WarmConfig
    def warm_up(self, ctx):
        raise ZeroDivisionError("division by zero")

class MissingConfig(StrategyConfig):
    kind: Literal["acme_missing"] = "acme_missing"

class NeedsTorch(Drafter):
    Config = MissingConfig
    def warm_up(self, ctx):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

class LooseConfig(StrategyConfig):  # any kind: what would its sections validate as?
    pass

class Loose(Drafter):
    Config = LooseConfig

class OtherConfig(StrategyConfig):
    kind: Literal["other"] = "other"

class Mislabelled(Drafter):
    Config = OtherConfig

class BadDefaultConfig(StrategyConfig):
    kind: Literal["acme_default"] = "acme_default"
    width: int = Field(0, ge=1)  # its own default breaks its own constraint

class BadDefault(Drafter):
    Config = BadDefaultConfig
"""

FAULTY_KINDS = {
    f"drafter.{kind}": f"acme_faulty:{cls}"
    for kind, cls in [("acme_plain", "Plain"), ("acme_init", "FailsInInit"),
                      ("acme_warm", "FailsInWarmUp"), ("acme_default", "BadDefault"),
                      ("acme_missing", "NeedsTorch"), ("acme_loose", "Loose"),
                      ("acme_label", "Mislabelled")]
}  # fmt: skip


def test_a_plugin_whose_config_is_not_pydantic_is_refused_by_name(fake_plugin):
    fake_plugin("acme-faulty", "0.2.0", FAULTY_KINDS, FAULTY)
    with pytest.raises(RegistryError) as err:
        registry.load_kind("drafter", "acme_plain")
    assert "acme-faulty 0.2.0" in str(err.value) and "is not a StrategyConfig" in str(err.value)


def test_a_plugin_whose_config_does_not_name_its_kind_is_refused_by_name(fake_plugin):
    """A section's `kind: Literal[...]` is what tells kinds apart in a recipe and its schema:
    a plain `kind: str` would break `dspark-flow schema`, another kind's name a correct recipe."""
    fake_plugin("acme-faulty", "0.2.0", FAULTY_KINDS, FAULTY)
    for kind in ("acme_loose", "acme_label"):
        with pytest.raises(RegistryError) as err:
            registry.load_kind("drafter", kind)
        assert "acme-faulty 0.2.0" in str(err.value)
        assert f"must declare kind: Literal['{kind}']" in str(err.value)


def test_a_plugin_failing_in_init_or_warm_up_is_named(fake_plugin, embedded):
    from dspark_flow.errors import StrategyError
    from dspark_flow.pipeline import Pipeline

    fake_plugin("acme-faulty", "0.2.0", FAULTY_KINDS, FAULTY)
    with pytest.raises(StrategyError) as err:
        Pipeline.from_dict({"drafter": {"kind": "acme_init"}}, target=embedded)
    assert str(err.value) == (
        "drafter 'acme_init' from acme-faulty 0.2.0 failed in __init__: KeyError: 'width'"
    )
    pipeline = Pipeline.from_dict({"drafter": {"kind": "acme_warm"}}, target=embedded)
    with pytest.raises(StrategyError, match="'acme_warm' from acme-faulty 0.2.0 failed in warm_up"):
        pipeline.warm_up()
    assert pipeline.components is None  # not half warmed
    # A missing package passes through: the CLI names it and says how to install it.
    with pytest.raises(ModuleNotFoundError):
        Pipeline.from_dict({"drafter": {"kind": "acme_missing"}}, target=embedded).warm_up()


def test_a_plugin_default_that_breaks_its_own_constraint_fails_validation(fake_plugin):
    from dspark_flow.errors import RecipeError
    from dspark_flow.recipe.load import validate

    fake_plugin("acme-faulty", "0.2.0", FAULTY_KINDS, FAULTY)
    with pytest.raises(RecipeError, match=r"drafter\.width: .*greater than or equal to 1"):
        validate({"drafter": {"kind": "acme_default"}})
    assert validate({"drafter": {"kind": "acme_default", "width": 2}}).drafter.width == 2


def test_cli_list_marks_a_claimed_built_in_and_reports_malformed_names(fake_plugin, capsys):
    from dspark_flow.cli.main import main

    fake_plugin(
        "acme-spec",
        "0.1.0",
        {"drafter.lookup": "acme_spec:TreeDrafter", "treedrafter": "acme_spec:TreeDrafter"},
        ACME,
    )
    assert main(["list", "drafter"]) == 0
    out, err = capsys.readouterr()
    row = next(line for line in out.splitlines() if line.startswith("drafter.lookup "))
    assert "CONFLICT: claimed by" in row and "acme-spec 0.1.0" in row and "dspark-flow" in row
    assert "warning: drafter.lookup is claimed by" in err
    assert "warning: entry point treedrafter (acme-spec) in dspark_flow.strategies" in err
