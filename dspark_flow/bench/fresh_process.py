"""One measurement in a fresh Python process: the figures a benchmark script's `--child` mode
prints as its last line (JSON).

Why a fresh process: some costs are paid once per process (MLX compiling kernels, the caches
it sets up when `mlx.core` loads), so the scripts that measure them (benchmarks/kernel_cache.py,
benchmarks/attention_plans.py) run their own file again for each setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_child(script: str, args: list[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """Run `script --child *args` under `env` and return the JSON object it printed last; a
    failing child stops the script with one line naming `what` failed and the child's last
    line."""
    cmd = [sys.executable, script, "--child", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"{Path(script).name}: {what} failed: {tail[0]}")
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return row
