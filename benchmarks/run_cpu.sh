#!/usr/bin/env bash
# The CPU comparison for the docs: the embedded target (SmolLM2-135M, float32 on the MLX CPU
# backend) with plain greedy (quickstart), prompt lookup, and a draft model, against our greedy
# loop, mlx-lm's stream_generate and mlx-lm's own speculative decoding, on copy-heavy ("edit")
# and ordinary chat prompts, 3 trials, interleaved.
#
#   benchmarks/run_cpu.sh [OUT_DIR]          (default out/bench-cpu; about 15-20 min on 2 cores)
#   TRIALS=1 LIMIT=1 MAX_TOKENS=16 benchmarks/run_cpu.sh /tmp/smoke   (a quick smoke run)
#
# The draft is the embedded model's own native 4-bit weights drafting for its float32 self:
# honest (nothing of the target leaks into it beyond what 4-bit keeps) but not small - on this
# backend a 4-bit forward costs about as much as the float32 one and its prefill is K-linear,
# so expect it to lose; it is here to compare our draft_model mode with mlx-lm's on equal terms.
# Exit code 3 means some mode's output differed from greedy (see bench.md).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/bench-cpu}
mkdir -p "$out"

# The recipe is written beside the results so the run documents itself.
cat > "$out/draft-4bit.yaml" <<'YAML'
version: 1
name: draft-4bit
target: {model: builtin:smollm2-135m}   # weights auto: float32 on CPU
drafter: {kind: draft_model, model: builtin:smollm2-135m, weights: native}
draft_cap: {kind: fixed, k: 3}
sampler: {kind: greedy}
YAML

exec dspark-flow bench recipes/quickstart.yaml recipes/lookup.yaml "$out/draft-4bit.yaml" \
  --category edit --category chat --limit "${LIMIT:-3}" \
  --trials "${TRIALS:-3}" --max-tokens "${MAX_TOKENS:-64}" \
  --out "$out"
