"""`dspark-flow bench`: recipes measured against greedy and mlx-lm baselines.

prompts.py (prompt files) -> plan.py (targets, modes, baselines) -> runner.py (interleaved runs,
output-equality check, verify cost curve) -> summary.py (statistics, speedups) -> report.py
(bench.json, bench.md) and plots.py (PNGs, optional matplotlib); api.py ties them together.
fresh_process.py runs a benchmark script's `--child` mode in a new process (costs paid once
per process).
Nothing here is imported by `dspark-flow --help`.
"""
