"""Write the held-out evaluation prompts (never used for drafter training) as one bench file.

chat = mt-bench, code = humaneval, math = gsm8k lines 1001+ (see ../shared/data/prompts/README.md).

    python benchmarks/heldout_prompts.py [--per-category 10] [--src ../shared/data/prompts] OUT.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SOURCES = {
    "chat": ("mt-bench.jsonl", 0),
    "code": ("humaneval.jsonl", 0),
    "math": ("gsm8k.jsonl", 1000),
}


DEFAULT_SRC = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "prompts"


def heldout_rows(per_category: int, src: Path = DEFAULT_SRC) -> list[dict]:
    """The first `per_category` held-out prompts of each category, first turn only."""
    rows = []
    for category, (name, skip) in SOURCES.items():
        lines = [ln for ln in (Path(src) / name).read_text().splitlines() if ln.strip()]
        for line in lines[skip : skip + per_category]:
            rows.append({"turns": json.loads(line)["turns"][:1], "category": category})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--per-category", type=int, default=10)
    p.add_argument("--src", default=str(DEFAULT_SRC))
    args = p.parse_args()
    rows = heldout_rows(args.per_category, Path(args.src))
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
