#!/usr/bin/env bash
# Retrain one shipped drafter on the H200 in a single lease: self-distilled data, training,
# export, run as one background job (setsid: it outlives the call that starts it) while short
# calls watch it and bring back what it made. One call cannot hold the ~20 minutes this takes.
#
# Staged as benchmarks/train_device.sh says (the model parts); the prompt sets travel in the
# tree, untracked, as abprompts/ (cp -r ../shared/data/prompts abprompts; remove it after).
# STEPS defaults to `auto`: the steps that fit before DEADLINE_S (see pipeline below).
# Calls, back to back (the machine goes back after 30 s idle, and the job with it: on
# 2026-12-04 a watch call sent ~40 s after the last found a fresh machine, the run lost):
#   DEADLINE_S=1400 bash benchmarks/retrain_device.sh start dflash [--set K=V ...]
#   bash benchmarks/retrain_device.sh watch 570        # as often as needed, until "done"
# The data set comes back once made (traindata.tgz.part_*, the recipe's data cache folder:
# keep the parts in .traindata/ and carry it to a later lease to skip the data stage), the
# drafter once exported (drafter.tar):
#   cat FILES_AT/traindata.tgz.part_* | tar -xz -C DIR;  tar -xf FILES_AT/drafter.tar -C DIR
set -euo pipefail
cd "$(dirname "$0")/.."
JOB=/root/retrain
: "${OUT:?OUT must name the folder whose files come back}"

pipeline() {  # the background job: data, train (until STEPS or the deadline), export
  set -eo pipefail
  trap '[ -e "$JOB/done" ] || touch "$JOB/failed"' EXIT
  local kind=$1; shift
  local recipe="recipes/train/smollm2-135m-$kind.yaml" start=$SECONDS
  df() { python3 -P -m dspark_flow.cli.main train "$recipe" --quiet --log-level info "$@"; }
  df --stage data "$@" > "$JOB/data.log" 2>&1
  [ -e "$JOB/data.sent" ] ||  # (made here, not carried)
    tar -C "$DSPARK_FLOW_HOME/train/data" -cf - . | gzip -1 | split -b 15M -d - "$JOB/traindata.tgz.part_"
  touch "$JOB/data.done"
  local left=$(( ${DEADLINE_S:-1480} - (SECONDS - start) ))
  # STEPS=auto: as many steps as the time left holds, so the learning-rate schedule ends
  # (STEP_MS a step, COMPILE_S of first-use kernel compilation, EXPORT_S for the export)
  local steps=${STEPS:-auto}
  if [ "$steps" = auto ]; then
    steps=$(( (left - ${COMPILE_S:-200} - ${EXPORT_S:-40}) * 1000 / ${STEP_MS:-90} / 250 * 250 ))
    [ "$steps" -gt "${MAX_STEPS:-11000}" ] && steps=${MAX_STEPS:-11000}
  fi
  echo "training $steps steps, deadline in $left s" > "$JOB/train.log"
  # Paused by the deadline, the newest checkpoint is exported all the same (a separate call).
  df --stage train --fresh --set train.steps="$steps" --set output="$JOB/out/smollm2-135m-$kind" \
    --time-limit "$left" "$@" 2>&1 | grep -vE "generation  " | cut -c1-300 >> "$JOB/train.log" || true
  df --stage export --set train.steps="$steps" --set output="$JOB/out/smollm2-135m-$kind" "$@" \
    >> "$JOB/train.log" 2>&1
  tar -C "$JOB/out" -cf "$JOB/drafter.tar" "smollm2-135m-$kind"
  echo "done in $(( SECONDS - start )) s" >> "$JOB/train.log"
  touch "$JOB/done"
}

bring_back() {
  cp "$JOB"/*.log "$OUT/" 2>/dev/null || true
  if [ -e "$JOB/data.done" ] && [ ! -e "$JOB/data.sent" ]; then
    cp "$JOB"/traindata.tgz.part_* "$OUT/" && touch "$JOB/data.sent"
  fi
  [ -e "$JOB/done" ] && cp "$JOB/drafter.tar" "$OUT/"
  tail -n 4 "$JOB"/*.log 2>/dev/null | cut -c1-300
}

wait_for_job() {  # wait up to $1 s for the job to finish, then bring back what it has made
  if [ ! -d "$JOB" ]; then  # the machine went back (30 s idle) and this is a fresh one
    echo "no job on this machine: it is a fresh one, the job went with the last" >&2
    exit 3
  fi
  local until=$(( SECONDS + ${1:-570} ))
  while [ ! -e "$JOB/done" ] && [ ! -e "$JOB/failed" ] && [ $SECONDS -lt $until ]; do
    # bring the data back in the first call that sees it (it may be the only call left)
    [ -e "$JOB/data.done" ] && [ ! -e "$JOB/data.sent" ] && break
    sleep 5
  done
  bring_back
  if [ -e "$JOB/done" ]; then echo done; elif [ -e "$JOB/failed" ]; then echo failed; else echo running; fi
}

case "${1:-}" in
  start)
    shift; source benchmarks/device_env.sh; install_here; model_here
    rm -rf "$JOB" && mkdir -p ../shared/data "$JOB"
    [ -e ../shared/data/prompts ] || cp -r abprompts ../shared/data/prompts
    # A data set brought back by an earlier lease (.traindata/, carried): the data stage finds
    # it complete and takes seconds instead of ~6.5 minutes.
    if ls .traindata/traindata.tgz.part_* > /dev/null 2>&1; then
      mkdir -p "$DSPARK_FLOW_HOME/train/data"
      cat .traindata/traindata.tgz.part_* | tar -xz -C "$DSPARK_FLOW_HOME/train/data"
      touch "$JOB/data.sent"
    fi
    export -f pipeline
    export JOB STEPS DEADLINE_S DSPARK_FLOW_HOME PYTHONPATH
    setsid bash -c 'pipeline "$@"' _ "$@" > "$JOB/job.log" 2>&1 < /dev/null &
    wait_for_job "${WATCH_S:-540}"
    ;;
  watch) wait_for_job "${2:-570}" ;;
  *) echo "usage: $0 start dflash|dspark [--set K=V ...] | watch SECONDS" >&2; exit 2 ;;
esac
