"""Benchmark prompt files: JSONL `{"turns": [...], "category": ...}` or plain text, one a line.

The first turn of each JSONL record is the prompt (multi-turn replay would need the model's own
answers, which differ per mode); the category is the record's `category` field, else the file
name's stem (`humaneval.jsonl` -> "humaneval").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dspark_flow.errors import DsparkFlowError

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")

# The quick A/B scripts' shared prompts (benchmarks/pending_ab.py, greedy_gap.py, compile_ab.py;
# each adds a fourth of its own): code, math (GSM8K train line 1), chat.
AB_PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "Describe the water cycle in three sentences.",
)


@dataclass(frozen=True)
class BenchPrompt:
    id: str  # unique within a bench run: "<category>-<index in its category>"
    category: str
    text: str


def default_prompts_path() -> Path:
    """The 24 prompts shipped with the package (chat / code / math / edit)."""
    return Path(str(resources.files("dspark_flow") / "data" / "prompts.jsonl"))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise DsparkFlowError(f"prompts file not found: {path}") from e
    except UnicodeDecodeError as e:
        raise DsparkFlowError(f"prompts file {path} is not UTF-8 text ({e.reason})") from e
    except OSError as e:
        raise DsparkFlowError(f"cannot read prompts file {path}: {e.strerror or e}") from e


def _looks_like_json(path: Path, text: str) -> bool:
    if path.suffix.lower() in JSON_SUFFIXES:
        return True
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return first.startswith("{")


def _parse_record(path: Path, lineno: int, line: str) -> tuple[str, str | None]:
    """(prompt text, category or None) of one JSONL line; any defect is one error line."""
    where = f"prompts file {path} line {lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DsparkFlowError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(record, dict):
        raise DsparkFlowError(f"{where}: expected a JSON object with a 'turns' list")
    turns = record.get("turns")
    if turns is None and isinstance(record.get("prompt"), str):
        turns = [record["prompt"]]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise DsparkFlowError(f"{where}: expected 'turns' as a non-empty list of strings")
    if not turns[0].strip():
        raise DsparkFlowError(f"{where}: the first turn is empty")
    category = record.get("category")
    if category is not None and not isinstance(category, str):
        raise DsparkFlowError(f"{where}: 'category' must be a string")
    return turns[0], category


def load_prompt_file(path: str | Path) -> list[tuple[str, str]]:
    """[(category, prompt text)] in file order."""
    path = Path(path)
    text = _read_text(path)
    items: list[tuple[str, str]] = []
    if _looks_like_json(path, text):
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                prompt, category = _parse_record(path, lineno, line)
                items.append((category or path.stem, prompt))
    else:
        if "\x00" in text:
            raise DsparkFlowError(f"prompts file {path} looks binary (NUL bytes)")
        items = [(path.stem, ln.strip()) for ln in text.splitlines() if ln.strip()]
    if not items:
        raise DsparkFlowError(f"prompts file {path} holds no prompts")
    return items


def load_prompts(paths: Sequence[str | Path] = (), limit: int | None = None) -> list[BenchPrompt]:
    """Prompts of all files (the shipped set when none), at most `limit` per category."""
    per_category: dict[str, list[str]] = {}
    for path in paths or [default_prompts_path()]:
        for category, prompt in load_prompt_file(path):
            per_category.setdefault(category, []).append(prompt)
    prompts = [
        BenchPrompt(id=f"{category}-{i}", category=category, text=text)
        for category, texts in per_category.items()
        for i, text in enumerate(texts)
    ]
    return first_per_category(prompts, limit)


def first_per_category(prompts: list[BenchPrompt], limit: int | None) -> list[BenchPrompt]:
    """The first `limit` prompts of each category (all of them when `limit` is None), in order."""
    if limit is None:
        return prompts
    taken: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        if taken.get(prompt.category, 0) < limit:
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            kept.append(prompt)
    return kept


def select_categories(prompts: list[BenchPrompt], categories: Sequence[str]) -> list[BenchPrompt]:
    """Only the prompts of these categories (an unknown name is an error, not an empty run)."""
    if not categories:
        return prompts
    known = {p.category for p in prompts}
    unknown = [c for c in categories if c not in known]
    if unknown:
        raise DsparkFlowError(
            f"no prompts in category {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return [p for p in prompts if p.category in set(categories)]
