"""Shared fixtures. The embedded model is fetched and converted once per machine (the user cache)
and loaded once per test session."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

import dspark_flow  # noqa: F401  (first: it preloads OpenBLAS before mlx, ~15x on CPU matmuls)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded default in the backend's default weight format."""
    from dspark_flow.api import load_target

    return load_target()


@pytest.fixture
def attention_unwrapped():
    """Each test starts with mlx-lm's attention function unwrapped: pipelines built by other
    tests (on the CPU the CLI's stack routes the attention too) may have left theirs wrapped,
    and get it back afterwards. A patcher of its own: tests undo their `monkeypatch`."""
    from dspark_flow.models import attention

    with pytest.MonkeyPatch.context() as mp:
        for name, (original, _) in list(attention._WRAPPED.items()):
            mp.setattr(sys.modules[name], attention.ATTENTION_FN, original)
        mp.setattr(attention, "_WRAPPED", {})
        yield


@pytest.fixture
def fake_plugin(tmp_path, monkeypatch):
    """Install a third-party distribution on sys.path: a dist-info with entry points + a module."""
    from dspark_flow import registry

    def install(dist: str, version: str, entry_points: dict[str, str], module_source: str = ""):
        root = tmp_path / dist
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
        (info / "entry_points.txt").write_text(f"[dspark_flow.strategies]\n{lines}\n")
        if module_source:
            module = dist.replace("-", "_")
            (root / f"{module}.py").write_text(textwrap.dedent(module_source))
        monkeypatch.syspath_prepend(str(root))
        registry.refresh()
        return root

    yield install
    for name in [m for m in sys.modules if m.startswith(("acme", "other_spec"))]:
        del sys.modules[name]
    registry.refresh()


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env
