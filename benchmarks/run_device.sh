#!/usr/bin/env bash
# The benchmarks/run_cpu.sh comparison on an NVIDIA H200 with MLX's CUDA backend.
#
# Two steps (see ../shared/device/README.md for the staging machinery):
#
#   1. here, in the repo root:   benchmarks/run_device.sh stage
#      packs the wheels MLX-on-CUDA needs plus the converted embedded model (no network there)
#      into .stage/part_00..NN and .stage/unstage.sh.
#   2. on the device, one call per part, back to back (the machine keeps /root only while warm):
#        carry [".stage/part_00"]:  rm -rf /root/stage && mkdir -p /root/stage && cp .stage/part_00 /root/stage/
#        carry [".stage/part_01"]:  cp .stage/part_01 /root/stage/            (and so on)
#        carry [".stage/part_NN", ".stage/unstage.sh"]:
#          cp .stage/part_NN /root/stage/ && source .stage/unstage.sh && benchmarks/run_device.sh run
#      A later call in the same lease: export PYTHONPATH=/root/env/site && benchmarks/run_device.sh run
#
# `run` writes into $OUT (at most 8 files come back): bench.json, bench.md, bench.log and the two
# recipes it wrote. The device has no matplotlib; draw the figures here afterwards with
#   dspark-flow bench --from-json FILES_AT/bench.json --out out/bench-h200
#
# Targets there: `auto` weights mean native 4-bit on CUDA, so quickstart and lookup run on the
# 4-bit target; the draft-model run needs a target the 4-bit draft is cheaper than, so it runs
# on the bf16 target (with lookup beside it on the same target for comparison).
# Knobs: TRIALS (3), MAX_TOKENS (128), LIMIT (all prompts of each category).
set -euo pipefail
cd "$(dirname "$0")/.."

stage() {
  local model=${DSPARK_FLOW_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/dspark-flow}/models/smollm2-135m
  dspark-flow models pull smollm2-135m >/dev/null  # converts once if the cache lacks it
  ../shared/device/stage.sh --wheels "$model"
}

# install_here and the model setup live in device_env.sh, shared with the other device scripts.
source "$(dirname "$0")/device_env.sh"

run() {
  : "${OUT:?OUT must name the folder whose files come back}"
  install_here
  model_here
  cat > "$OUT/lookup-bf16.yaml" <<'YAML'
version: 1
name: lookup-bf16
target: {model: builtin:smollm2-135m, weights: bfloat16}
drafter: {kind: lookup, min_ngram: 2, max_ngram: 4, max_draft: 16}
draft_cap: {kind: full_block}
sampler: {kind: greedy}
YAML
  cat > "$OUT/draft-4bit.yaml" <<'YAML'
version: 1
name: draft-4bit
target: {model: builtin:smollm2-135m, weights: bfloat16}
drafter: {kind: draft_model, model: builtin:smollm2-135m, weights: native}
draft_cap: {kind: fixed, k: 3}
sampler: {kind: greedy}
YAML
  local limit=()
  [ -n "${LIMIT:-}" ] && limit=(--limit "$LIMIT")
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/bench.log" || true
  # Leave headroom under the 10-minute call limit so whatever was written still comes back.
  # -P: keep the working tree's own dspark_flow/ (which lacks strategies/) off sys.path.
  timeout 500 python3 -P -m dspark_flow bench \
    recipes/quickstart.yaml recipes/lookup.yaml "$OUT/lookup-bf16.yaml" "$OUT/draft-4bit.yaml" \
    --category edit --category chat "${limit[@]}" \
    --trials "${TRIALS:-3}" --max-tokens "${MAX_TOKENS:-128}" \
    --no-plots --out "$OUT" 2>> "$OUT/bench.log"
}

case "${1:-}" in
  stage) stage ;;
  run) run ;;
  *) echo "usage: benchmarks/run_device.sh stage|run   (see the header of this file)" >&2; exit 2 ;;
esac
