#!/usr/bin/env bash
# One lease of two H200s (kind nvidia-h200-x2), three calls after staging: both GPUs busy all
# the time. Both GPUs make the training data (half the answers each), then GPU 0 trains
# DSpark and GPU 1 DFlash. Training pauses at a
# checkpoint before each call's limit (`dspark-flow train --time-limit`) and the next call
# resumes it; the last call exports both drafters and benchmarks them against greedy.
#
# The DSpark and DFlash recipes no longer share a data section (DSpark's has 40,000 self
# prompts since 2026-11-30): in the default mode GPU 1's `train dflash` makes DFlash's own set
# on one GPU first.
# GPU1=sweeps: GPU 1 helps with the data, then runs issue 6's draft-cap sweeps with the CLI's
# stack instead of training DFlash (first: probes and curves; more: DSpark and DFlash; last:
# lookup), and `last` benchmarks the new DSpark drafter against the one it started from
# (train.init_from, kept in out/drafters/smollm2-135m-dspark-base) and stock greedy.
#
# grow-first | grow-more | grow-last [| grow-bench]: two candidates from the shipped drafters on one fresh data
# set (recipes/train/smollm2-135m-dspark-more.yaml on GPU 0, -dflash-grow.yaml on GPU 1),
# exported into out/drafters and benched beside the shipped ones; no stage-1 drafter needed.
# Issue the calls back to back and read their results after the last: the machine goes back
# after ~30 s idle and takes the data and checkpoints with it (2026-11-30 20:16: a grow-first
# whose logs were read before grow-more was lost that way, 560 s of the budget; 23:12: lost
# again with grow-more issued at once). So grow-first now also sends the data set home
# ($OUT/data.tar.xz.part_* and data.sha256, ~20 MB): keep them in .stage/data/ (git-ignored),
# and on a later lease, after part_00..02, stage them with the drafters moved out of the tree
# (carry [".stage/data"]: `mkdir -p /root/stage/data && cp .stage/data/* /root/stage/data/`),
# then with part_03 run grow-one: both candidates from start to end in one call.
# solo-data | solo-grow: the same plan on a one-GPU lease (run 2026-12-01): solo-data makes the
# data set (32,000 self prompts, 388 s) and sends it home like grow-first; solo-grow trains one
# candidate (KIND=dspark-more|dflash-grow, STEPS) per call, unpacking the staged data set first
# on a fresh machine. The set made then is in .stage/data/ (8.2 MB).
# pair-sweeps: issue 6 on a two-GPU lease, DSpark on GPU 0 and DFlash on GPU 1 in one call;
# repeat the call for more trials and join the runs with `draft_caps.py --merge`.
# solo-shipped: issues 5 and 6 as a user runs them (the shipped recipes beside greedy), one call.
# Modes that pick held-out prompts need abprompts/ in the tree (see the prompt sets below).
# solo-*: a one-GPU lease (kind nvidia-h200) with nothing else on the host, for the wall clock
# that the shared two-GPU runs could not give (issues 6 and 9): `CALL_S=480 ... solo-first`
# with the last staged part, then `solo-e2e`, `solo-sweeps`, `solo-lookup`, `solo-pending`,
# `solo-chat` (issue 6 on chat alone), `solo-copy` (prompt lookup before the trained drafters), `solo-sources` (copies planned apart), `solo-new` (prompts the process has not seen: the drafter's attention), `solo-library` (the same for the library's verifier: its attention), `solo-kernel-cache` (what the kernel cache saves a new process; run it first on a fresh machine), `solo-synthetic` (issue 9 on a larger random-weight
# target; needs no solo-first) as the budget allows.
#
# Stage as in train_device.sh, then, one call each:
#   bash benchmarks/device_x2.sh first    (with the last staged part: after `source .stage/unstage.sh`)
#   bash benchmarks/device_x2.sh more     (as often as the budget allows)
#   bash benchmarks/device_x2.sh last
# Each call stays under CALL_S seconds (default 560) from the script's start: a call that
# unstages first (`first`) spends ~40 s before that, so give it CALL_S=540 or less (575 ran
# past the device's 600 s limit on 2026-11-30 and returned no files) and leaves logs, tables and the
# exported drafters (drafters.tar.part_*, see train_device.sh) in $OUT. Data and checkpoints
# live on the warm machine only: if it was given back between calls, `more`/`last` say so and
# stop; stage again and start with `first`. (Run on 2026-11-29 in the version before the
# review fixes of 23:55 UTC: timeouts, the export guard and the bare-machine check.)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
[ -d /root/dspark-flow-site/dspark_flow ] && export PYTHONPATH="/root/env/site:/root/dspark-flow-site" || install_here
model_here
mkdir -p ../shared/data
if [ ! -e ../shared/data/prompts ]; then  # the prompt sets for heldout_prompts.py and the data stage:
  # abprompts/ carried in the tree, untracked (cp -r ../shared/data/prompts abprompts; remove it
  # after), as retrain_device.sh takes them; else a stage that holds them (run_device.sh's does not)
  rm -f ../shared/data/prompts  # a link left dangling by an earlier call
  if [ -d abprompts ]; then cp -r abprompts ../shared/data/prompts; else ln -s /root/env/prompts ../shared/data/prompts; fi
fi
: "${OUT:?OUT must name the folder whose files come back}"
CALL_S=${CALL_S:-560}
START=$(date +%s)
touch /tmp/call_start
O=/tmp/o && mkdir -p $O  # logs and tables; packed into $OUT/results.tgz at the end of each call
left() { local n=$((CALL_S - ($(date +%s) - START))); echo $((n > 1 ? n : 1)); }
upto() { local n=$(( $(left) - $1 )); echo $((n > 1 ? n : 1)); }  # seconds left minus a margin, >= 1 (timeout 0 never ends)
dflow() { python3 -P -m dspark_flow.cli.main "$@"; }
R=recipes/train/smollm2-135m
# The sweeps' verifier unless VERIFIER names another: the CLI's stack (TOOL_DEFAULTS; `prefer_stock`
# is the config's default, spelled out for the record in the logs)
CLI_VERIFIER='{kind: kernels, invariant: true, compile_layers: true, fuse_projections: true, prefer_stock: true}'

data_done() {  # the marker of a complete data set, one per data recipe (DATA_RECIPE)
  echo "/tmp/data.done.$(basename "${DATA_RECIPE:-$R-dspark.yaml}" .yaml)"
}

data() {  # the shared training data, the answers split over DATA_GPUS (default "0 1"; resumable;
  # training waits for it). RSET: extra `--set` arguments for data and training alike (the data
  # cache is keyed by the data section, so both must see the same overrides).
  [ -e "$(data_done)" ] && return 0
  local t=$(upto 60) pids=() gpus=(${DATA_GPUS:-0 1}) i
  [ "$t" -gt 30 ] || { echo "data: too little time left"; return 1; }
  if [ ${#gpus[@]} -gt 1 ]; then
    for i in "${!gpus[@]}"; do  # worker 0 writes the self prompts, the others wait for them
      CUDA_VISIBLE_DEVICES=${gpus[$i]} timeout $t python3 -P -m dspark_flow.cli.main train \
        "${DATA_RECIPE:-$R-dspark.yaml}" --stage data --data-worker $i/${#gpus[@]} ${RSET:-} --quiet --log-level info 2>&1 \
        | grep -vE "generation  " | cut -c1-260 >> $O/data-$i.log &
      pids+=($!)
    done
    wait "${pids[@]}"
  fi
  # Every share on disk: this run checks them and marks the set complete (it generates nothing
  # unless a share was cut short, which it then finishes itself; on one GPU it makes them all).
  CUDA_VISIBLE_DEVICES=${gpus[0]} timeout $(upto 20) python3 -P -m dspark_flow.cli.main train \
    "${DATA_RECIPE:-$R-dspark.yaml}" --stage data ${RSET:-} --quiet --log-level info 2>&1 | grep -vE "generation  " \
    | cut -c1-260 >> $O/data.log && grep -q "training data" $O/data.log && touch "$(data_done)"
  tail -n 2 $O/data*.log
}

train() {  # train KIND GPU [SECONDS] [STAGES]: train (resuming) until done or the time is up
  local kind=$1 gpu=$2 secs=${3:-$(upto 45)} stages=${4:---stage train}
  [ -e "$(data_done)" ] || { echo "$kind: no complete training data here (a bare machine?)"; return 1; }
  [ "$secs" -gt 60 ] || { echo "$kind: too little time left to train"; return 1; }
  # --time-limit is checked between steps; timeout is the backstop (a fresh process first
  # spends minutes compiling CUDA kernels) so the call still returns its files.
  CUDA_VISIBLE_DEVICES=$gpu timeout $(upto 10) python3 -P -m dspark_flow.cli.main train \
    "$R-$kind.yaml" $stages ${RSET:-} --quiet --log-level info --time-limit "$secs" 2>&1 | grep -vE "generation  " | cut -c1-260 >> $O/train-$kind.log
  local last; last=$(grep -E "trained|paused|rror" $O/train-$kind.log | tail -1)
  echo "$kind: $last"
  [[ "$last" == *trained* ]]  # fails when paused or broken, so `train ... && bench` benches only a finished drafter
}

variant() {  # variant SRC NAME CAP [CHECKPOINT] [VERIFIER] [WEIGHTS]: recipes/SRC.yaml as /tmp/NAME.yaml
  local name=$2 ckpt=${4:-auto} verifier=${5:-} weights=${6:-}
  sed -e "s/^name: .*/name: $name/" -e "s/^draft_cap: .*/draft_cap: $3/" \
    -e "s|checkpoint: auto|checkpoint: $ckpt|" "recipes/$1.yaml" > "/tmp/$name.yaml"
  [ -z "$verifier" ] || echo "verifier: $verifier" >> "/tmp/$name.yaml"
  [ -z "$weights" ] || sed -i "s/^target: .*/target: {model: builtin:smollm2-135m, weights: $weights}/" "/tmp/$name.yaml"
}

pack() {  # pack DIR NAME...: the drafters under DIR exported by this call, in parts under $OUT
  local dir=$1 fresh=() name; shift
  for name in "$@"; do  # a paused run exports nothing: never ship half a run
    if [ "$dir/$name/model.safetensors" -nt /tmp/call_start ]; then fresh+=("$name")
    else echo "$name: not exported in this call (training unfinished?): not packed"; fi
  done
  [ ${#fresh[@]} -gt 0 ] || return 0
  tar -C "$dir" -cf /tmp/drafters.tar "${fresh[@]}"
  split -b 15M -d /tmp/drafters.tar "$OUT/drafters.tar.part_"
  sha256sum /tmp/drafters.tar > "$OUT/drafters.sha256"
}

ended() {  # ended STATUS NAME, after a step's command failed: why, in one line
  case $1 in
    124|137) echo "$2 cut short (time limit)" ;;
    3) echo "$2: some outputs differ from greedy (bench's exit 3; see its log)" ;;
    *) echo "$2 ended with status $1 (see its log)" ;;
  esac
}

bench_run() {  # bench_run TAG GPU ARGS...: `dspark-flow bench ARGS` on the held-out prompts, 128
  # tokens, one warm-up pass; log, bench.md and bench.json into $O as bench-TAG.*
  local tag=$1 gpu=$2; shift 2
  rm -rf /tmp/bench-$tag  # a cut run must not leave the last call's table to be copied
  CUDA_VISIBLE_DEVICES=$gpu timeout $(upto 15) python3 -P -m dspark_flow.cli.main bench "$@" \
    --prompts /tmp/heldout.jsonl --warmup-trials 1 --max-tokens 128 --no-verify-cost --no-plots \
    --out /tmp/bench-$tag > $O/bench-$tag.log 2>&1 || ended $? "bench $tag"  # progress lines kept: a cut run shows where
  cp /tmp/bench-$tag/bench.md $O/bench-$tag.md 2>/dev/null; cp /tmp/bench-$tag/bench.json $O/bench-$tag.json 2>/dev/null
  grep -E "^\| \*\*all" $O/bench-$tag.md 2>/dev/null
}

sweep() {  # sweep DRAFTER TRIALS SECONDS [more args]: the draft-cap sweep on GPU 1 (SWEEP_GPU)
  local d=$1 trials=$2 secs=$3; shift 3
  CUDA_VISIBLE_DEVICES=${SWEEP_GPU:-1} timeout "$secs" python3 -P benchmarks/draft_caps.py --drafter "$d" \
    --trials "$trials" --warmup-trials "${WARMUP_TRIALS:-1}" --time-budget $((secs > 120 ? secs - 90 : 30)) --out "/tmp/dc-$d" "$@" > $O/dc-$d.log 2>&1 \
    || ended $? "sweep $d"
  cp "/tmp/dc-$d/results.json" $O/dc-$d.json 2>/dev/null
  tail -2 $O/dc-$d.log
}

bench() {  # bench KIND GPU: one drafter (draft caps auto and full block) against greedy, 3 trials
  variant $1 $1-auto "{kind: auto}"; variant $1 $1-full "{kind: full_block}"
  bench_run $1 $2 /tmp/$1-auto.yaml /tmp/$1-full.yaml --trials 3 --no-mlx-lm
}

base_drafter() {  # the DSpark recipe's warm start (train.init_from): stage 1's 3-layer drafter
  # It shipped until 2026-11-30 (git show d4e706c:dspark_flow/data/drafters/smollm2-135m-dspark/...);
  # the 2026-11-30 08:00 run copied it from the tree. Since then the tree holds the 5-layer
  # drafter, which must not become its own base: bring stage 1 along (or train it with
  # smollm2-135m-dspark-base.yaml) into out/drafters/smollm2-135m-dspark-base.
  local base=out/drafters/smollm2-135m-dspark-base
  grep -q '"num_hidden_layers": 3' $base/config.json 2>/dev/null && return 0
  echo "no 3-layer stage-1 drafter in $base (see base_drafter in $0)"; return 1
}

sweeps() {  # issue 6 on GPU 1 while GPU 0 trains (GPU1=sweeps): the CLI's stack, 128 tokens
  local v='{kind: kernels, invariant: true}' held=(--prompts /tmp/heldout.jsonl --per-category 4)
  case $1 in
    first)  # probe the kernels and calibrate the curves once (cached on the warm machine)
      for d in dspark dflash lookup; do  # (lookup refuses --draft-vocab: its run of 11:02 failed)
        local per=(--draft-vocab 8192); [ $d = lookup ] && per=(--lookup-max-draft 15)
        CUDA_VISIBLE_DEVICES=${SWEEP_GPU:-1} timeout $(upto 15) python3 -P benchmarks/draft_caps.py \
          --drafter $d --trials 0 --verifier "$v" "${per[@]}" \
          --out /tmp/dc-warm-$d >> $O/dc-warm.log 2>&1 || ended $? "warm-up $d"
      done ;;
    more)
      sweep dspark 2 $(( $(upto 20) / 2 + 1 )) --ks 1-7 --verifier "$v" --draft-vocab 8192 "${held[@]}" --max-tokens 128
      sweep dflash 2 $(upto 20) --ks 1-7 --verifier "$v" --draft-vocab 8192 "${held[@]}" --max-tokens 128 ;;
    last)
      sweep lookup 2 $(upto 20) --ks 1-10 --verifier "$v" --lookup-max-draft 15 --per-category 3 --max-tokens 128 ;;
  esac
}

pack_data() {  # the finished data set of DATA_RECIPE, xz-packed in 15 MB parts under $OUT
  local dir
  dir=$(sed -n 's/.* cache=\([^ ]*\) .*/\1/p' $O/data.log | tail -1)
  [ -n "$dir" ] && [ -f "$dir/manifest.json" ] || { echo "pack_data: no finished data set"; return 1; }
  tar -C "$(dirname "$dir")" -cf - "$(basename "$dir")" | xz -T0 -1 > /tmp/data.tar.xz || return 1
  split -b 15M -d /tmp/data.tar.xz "$OUT/data.tar.xz.part_"
  (cd /tmp && sha256sum data.tar.xz) > "$OUT/data.sha256"
  echo "data set packed: $(du -h /tmp/data.tar.xz | cut -f1) from $dir"
}

unpack_data() {  # the data set staged in /root/stage/data (pack_data's parts), into the data cache
  ls /root/stage/data/data.tar.xz.part_* > /dev/null 2>&1 \
    || { echo "no data set staged in /root/stage/data (see the header)"; return 1; }
  cat /root/stage/data/data.tar.xz.part_* > /tmp/data.tar.xz
  (cd /tmp && sha256sum -c /root/stage/data/data.sha256) || return 1
  mkdir -p "$DSPARK_FLOW_HOME/train/data" && tar -C "$DSPARK_FLOW_HOME/train/data" -xf /tmp/data.tar.xz
}

staged_data() {  # the candidates' data set: complete on this warm machine already, else the one
  # a grow-first or solo-data sent home, staged in /root/stage/data (unpacked, then checked)
  [ -e "$(data_done)" ] || { unpack_data && data; }
}

candidate_dir() {  # candidate_dir KIND: where the candidate recipe $R-KIND.yaml exports (out/drafters/...)
  echo "$PWD/out/drafters/$(sed -n 's|^output: \.\./\.\./out/drafters/||p' "$R-$1.yaml")"
}

bench_candidate() {  # bench_candidate KIND GPU: a candidate beside the shipped drafter, under the
  # draft caps CAPS (default "auto full_block") and the recipe's verifier (VERIFIER overrides it)
  local base=${1%%-*} dir cap recipes=()
  dir=$(candidate_dir $1)
  [ -f "$dir/config.json" ] || { echo "$1: no exported drafter in $dir"; return 1; }
  for cap in ${CAPS:-auto full_block}; do
    variant $base $base-shipped-$cap "{kind: $cap}" auto "${VERIFIER:-}"
    variant $base $base-candidate-$cap "{kind: $cap}" "$dir" "${VERIFIER:-}"
    recipes+=(/tmp/$base-shipped-$cap.yaml /tmp/$base-candidate-$cap.yaml)
  done
  bench_run $1 $2 "${recipes[@]}" --trials "${TRIALS:-2}" --no-mlx-lm
}

bench_grown() {  # the new DSpark drafter (auto, full block) and the one it grew from, with stock greedy
  variant dspark dspark-auto "{kind: auto}"; variant dspark dspark-full "{kind: full_block}"
  variant dspark dspark-base-full "{kind: full_block}" "$PWD/out/drafters/smollm2-135m-dspark-base"
  bench_run grown 0 /tmp/dspark-auto.yaml /tmp/dspark-full.yaml /tmp/dspark-base-full.yaml --trials 2
}

case "${1:-}" in
  first|more)  # the data on both GPUs, then DSpark on GPU 0 and DFlash (or the sweeps) on GPU 1
    [ "$1" = first ] && nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee $O/gpus.log
    base_drafter || exit 1
    [ "${GPU1:-dflash}" = sweeps ] && python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category 4
    data
    train dspark 0 &
    if [ "${GPU1:-dflash}" = sweeps ]; then sweeps "$1" & else train dflash 1 & fi
    wait
    ;;
  last)  # finish training, export, pack, then each drafter against greedy on its own GPU
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-4}"
    base_drafter || exit 1
    if [ "${GPU1:-dflash}" = sweeps ]; then
      ( train dspark 0 "${TRAIN_S:-150}" "--stage train --stage export" && bench_grown ) &
      sweeps last &
    else
      for kind in dspark dflash; do
        gpu=$([ $kind = dspark ] && echo 0 || echo 1)
        (  # export runs only if training finished (a paused run skips it): never ship half a run
          train $kind $gpu "${TRAIN_S:-150}" "--stage train --stage export" && bench $kind $gpu
        ) &
      done
    fi
    wait
    pack dspark_flow/data/drafters smollm2-135m-dspark smollm2-135m-dflash
    ;;
  caps)  # the shipped DSpark drafter under draft caps auto / fixed 2 / full block, 4-bit (GPU 0) and bf16 (GPU 1)
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-4}"
    variant dspark dspark-auto "{kind: auto}"; variant dspark dspark-k2 "{kind: fixed, k: 2}"
    variant dspark dspark-full "{kind: full_block}"
    for w in native bfloat16; do
      bench_run caps-$w $([ $w = native ] && echo 0 || echo 1) /tmp/dspark-{auto,k2,full}.yaml \
        --trials 3 --no-mlx-lm --set target.weights=$w &
    done
    wait
    ;;
  kernels|kernels2)  # issue 9 on GPU 0 (verify kernels); GPU 1: token counts (issue 5), then draft caps (issue 6, 256 tokens)
    # Two calls back to back: the verdicts and MLX's compiled kernels stay on the warm machine,
    # so the second call spends its time on more prompts instead of probing and compiling.
    export DSPARK_FLOW_KERNEL_CACHE=/tmp/kernel-cache
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-8}"
    tag=$1
    (
      extra=$([ "$tag" = kernels ] && echo "--prompts 4" || echo "--prompts 6 --trials 2")
      CUDA_VISIBLE_DEVICES=0 timeout $(upto 15) python3 -P benchmarks/kernels_device.py \
        --prompts-file /tmp/heldout.jsonl --budget $(upto 45) $extra --out /tmp/$tag \
        > $O/$tag.log 2>&1 || ended $? "kernels_device"
      for f in kernels.json kernels.md kernels_cost.png verdicts.json; do
        cp /tmp/$tag/$f $O/$tag-$f 2>/dev/null; done
      grep -E "\(d\) .*tok/s" $O/$tag.log | tail -15
    ) &
    if [ "$tag" = kernels ]; then  # the target's own outputs on the training prompts, counted (draft vocabulary)
      ( data 1 && python3 -P benchmarks/token_counts.py "$R-dspark.yaml" $O/token_counts.npy | tee -a $O/data.log ) &
    else
      sweep dspark 2 $(upto 20) --ks 1-7 --prompts /tmp/heldout.jsonl --per-category 4 --max-tokens 256 &
    fi
    wait
    ;;
  grow-first|grow-more)  # candidates (two-GPU lease): their shared data on both GPUs, then
    # DSpark trained further (smollm2-135m-dspark-more.yaml) on GPU 0 and DFlash grown to 5
    # layers (smollm2-135m-dflash-grow.yaml) on GPU 1; both start from the shipped drafters.
    # grow-first also sends the finished data set home (pack_data), so that a machine lost
    # between calls costs the training done so far, never the data again: see grow-one.
    export DATA_RECIPE="$R-dspark-more.yaml"
    data && [ "$1" = grow-first ] && pack_data
    train dspark-more 0 & train dflash-grow 1 &
    wait
    ;;
  grow-one)  # both candidates trained start to end in this one call, from a data set that a
    # grow-first sent home and earlier calls staged back into /root/stage/data (see the header);
    # STEPS (default 3000) is what fits after unstaging, the data check and the start-up. For a
    # fresh machine: on one still warm from grow-first, grow-more resumes its checkpoints instead.
    # Not yet run (written 2026-12-01 after the second loss); the pack/unpack pair was run here.
    export DATA_RECIPE="$R-dspark-more.yaml"
    staged_data || exit 1
    for kind in dspark-more dflash-grow; do
      gpu=$([ $kind = dspark-more ] && echo 0 || echo 1)
      train $kind $gpu $(upto 45) "--stage train --stage export --set train.steps=${STEPS:-3000}" &
    done
    wait
    pack out/drafters $(basename "$(candidate_dir dspark-more)") $(basename "$(candidate_dir dflash-grow)")
    ;;
  grow-last)  # finish and export into out/drafters, pack; bench beside the shipped ones if time is left
    export DATA_RECIPE="$R-dspark-more.yaml"
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-4}"
    for kind in dspark-more dflash-grow; do
      gpu=$([ $kind = dspark-more ] && echo 0 || echo 1)
      ( train $kind $gpu "${TRAIN_S:-150}" "--stage train --stage export" \
        && if [ "$(left)" -gt 300 ]; then bench_candidate $kind $gpu; else echo "$kind: bench with grow-bench"; fi ) &
    done
    wait
    pack out/drafters $(basename "$(candidate_dir dspark-more)") $(basename "$(candidate_dir dflash-grow)")
    ;;
  grow-bench)  # each exported candidate beside the shipped drafter, one per GPU
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-4}"
    bench_candidate dspark-more 0 & bench_candidate dflash-grow 1 &
    wait
    ;;
  solo-*)  # one-GPU lease (kind nvidia-h200), nothing else on the host: later calls reuse the
    # kernels' verdicts and the calibration curves left on the warm machine
    export DSPARK_FLOW_KERNEL_CACHE=/tmp/kernel-cache SWEEP_GPU=0
    ;;&
  solo-data)  # issue 5 on a one-GPU lease (after unstaging): the candidates' data set on this
    # GPU alone, sent home as grow-first does (the recipes' 32,000 self prompts: 388 s; 40,000
    # would need ~415 s, too close to a call's limit). Overrides given in RSET must be given to
    # every later call of the plan too, training included.
    export DATA_RECIPE="$R-dspark-more.yaml" DATA_GPUS=0
    data && pack_data
    ;;
  solo-grow)  # one candidate (KIND: dspark-more or dflash-grow) trained start to end on one GPU
    # (the recipe's steps, or STEPS), exported and packed; its data from a warm solo-data call,
    # else unpacked from /root/stage/data
    export DATA_RECIPE="$R-dspark-more.yaml" DATA_GPUS=0
    staged_data || exit 1
    train "${KIND:?KIND names the candidate}" 0 $(upto 45) "--stage train --stage export ${STEPS:+--set train.steps=$STEPS}"
    pack out/drafters "$(basename "$(candidate_dir "$KIND")")"
    ;;
  solo-candidate)  # KIND's exported candidate (carried in out/drafters) beside the shipped drafter
    # on one GPU, e.g. VERIFIER='{kind: reference}' CAPS=full_block: no kernel probes, no curves
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-2}"
    bench_candidate "${KIND:?KIND names the candidate}" 0
    ;;
  solo-shipped)  # issues 5 and 6 as a user runs them: the shipped recipes (RECIPES, default
    # "dflash dspark": prompt lookup on, `auto`, the CLI's stack) beside greedy, PER_CATEGORY
    # (default 4) held-out prompts a category, TRIALS (default 2) after a warm-up pass;
    # BENCH_ARGS (default --no-mlx-lm). Needs no solo-first: the verifier probes at warm-up.
    # Both drafters in one bench, which the bench warns about on GPUs (3-5x slower runs once on an
    # H200; none on the H100 of 2026-12-05): RECIPES=dflash for one kind alone.
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-4}" || exit 2
    set --
    for r in ${RECIPES:-dflash dspark}; do set -- "$@" "recipes/$r.yaml"; done
    bench_run shipped 0 "$@" --trials "${TRIALS:-2}" ${BENCH_ARGS---no-mlx-lm}
    ;;
  solo-first)  # after unstaging
    # Issue 9: verdicts, verify cost curve and batch invariance of the five targets (no end to
    # end here: solo-e2e runs it one pipeline at a time). The whole call: on 2026-11-30 the
    # first CUDA compile and the probes took 235 s, and 200 s less than this cut the curve.
    # The sweeps calibrate their own curves (~45 s each) when they run.
    # KTARGETS (default the two 4-bit verifiers; "all" adds the bf16 pair, whose attention
    # probes took 60-85 s) picks the targets beside the stock baseline.
    CUDA_VISIBLE_DEVICES=0 timeout $(upto 15) python3 -P benchmarks/kernels_device.py \
      --trials 0 --budget $(upto 30) --targets "${KTARGETS:-4bit-kernels,4bit-invariant}" \
      --out /tmp/kern > $O/kernels.log 2>&1 || ended $? "kernels_device"
    for f in kernels.json kernels.md kernels_cost.png verdicts.json; do cp /tmp/kern/$f $O/kernels-$f 2>/dev/null; done
    grep -E "\(b\) K=(1|2|4|8|16) " $O/kernels.log
    ;;
  solo-e2e)  # issues 5 and 9 end to end in one `dspark-flow bench`: 4-bit through the invariant
    # kernels (the CLI's stack) and through MLX's stock path, both with compiled layers (so the
    # two differ in the kernels only); each target with its own greedy and mlx-lm's stock greedy.
    # LEAN=1 drops the two full-block recipes. FUSED=1 adds `auto` with fuse_projections (probe
    # its stacked shapes first, e.g. compile_ab.py --option verifier.fuse_projections). PREFER_STOCK=1 adds `auto` with `prefer_stock` spelled
    # out (the 12:36 UTC run of 2026-12-01, when it was off by default; now kernels-auto is the same).
    # BF16=1 adds the bf16 target through the kernels, probed here unless solo-first had
    # KTARGETS=all (~60-85 s); `LEAN=1 PREFER_STOCK=1 BF16=1 TRIALS=3` after a solo-first without
    # it was cut at 536 s on 2026-12-01 ~12:55 UTC, still warming up. BF16=stock adds it through
    # MLX's own path with compiled layers instead: nothing to probe (336 s with LEAN=1 FUSED=1
    # TRIALS=2 on 2026-12-01 17:30 UTC).
    # The six-recipe version (bf16 included, layers not compiled) was
    # cut at 506 s on 2026-12-01 at ~10:10 UTC with an empty log: no mode had finished its warm-up.
    # 3 per category: 4 (12 prompts, 2 trials) ran past a 540 s call on 2026-11-30 at 15:12 UTC.
    # Only on a machine whose kernels were probed (solo-first): the first probes' CUDA compile
    # (~170 s) left no time for the bench on 2026-12-01 at 06:51 UTC.
    if [ -z "$(ls -A "$DSPARK_FLOW_KERNEL_CACHE" 2>/dev/null)" ]; then
      echo "solo-e2e: no kernel verdicts on this machine yet; run solo-first in a call before it"; exit 2
    fi
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-3}"
    inv='{kind: kernels, invariant: true, compile_layers: true}' stock='{kind: reference, compile_layers: true, attention: fused}'
    variant dspark kernels-full '{kind: full_block}' auto "$inv"; variant dspark kernels-auto '{kind: auto}' auto "$inv"
    variant dspark stock-k2 '{kind: fixed, k: 2}' auto "$stock"; variant dspark stock-full '{kind: full_block}' auto "$stock"
    set -- /tmp/{kernels-full,kernels-auto,stock-k2,stock-full}.yaml
    [ -z "${LEAN:-}" ] || set -- /tmp/{kernels-auto,stock-k2}.yaml  # each path at its best cap only
    if [ -n "${PREFER_STOCK:-}" ]; then  # the invariant routes that keep MLX's own kernels
      variant dspark kernels-auto-stock '{kind: auto}' auto '{kind: kernels, invariant: true, compile_layers: true, prefer_stock: true}'
      set -- "$@" /tmp/kernels-auto-stock.yaml
    fi
    if [ -n "${FUSED:-}" ]; then  # the invariant routes with q/k/v and gate/up stacked (fuse_projections)
      variant dspark kernels-auto-fused '{kind: auto}' auto '{kind: kernels, invariant: true, compile_layers: true, fuse_projections: true}'
      set -- "$@" /tmp/kernels-auto-fused.yaml
    fi
    if [ -n "${BF16:-}" ]; then
      if [ "$BF16" = stock ]; then
        variant dspark bf16-stock-auto '{kind: auto}' auto "$stock" bfloat16
        set -- "$@" /tmp/bf16-stock-auto.yaml
      else
        variant dspark bf16-full '{kind: full_block}' auto '{kind: kernels, compile_layers: true}' bfloat16
        set -- "$@" /tmp/bf16-full.yaml
      fi
    fi
    bench_run e2e 0 "$@" --trials "${TRIALS:-2}"
    ;;
  solo-copy)  # prompt lookup before the trained drafters (drafter option prompt_lookup), after
    # solo-first: DRAFTERS (default dspark dflash) with `auto` and the CLI's stack, each without
    # and with it, beside greedy and mlx-lm's greedy, TRIALS (default 2) after a warm-up pass.
    # TWIN=1 adds the recipe without it once more, after the one with it (is a mode slower for
    # the pipeline that ran before it?); SEPARATE=1 runs one bench process per recipe instead;
    # BENCH_ARGS: more bench arguments (--no-mlx-lm)
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-3}"
    recipes=()
    for d in ${DRAFTERS:-dspark dflash}; do
      for name in off on ${TWIN:+off-b}; do
        variant $d $d-copy-$name '{kind: auto}'
        sed -i -e 's/, prompt_lookup: [a-z]*//' -e "s/draft_vocab: 8192}/draft_vocab: 8192, prompt_lookup: ${name%-b}}/" /tmp/$d-copy-$name.yaml
        recipes+=(/tmp/$d-copy-$name.yaml)
      done
    done
    if [ -n "${SEPARATE:-}" ]; then  # one bench process per recipe, each with its own greedy
      for r in "${recipes[@]}"; do bench_run "$(basename "$r" .yaml)" 0 "$r" --trials "${TRIALS:-2}" ${BENCH_ARGS:-}; done
    else
      bench_run copy 0 "${recipes[@]}" --trials "${TRIALS:-2}" ${BENCH_ARGS:-}
    fi
    ;;
  solo-sources)  # copies planned apart from the drafter's pass (`auto`'s plan_sources_apart),
    # after solo-first: for each of DRAFTERS (default dspark dflash), one bench process of the
    # shipped recipe (prompt_lookup on, `auto`) with copies planned apart and with one plan for
    # every round, beside greedy; TRIALS (default 3) after a warm-up pass; BENCH_ARGS as above
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-3}"
    for d in ${DRAFTERS:-dspark dflash}; do
      variant $d $d-apart '{kind: auto, plan_sources_apart: true}'
      variant $d $d-one '{kind: auto}'  # the default: one plan for every round
      bench_run sources-$d 0 /tmp/$d-apart.yaml /tmp/$d-one.yaml --trials "${TRIALS:-3}" ${BENCH_ARGS:-}
    done
    ;;
  solo-new)  # the shipped DSpark recipe on prompts the process has not decoded before (the
    # first pass, timed) and again, with each drafter attention (VALUES, default fused,matmul),
    # beside greedy, PASSES times (default 2); needs no solo-first (the CLI verifier probes at
    # the first warm-up); RECIPE (default dspark); DRAFTER_ATTENTION=0 skips the per-pass timings
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-3}"
    timeout "$(upto 20)" python3 -P benchmarks/new_prompts.py --prompts /tmp/heldout.jsonl \
      --recipe "recipes/${RECIPE:-dspark}.yaml" --values "${VALUES:-fused,matmul}" \
      --passes "${PASSES:-2}" --out $O/new_prompts.json 2>&1 | tee $O/new_prompts.log
    if [ "${DRAFTER_ATTENTION:-1}" = 1 ]; then
      for d in dspark dflash; do
        timeout "$(upto 10)" python3 -P benchmarks/drafter_attention.py --drafter $d --steps 40 \
          --out $O/drafter_attention-$d.json 2>&1 | tee $O/drafter_attention-$d.log
      done
    fi
    ;;
  solo-library)  # `dflash_generate`'s stack (the library's defaults: the `reference` verifier,
    # the full block, no prompt lookup) on new prompts, then again, with the verifier's
    # attention fused and matmul, beside greedy (library defaults too); PASSES (default 2);
    # WEIGHTS=bfloat16 for a target whose attention runs in half precision (where `auto` routes
    # it: the embedded target's native 4-bit attends in float32)
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category "${PER_CATEGORY:-3}"
    timeout "$(upto 20)" python3 -P benchmarks/new_prompts.py --prompts /tmp/heldout.jsonl \
      --weights "${WEIGHTS:-auto}" --library --recipe recipes/dflash.yaml --set draft_cap.kind=full_block \
      --set drafter.prompt_lookup=false --vary verifier.attention --passes "${PASSES:-2}" \
      --out $O/new_library.json 2>&1 | tee $O/new_library.log
    ;;
  solo-kernel-cache)  # MLX's compiled-kernel cache under dspark-flow's home: a short decode in
    # four fresh processes (the home cache filling, then filled; an empty cache folder; the home
    # again). Run it first on a fresh machine, before anything else compiles
    timeout "$(upto 10)" python3 -P benchmarks/kernel_cache.py --out $O/kernel_cache.json \
      2>&1 | tee $O/kernel_cache.log
    ;;
  solo-sweeps)  # issue 6 on a quiet GPU: DRAFTERS (default dspark dflash) share the call, each
    # one warm-up pass, then as many of TRIALS (default 6) as its share holds (~72 s a trial of 9
    # prompts on 2026-11-30, after a 100-130 s warm-up pass). One trial could not resolve 5%
    # there: DRAFTERS=dspark gives one drafter the whole call. STICKY=0.05 adds `auto` with that
    # switch_margin beside the plain one (benchmarks §3: does changing shapes cost on CUDA?);
    # LOOKUP=1 turns the drafters' prompt_lookup on, as the shipped recipes have it.
    v=${VERIFIER:-$CLI_VERIFIER} held=(--prompts /tmp/heldout.jsonl --per-category 3)
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category 3
    set -- ${DRAFTERS:-dspark dflash}
    while [ $# -gt 0 ]; do
      sweep $1 "${TRIALS:-6}" $(( $(upto 20) / $# + 1 )) --ks 1-7 --verifier "$v" --draft-vocab 8192 "${held[@]}" --max-tokens 128 ${STICKY:+--sticky $STICKY} ${LOOKUP:+--prompt-lookup}
      shift
    done
    ;;
  pair-sweeps)  # issue 6 on a two-GPU lease: DSpark on GPU 0 and DFlash on GPU 1 at the same time,
    # each its own whole call (as solo-sweeps with one drafter each); a second call reuses the
    # curves and verdicts left on the warm machine and fits more trials
    v=${VERIFIER:-$CLI_VERIFIER} held=(--prompts /tmp/heldout.jsonl --per-category 3)
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category 3
    rm -rf /tmp/dc-dspark /tmp/dc-dflash
    SWEEP_GPU=0 sweep dspark "${TRIALS:-10}" $(upto 20) --ks 1-7 --verifier "$v" --draft-vocab 8192 "${held[@]}" --max-tokens 128 &
    SWEEP_GPU=1 sweep dflash "${TRIALS:-10}" $(upto 20) --ks 1-7 --verifier "$v" --draft-vocab 8192 "${held[@]}" --max-tokens 128 &
    wait
    ;;
  solo-chat)  # issue 6's chat question on a quiet GPU (after solo-first): DSpark on CHAT_N
    # (default 6) held-out mt-bench prompts only, fixed KS (default 2,4,5) beside `auto`,
    # `calibrated` and greedy, TRIALS (default 8) as the call holds; the CLI's stack
    python3 benchmarks/heldout_prompts.py /tmp/held-all.jsonl --per-category "${CHAT_N:-6}"
    grep '"category": "chat"' /tmp/held-all.jsonl > /tmp/chat.jsonl
    sweep dspark "${TRIALS:-8}" $(upto 20) --ks "${KS:-2,4,5}" --verifier "${VERIFIER:-$CLI_VERIFIER}" --draft-vocab 8192 --prompts /tmp/chat.jsonl --max-tokens 128
    ;;
  solo-synthetic)  # issue 9 where matmuls set the cost: verdicts, cost curve and invariance on
    # a random-weight target of SHAPE's shapes (default llama3-8b; kernels_device.py SYNTHETIC),
    # 4-bit stock / `kernels` / invariant, and bf16 with DENSE=1. SYN_TARGETS overrides the
    # 4-bit list (4bit-stock always runs): SYN_TARGETS=4bit-invariant skips the `kernels`
    # target's probes (a fresh machine's first call at Llama-3-8B's shapes probed for 451 s on
    # 2026-12-02 and was cut before its curve, docs/benchmarks.md §4)
    t=${SYN_TARGETS:-4bit-kernels,4bit-invariant}; [ -z "${DENSE:-}" ] || t=$t,dense,dense-kernels
    CUDA_VISIBLE_DEVICES=0 timeout $(upto 15) python3 -P benchmarks/kernels_device.py \
      --synthetic "${SHAPE:-llama3-8b}" --budget $(upto 30) --targets $t \
      --out /tmp/kern-syn > $O/synthetic.log 2>&1 || ended $? "kernels_device --synthetic"
    for f in kernels.json kernels.md kernels_cost.png verdicts.json; do cp /tmp/kern-syn/$f $O/synthetic-$f 2>/dev/null; done
    grep -E "\(b\) K=(1|2|4|8|16) " $O/synthetic.log
    ;;
  solo-lookup)
    sweep lookup "${TRIALS:-2}" $(upto 20) --ks 1-10 --verifier "${VERIFIER:-$CLI_VERIFIER}" --lookup-max-draft 15 --per-category "${PER_CATEGORY:-2}" --max-tokens 128
    ;;
  solo-pending)  # lazy greedy drafts (Draft.pending) against synced ones, A/B in one process per
    # verifier: DSpark at fixed k (CAP, default 5), 4 prompts x TRIALS (default 4), 96 tokens
    set -- '{kind: kernels, invariant: true}' '{kind: reference, attention: fused}'
    while [ $# -gt 0 ]; do  # each verifier an equal share of what the call has left
      CUDA_VISIBLE_DEVICES=0 timeout $(( $(upto 15) / $# + 1 )) python3 -P benchmarks/pending_ab.py \
        --set "verifier=$1" --cap "{kind: fixed, k: ${CAP:-5}}" --trials "${TRIALS:-4}" \
        >> $O/pending.log 2>&1 || ended $? "pending_ab $1"
      shift
    done
    grep -E "^pending" $O/pending.log
    ;;
  solo-gap)  # where our plain greedy loses to mlx-lm's (benchmarks/greedy_gap.py: our loop, a
    # bare loop, each in its own stream or not, one token ahead or not, mlx-lm's generate_step;
    # 4 prompts x TRIALS (default 3), 128 tokens), per target: native 4-bit, bf16
    for w in auto bfloat16; do
      CUDA_VISIBLE_DEVICES=0 timeout $(( $(upto 15) / 2 + 1 )) python3 -P benchmarks/greedy_gap.py \
        --set "target.weights=$w" --trials "${TRIALS:-3}" --json $O/gap-$w.json > $O/gap-$w.log 2>&1 \
        || ended $? "greedy_gap $w"
      grep -E "x ours|same tokens" $O/gap-$w.log
    done
    ;;
  solo-ab)  # one boolean recipe option OPTION, off and on, in one process (benchmarks/compile_ab.py:
    # greedy and DSpark, interleaved), 9 held-out prompts (3 per category) x TRIALS (default 3),
    # 128 tokens, cap CAP (default auto), verifier VERIFIER (default the CLI's stack)
    python3 benchmarks/heldout_prompts.py /tmp/heldout.jsonl --per-category 3
    cap='{kind: auto}'; [ -z "${CAP:-}" ] || cap=$CAP
    CUDA_VISIBLE_DEVICES=0 timeout $(upto 15) python3 -P benchmarks/compile_ab.py \
      --option "${OPTION:?OPTION names the boolean to A/B}" --set "verifier=${VERIFIER:-$CLI_VERIFIER}" \
      --cap "$cap" --prompts /tmp/heldout.jsonl --trials "${TRIALS:-3}" --json $O/ab.json \
      > $O/ab.log 2>&1 || ended $? "compile_ab"
    grep -vE "^\s*$" $O/ab.log | tail -6
    ;;
  solo-compile)  # compiled verify layers (verifier option compile_layers), A/B in one process
    # per target (benchmarks/compile_ab.py: greedy and DSpark at fixed k = CAP (default 5),
    # option off and on, 4 prompts x TRIALS (default 3), 128 tokens): 4-bit through MLX's stock
    # path, 4-bit through the invariant kernels, bf16 through MLX's stock path
    set -- 'verifier={kind: reference, attention: fused}|target.weights=auto' \
      'verifier={kind: kernels, invariant: true}|target.weights=auto' \
      'verifier={kind: reference, attention: fused}|target.weights=bfloat16'
    n=0
    while [ $# -gt 0 ]; do  # each target an equal share of what the call has left
      n=$((n + 1)); IFS='|' read -r v w <<< "$1"
      CUDA_VISIBLE_DEVICES=0 timeout $(( $(upto 15) / $# + 1 )) python3 -P benchmarks/compile_ab.py \
        --set "$v" --set "$w" --cap "{kind: fixed, k: ${CAP:-5}}" --trials "${TRIALS:-3}" \
        --json $O/compile-$n.json >> $O/compile.log 2>&1 || ended $? "compile_ab $1"
      shift
    done
    grep -E "^compile_layers|tok/s" $O/compile.log
    ;;
  *) echo "usage: $0 first | more | last | caps | kernels | kernels2 | grow-first | grow-more | grow-one | grow-last | grow-bench | solo-data | solo-grow | solo-candidate | solo-shipped | solo-first | solo-e2e | solo-copy | solo-sources | solo-new | solo-library | solo-kernel-cache | solo-sweeps | pair-sweeps | solo-chat | solo-synthetic | solo-lookup | solo-pending | solo-gap | solo-ab | solo-compile" >&2; exit 2 ;;
esac
tar -C $O -czf "$OUT/results.tgz" .
echo "call took $(( $(date +%s) - START ))s"
