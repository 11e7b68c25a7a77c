"""What MLX's on-disk kernel cache saves a new process: the first decode with and without it.

On CUDA, MLX compiles some kernels with NVRTC on first use (fused elementwise kernels of
`mx.compile`, gathers) and keeps them on disk. dspark-flow points that cache under its home
(`keep_compiled_kernels`, dspark_flow/models/backend.py), so a reboot that empties /tmp no
longer costs the compilation again. This script runs the same short decode in fresh
processes, one after another:

1. `home, first`: the cache under dspark-flow's home (empty on a fresh machine: it fills);
2. `home, again`: the same cache, now filled (what a process after a reboot gets now);
3. `empty`: `MLX_PTX_CACHE_DIR` pointed at an empty folder (what it got before);
4. `home, last`: the filled cache once more (the drift between 2 and 4 is the noise).

Each process loads `builtin:smollm2-135m` with its shipped DSpark drafter (the library's
defaults) and times its first and second `speculative_generate` of one prompt, and counts the
files in its cache folder before and after. Off CUDA nothing is compiled: all rows run alike.

    python benchmarks/kernel_cache.py --out kernel_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import dspark_flow  # noqa: F401  (first: OpenBLAS must bind before mlx.core)
from dspark_flow.bench.fresh_process import run_child
from dspark_flow.models.backend import PTX_CACHE_ENV

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _child(max_tokens: int) -> dict[str, object]:
    """One process's figures: load, first and second decode, cache files."""
    from dspark_flow import load_pair, speculative_generate
    from dspark_flow.models.backend import keep_compiled_kernels

    keep_compiled_kernels()  # what loading does first: the folder this process will use
    folder = Path(os.environ[PTX_CACHE_ENV])
    before = _files(folder)
    start = time.perf_counter()
    target, tokenizer, drafter, _ = load_pair()
    loaded = time.perf_counter()
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        speculative_generate(target, tokenizer, drafter, PROMPT, max_new_tokens=max_tokens)
        seconds.append(time.perf_counter() - t0)
    return {
        "load_s": round(loaded - start, 2),
        "first_decode_s": round(seconds[0], 2),
        "second_decode_s": round(seconds[1], 2),
        "cache_dir": str(folder),
        "cache_files_before": before,
        "cache_files": _files(folder),
    }


def _files(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def _run(label: str, env: dict[str, str], max_tokens: int) -> dict[str, object]:
    """One fresh process's figures, with its wall time from launch to exit."""
    t0 = time.perf_counter()
    row = run_child(__file__, ["--max-tokens", str(max_tokens)], env, f"the {label!r} process")
    return {"process": label, "wall_s": round(time.perf_counter() - t0, 2), **row}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.max_tokens)))
        return 0
    home = {k: v for k, v in os.environ.items() if k != PTX_CACHE_ENV}
    rows = [_run("home, first", home, args.max_tokens), _run("home, again", home, args.max_tokens)]
    with tempfile.TemporaryDirectory(prefix="mlx-kernels-empty-") as empty:
        rows.append(_run("empty", {**home, PTX_CACHE_ENV: empty}, args.max_tokens))
    rows.append(_run("home, last", home, args.max_tokens))
    cols = ("process", "wall_s", "load_s", "first_decode_s", "second_decode_s",
            "cache_files_before", "cache_files")  # fmt: skip
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
