#!/usr/bin/env bash
# The trainer's optimizer before and after 2026-12-04, on the H200, same data and steps:
#   old: bfloat16 weights and AdamW state on the GPU, no bias correction (how the shipped
#        drafters were trained: their norm weights never moved);
#   new: the defaults (float32 weights and state, bias-corrected AdamW).
# A 3-layer DSpark drafter from scratch (recipes/train/smollm2-135m-dspark-base.yaml) on a
# smaller self-distilled set (8,000 self prompts, answers of at most 256 tokens), the same
# batches in both arms (a pure function of seed and step); the training log's loss and
# teacher-forced acceptance every 50 steps into $OUT/ab-ARM.log.
#
# Staged as benchmarks/train_device.sh says; the prompt sets travel in the tree, untracked, as
# abprompts/ (cp -r ../shared/data/prompts abprompts; remove it afterwards). Calls, back to back:
#   bash benchmarks/optimizer_ab.sh data     # the data, then 30 steps of each arm timed
#   STEPS=400 bash benchmarks/optimizer_ab.sh arms
# A fresh machine compiles the step's kernels on first use: 2-3.5 min before the first step of
# each dtype (2026-12-04: the data call's 30 old-arm steps took 218 s, the call's limit cut the
# new arm's); a second process of the same dtype starts in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
install_here
model_here
: "${OUT:?OUT must name the folder whose files come back}"
mkdir -p ../shared/data
[ -e ../shared/data/prompts ] || cp -r abprompts ../shared/data/prompts
RECIPE=recipes/train/smollm2-135m-dspark-base.yaml
DATA=(--set data.self_prompts="${SELF:-8000}" --set data.max_new_tokens=256)
df() { python3 -P -m dspark_flow.cli.main train "$RECIPE" "${DATA[@]}" "$@"; }
arm_settings() {
  case "$1" in
    old) echo "--set train.dtype=bfloat16 --set train.bias_correction=false" ;;
    new) echo "" ;;
  esac
}

case "${1:-}" in
  data)
    df --stage data --quiet --log-level info 2>&1 | tail -3
    for arm in old new; do
      # shellcheck disable=SC2046
      df --stage train --quiet --fresh $(arm_settings "$arm") --set name="ab-timing-$arm" \
        --set train.steps=30 --set train.log_every=10 --set output="/tmp/ab-timing-$arm" --json \
        > "/tmp/timing-$arm.json"
      python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['train']; \
print(sys.argv[2], t['steps'], 'steps', round(t['seconds'], 1), 's', t['last'])" \
        "/tmp/timing-$arm.json" "$arm" | tee -a "$OUT/timing.log"
    done
    ;;
  arms)
    for arm in old new; do
      # shellcheck disable=SC2046
      timeout -s INT "${ARM_S:-290}" python3 -P -m dspark_flow.cli.main train "$RECIPE" \
        "${DATA[@]}" --stage train --fresh --quiet --log-level info $(arm_settings "$arm") \
        --set name="ab-$arm" --set train.steps="${STEPS:-400}" --set train.log_every=50 \
        --set output="/tmp/ab-$arm" --time-limit "${TRAIN_S:-230}" 2>&1 \
        | grep -E "step|error|paused|trained" | cut -c1-330 | tee "$OUT/ab-$arm.log" | tail -12
    done
    ;;
  *) echo "usage: $0 data | arms" >&2; exit 2 ;;
esac
