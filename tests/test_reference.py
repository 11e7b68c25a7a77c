"""docs/reference.md is written from the code; these tests keep the two from drifting."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from dspark_flow.recipe.reference import reference_markdown

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "reference.md"
REGENERATE = "python -m dspark_flow.recipe.reference > docs/reference.md"


def test_the_committed_reference_is_what_the_code_writes():
    assert PAGE.read_text(encoding="utf-8") == reference_markdown(builtin_only=True), (
        f"docs/reference.md is out of date: run `{REGENERATE}`"
    )


def test_every_recipe_field_and_flag_says_what_it_does():
    # A row's last cell is its description; a new field or flag without one shows up here.
    rows = [line for line in reference_markdown().splitlines() if line.startswith("| `")]
    assert len(rows) > 150
    undocumented = [row.split(" | ")[0] for row in rows if row.rstrip().endswith("|  |")]
    assert undocumented == []


def test_the_page_shows_no_value_from_the_environment(monkeypatch):
    # `serve --api-key` reads $DSPARK_FLOW_API_KEY when it runs, not as a parser default that
    # a help page or this reference would print.
    monkeypatch.setenv("DSPARK_FLOW_API_KEY", "secret-key-value")
    assert "secret-key-value" not in reference_markdown()


def test_the_page_names_every_builtin_kind_and_command():
    page = reference_markdown()
    listed = subprocess.run(
        [sys.executable, "-m", "dspark_flow", "list"], capture_output=True, text=True, check=True
    ).stdout
    builtin = re.findall(r"^(\w+)\.(\w+)\s+dspark-flow ", listed, flags=re.M)
    assert len(builtin) >= 18
    for slot, kind in builtin:
        assert f"#### `{slot}: {{kind: {kind}}}`\n" in page
    for command in ("run", "validate", "schema", "list", "models", "bench", "serve", "calibrate"):
        assert f"### `dspark-flow {command}`" in page
    # bounds and defaults are the fields' own: a reader sees what validation will enforce
    assert "| `draft_cap.k` | integer (≥ 1, ≤ 1024) | `4` |" in page
    assert "| `stop[].limit` | integer (≥ 1) | `256` |" in page
    assert "| `train.loss.ce` | number (≥ 0.0) | `1.0` |" in page
    assert "| `data.prompts[].path` | string | required |" in page  # a list of sections
    assert "fill in `verifier: {kind: kernels, invariant: true," in page  # TOOL_DEFAULTS


def test_a_plugin_claiming_a_builtin_kind_leaves_the_committed_page_alone(fake_plugin):
    source = """
        from typing import Literal
        from dspark_flow.strategy import Drafter, StrategyConfig

        class OtherConfig(StrategyConfig):
            kind: Literal["lookup"] = "lookup"

        class OtherLookup(Drafter):
            Config = OtherConfig
        """
    fake_plugin("acme-spec", "0.1.0", {"drafter.lookup": "acme_spec:OtherLookup"}, source)
    assert reference_markdown(builtin_only=True) == PAGE.read_text(encoding="utf-8")
    every = reference_markdown(builtin_only=False)
    assert "#### `drafter: {kind: lookup}`\n" in every  # ours, and theirs with its source:
    assert "#### `drafter: {kind: lookup}` (from acme-spec 0.1.0)" in every


def test_a_plugin_kind_is_on_the_cli_page_but_not_the_committed_one(fake_plugin, tmp_path):
    source = """
        from typing import Literal
        from pydantic import Field
        from dspark_flow.strategy import Draft, Drafter, StrategyConfig

        class TreeConfig(StrategyConfig):
            kind: Literal["acme_tree"] = "acme_tree"
            width: int = Field(2, ge=1, description="branches per slot")

        class TreeDrafter(Drafter):
            '''drafter `acme_tree`: a tree of drafts.'''
            Config = TreeConfig
            def propose(self, history, k):
                return Draft(tokens=history[-1:] * min(k, self.config.width))
        """
    fake_plugin("acme-spec", "0.1.0", {"drafter.acme_tree": "acme_spec:TreeDrafter"}, source)
    assert "acme_tree" not in reference_markdown(builtin_only=True)
    every = reference_markdown(builtin_only=False)
    assert "#### `drafter: {kind: acme_tree}` (from acme-spec 0.1.0)" in every
    assert "| `drafter.width` | integer (≥ 1) | `2` | branches per slot |" in every
    assert "drafter `acme_tree`: a tree of drafts." in every

    from dspark_flow.cli.main import main

    out = tmp_path / "reference.md"
    assert main(["schema", "--markdown", "-o", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == every
