#!/usr/bin/env bash
# Retrain one shipped drafter on the H200 in a single lease: self-distilled data, training,
# export, run as one background job (setsid: it outlives the call that starts it) while short
# calls watch it and bring back what it made. One call cannot hold the ~20 minutes this takes.
#
# Staged as benchmarks/train_device.sh says (the model parts); the prompt sets travel in the
# tree, untracked, as abprompts/ (cp -r ../shared/data/prompts abprompts; remove it after).
# STEPS defaults to `auto`: the steps that fit before DEADLINE_S (see pipeline below); STEPS=0
# makes the data set only and sends it home (a lease too short to train after making it);
# BENCH_S > 0 benches the shipped recipe beside the new drafter after the export (move only the
# other kind's drafter out of the tree to stay under the 64 MiB a call carries; a candidate
# benches beside the shipped recipe of its drafter's kind).
# A recipe that warm-starts (dflash-stage2, dflash, dspark; the candidates) needs its init_from
# in the tree: carry out/drafters/<the stage before> (DFlash's stages 2 and 3 also train on the
# sets of the stages before, extra_data: carry them in .traindata/; the job makes only the named
# recipe's own set). dspark-data2 starts from the shipped DSpark drafter (in the tree) and
# trains on DFlash's first two sets: carry both.
# Calls, back to back (the machine goes back after 30 s idle, and the job with it: on
# 2026-12-04 a watch call sent ~40 s after the last found a fresh machine, the run lost):
#   DEADLINE_S=1320 BENCH_S=300 bash benchmarks/retrain_device.sh start dflash [--set K=V ...]
#   bash benchmarks/retrain_device.sh watch 570        # as often as needed, until "done"
# Budget (measured 2026-12-04 15:46): without a carried data set (414 s to make) a 30-minute
# session holds DEADLINE_S=1450 BENCH_S=0 (7,959 DFlash steps) and no bench; the bench needs a
# carried set (a fresh machine's bench warm-up alone took more than 185 s). With a carried set
# (measured 2026-12-04 18:44): a 325 s bench of the shipped recipes on the fresh machine first,
# then DEADLINE_S=1300 COMPILE_S=160 STEP_MS=100 held a full 10,000-step schedule (1,118 s).
# The data set comes back once made (traindata.tgz.part_*, the recipe's data cache folder:
# keep the parts in .traindata/, renamed KEY.tgz.part_* after the set's folder when it holds
# more than one set, and carry it to a later lease to skip the data stage), the
# drafter once exported (drafter.tar.part_*):
#   cat FILES_AT/traindata.tgz.part_* | tar -xz -C DIR;  cat FILES_AT/drafter.tar.part_* | tar -x -C DIR
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
  # send home the sets made here (a carried set for another recipe leaves this one to make)
  local made
  made=$(cd "$DSPARK_FLOW_HOME/train/data" && ls -d -- */ | tr -d / | grep -vxF -f "$JOB/carried" || true)
  if [ -n "$made" ]; then
    # shellcheck disable=SC2086
    tar -C "$DSPARK_FLOW_HOME/train/data" -cf - $made | gzip -1 | split -b 15M -d - "$JOB/traindata.tgz.part_"
  else
    touch "$JOB/data.sent"
  fi
  touch "$JOB/data.done"
  if [ "${STEPS:-auto}" = 0 ]; then  # data only: a lease too short to train sends the set home
    echo "data only (STEPS=0)" > "$JOB/train.log"
    touch "$JOB/done"
    return 0
  fi
  # training ends EXPORT_S before the deadline, leaving the export its time
  local left=$(( ${DEADLINE_S:-1480} - ${EXPORT_S:-40} - (SECONDS - start) ))
  # STEPS=auto: as many steps as the time left holds (STEP_MS a step after COMPILE_S of
  # first-use kernel compilation), at most the recipe's, so the learning-rate schedule ends
  local steps=${STEPS:-auto}
  if [ "$steps" = auto ]; then
    steps=$(( (left - ${COMPILE_S:-200}) * 1000 / ${STEP_MS:-90} / 250 * 250 ))
    local most
    most=$(python3 -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["train"]["steps"])' "$recipe")
    [ "$steps" -gt "$most" ] && steps=$most
    [ "$steps" -ge 250 ] || steps=0
  fi
  if [ "$steps" -lt 1 ] || [ "$left" -le 0 ]; then
    echo "no time left to train ($left s, $steps steps): raise DEADLINE_S" > "$JOB/train.log"
    exit 1
  fi
  echo "training $steps steps, deadline in $left s" > "$JOB/train.log"
  # Paused by the deadline (exit 0), the newest checkpoint is exported all the same (a
  # separate call); a failure fails the job.
  df --stage train --fresh --set train.steps="$steps" --set output="$JOB/out/smollm2-135m-$kind" \
    --time-limit "$left" "$@" 2>&1 | { grep -vE "generation  " || true; } | cut -c1-300 >> "$JOB/train.log"
  df --stage export --set train.steps="$steps" --set output="$JOB/out/smollm2-135m-$kind" "$@" \
    >> "$JOB/train.log" 2>&1
  # in 15 MiB parts: a call brings back files of at most 16 MiB (the DSpark drafter is ~36 MB)
  tar -C "$JOB/out" -cf - "smollm2-135m-$kind" | split -b 15M -d - "$JOB/drafter.tar.part_"
  touch "$JOB/exported"
  echo "exported in $(( SECONDS - start )) s" >> "$JOB/train.log"
  # BENCH_S > 0: the shipped recipe beside the same recipe with the new drafter, one bench
  # (needs the shipped drafter of this kind in the tree; held-out prompts, 4 a category)
  # (a candidate such as dflash-deep benches against the shipped recipe of its drafter's kind)
  local shipped=
  if [ "${BENCH_S:-0}" -gt 0 ]; then
    shipped=recipes/$(python3 -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["drafter"]["kind"])' "$recipe").yaml
  fi
  if [ -n "$shipped" ] && [ -e "$shipped" ]; then
    sed -e "s|checkpoint: auto|checkpoint: $JOB/out/smollm2-135m-$kind|" \
      -e "s|^name: .*\$|name: $kind-new|" "$shipped" > "$JOB/$kind-new.yaml"
    python3 -P benchmarks/heldout_prompts.py "$JOB/heldout.jsonl" --per-category 4
    timeout -s INT "$BENCH_S" python3 -P -m dspark_flow.cli.main bench "$shipped" \
      "$JOB/$kind-new.yaml" --prompts "$JOB/heldout.jsonl" --trials 2 --warmup-trials 1 \
      --max-tokens 128 --no-mlx-lm --no-verify-cost --no-plots --out "$JOB/bench" --quiet \
      > "$JOB/bench.log" 2>&1 || echo "bench cut short or failed" >> "$JOB/bench.log"
    cp "$JOB/bench/bench.md" "$JOB/bench/bench.json" "$JOB/" 2>/dev/null || true
  fi
  echo "done in $(( SECONDS - start )) s" >> "$JOB/train.log"
  touch "$JOB/done"
}

bring_back() {
  cp "$JOB"/*.log "$OUT/" 2>/dev/null || true
  if [ -e "$JOB/data.done" ] && [ ! -e "$JOB/data.sent" ]; then
    cp "$JOB"/traindata.tgz.part_* "$OUT/" && touch "$JOB/data.sent"
  fi
  # the drafter as soon as it is exported (a bench after it may outlast the lease)
  if [ -e "$JOB/exported" ] && [ ! -e "$JOB/drafter.sent" ]; then
    cp "$JOB"/drafter.tar.part_* "$OUT/" && touch "$JOB/drafter.sent"
  fi
  if [ -e "$JOB/done" ]; then cp "$JOB"/bench.md "$JOB"/bench.json "$OUT/" 2>/dev/null || true; fi
  tail -n 4 "$JOB"/*.log 2>/dev/null | cut -c1-300 || true
}

wait_for_job() {  # wait up to $1 s for the job to finish, then bring back what it has made
  if [ ! -d "$JOB" ]; then  # the machine went back (30 s idle) and this is a fresh one
    echo "no job on this machine: it is a fresh one, the job went with the last" >&2
    exit 3
  fi
  local until=$(( SECONDS + ${1:-570} ))
  while [ ! -e "$JOB/done" ] && [ ! -e "$JOB/failed" ] && [ $SECONDS -lt $until ]; do
    # killed outright (SIGKILL, out of memory), the job leaves no marker: its pid tells
    kill -0 "$(cat "$JOB/pid")" 2> /dev/null || { [ -e "$JOB/done" ] || touch "$JOB/failed"; }
    # bring the data back in the first call that sees it (it may be the only call left)
    [ -e "$JOB/data.done" ] && [ ! -e "$JOB/data.sent" ] && break
    [ -e "$JOB/exported" ] && [ ! -e "$JOB/drafter.sent" ] && break
    sleep 5
  done
  bring_back
  if [ -e "$JOB/done" ]; then echo done; elif [ -e "$JOB/failed" ]; then echo failed; exit 4; else echo running; fi
}

case "${1:-}" in
  start)
    shift; kind=${1:?name the recipe: dflash-base, dflash-stage2, dflash, dspark-base or dspark}
    if [ -e "$JOB/pid" ] && kill -0 "$(cat "$JOB/pid")" 2> /dev/null; then
      echo "a job is running on this machine: watch it" >&2; exit 2
    fi
    recipe="recipes/train/smollm2-135m-$kind.yaml"
    init=$(python3 -c 'import sys, yaml; print((yaml.safe_load(open(sys.argv[1]))["train"]).get("init_from") or "")' "$recipe")
    if [ -n "$init" ] && [ ! -e "$(dirname "$recipe")/$init" ]; then  # before minutes of data
      echo "$recipe warm-starts from $init, which is not here: carry it (or retrain its stage first)" >&2
      exit 2
    fi
    source benchmarks/device_env.sh; install_here; model_here
    rm -rf "$JOB" && mkdir -p ../shared/data "$JOB"
    [ -e ../shared/data/prompts ] || cp -r abprompts ../shared/data/prompts
    # A data set brought back by an earlier lease (.traindata/, carried): the data stage finds
    # it complete and takes seconds instead of ~6.5 minutes.
    mkdir -p "$DSPARK_FLOW_HOME/train/data"
    # Each set its own archive (NAME.tgz.part_*: one tar stream per set, so unpacked apart).
    for set in $(ls .traindata/*.tgz.part_* 2> /dev/null | sed 's/\.part_[0-9]*$//' | sort -u); do
      cat "$set".part_* | tar -xz -C "$DSPARK_FLOW_HOME/train/data"
    done
    (cd "$DSPARK_FLOW_HOME/train/data" && ls -d -- */ 2> /dev/null | tr -d / || true) > "$JOB/carried"
    export -f pipeline
    export JOB STEPS DEADLINE_S DSPARK_FLOW_HOME PYTHONPATH
    setsid bash -c 'pipeline "$@"' _ "$@" > "$JOB/job.log" 2>&1 < /dev/null &
    echo $! > "$JOB/pid"
    wait_for_job "${WATCH_S:-540}"
    ;;
  watch) wait_for_job "${2:-570}" ;;
  *) echo "usage: $0 start dflash-base|dflash-stage2|dflash|dspark-base|dspark|CANDIDATE (dflash-deep, dspark-data2, ...) [--set K=V ...] | watch SECONDS" >&2; exit 2 ;;
esac
