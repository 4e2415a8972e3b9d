#!/usr/bin/env bash
# The long-context table of docs/results.md (issue 6) on a many-core machine (the GPU machine's
# CPUs, through the device tool): calibrates mla-tiny-v2-4k at --seq 4096 for each QuantMLA
# variant, evaluates every format on the first WINDOWS windows of WikiText-2 at ctx 4096 (compare,
# one window per single-threaded process, tallies merged) and on the pass-key prompts.
# Every job takes its threads from one pool of `nproc` tokens, so nothing is oversubscribed;
# calibrations start first, since their models gate the longest chain.
# Usage: scripts/device-long-context.sh BIN MODEL IDS PROMPTS WORK
#   BIN: a static quantmla (scripts/static-quantmla.sh); MODEL: mla-tiny-v2-4k; IDS:
#   wikitext2-test.ids.i32; PROMPTS: passkey-public.json; WORK: models, tallies, logs, results
#   (WORK/results/*.json, WORK/done when everything has finished). VARIANTS (env) picks the
#   calibrated variants (default: the q-, x- and r- rows of calibration-variants.sh),
#   PASSKEY_SPECS the uncalibrated formats run through eval-passkey (default: every baseline).
#   Calibration reads data/calib.txt of the current directory (quantmla calibrate's default).
set -uo pipefail
if [ $# -ne 5 ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
bin=$1 model=$2 ids=$3 prompts=$4 work=$5
cores=$(nproc) ctx=4096 windows=${WINDOWS:-40}
mkdir -p "$work/models" "$work/tally" "$work/logs" "$work/results"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# The first WINDOWS windows of the text: BOS + ctx-1 tokens each.
head -c $((windows * (ctx - 1) * 4)) "$ids" >"$work/ids.i32"

# shellcheck source=scripts/calibration-variants.sh
source "$(dirname "$0")/calibration-variants.sh"
variants=${VARIANTS:-q-int4-g64 q-int2-g64 x-int4-g64-keep2 x-int2-g64-keep2 r-rope-int2-g64
  r-rope-int2-g32 r-rope-int2-g64-keep2 r-rope-int2-g32-keep2}

# The thread pool: one byte per core in a FIFO; a job takes its threads' worth under a lock (so
# two jobs never hold half of what each needs) and gives them back when it ends.
pool=$work/pool lock=$work/pool.lock
rm -f "$pool" && mkfifo "$pool" && exec 3<>"$pool"
printf '%*s' "$cores" '' | tr ' ' x >&3
acquire() {
  exec {held}>"$lock"
  flock "$held"
  for ((i = 0; i < $1; ++i)); do read -r -n 1 -u 3 _; done
  exec {held}>&-
}
release() { printf '%*s' "$1" '' | tr ' ' x >&3; }
# job THREADS LOG COMMAND...: runs COMMAND with THREADS threads once the pool has them.
job() {
  local threads=$1 log=$2
  shift 2
  acquire "$threads"
  OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads "$@" >"$log.out" 2>"$log.err" ||
    echo "FAILED ($?): $*" >>"$work/failures"
  release "$threads"
}

# compare NAME ARGS...: one single-threaded process per window, then the merged table.
compare() {
  local name=$1
  shift
  for ((w = 0; w < windows; ++w)); do
    job 1 "$work/logs/$name.w$w" "$bin" compare --ids "$work/ids.i32" --ctx $ctx --first-window $w \
      --max-windows 1 --save-tally "$work/tally/$name.w$w.tly" "$@" &
  done
  wait
  "$bin" compare-merge "$work/tally/$name".w*.tly --json "$work/results/compare-$name.json" \
    >"$work/results/compare-$name.txt" 2>>"$work/failures"
}
passkey() {  # NAME THREADS ARGS...
  local name=$1 threads=$2
  shift 2
  job "$threads" "$work/logs/passkey-$name" "$bin" eval-passkey --prompts "$prompts" --json "$@"
  cp "$work/logs/passkey-$name.out" "$work/results/passkey-$name.json"
}

# threads N: N, but at least 1 and at most the pool.
threads() { echo $(($1 < 1 ? 1 : $1 > cores ? cores : $1)); }
start=$(date +%s)
pk_threads=$(threads $((cores / 8 > 4 ? cores / 8 : 4)))
for v in $variants; do
  (
    case $v in r-*) threads=$(threads 2) ;; *) threads=$(threads $((cores / 6))) ;; esac
    # shellcheck disable=SC2046
    job "$threads" "$work/logs/calibrate-$v" "$bin" calibrate --model "$model" --seq $ctx --force \
      --threads "$threads" --out "$work/models/$v" $(args_of "$v")
    cp "$work/logs/calibrate-$v.out" "$work/results/calibrate-$v.txt"
    echo "$v calibrated after $(($(date +%s) - start)) s" >>"$work/progress"
    [ -f "$work/models/$v/config.json" ] || exit 1
    passkey "$v" "$pk_threads" --model "$work/models/$v" &
    compare "$v" --model "$work/models/$v" --baseline-model "$model"
    wait
    echo "$v evaluated after $(($(date +%s) - start)) s" >>"$work/progress"
  ) &
  sleep 1  # calibrations queue for the pool first
done
(
  compare rtn --model "$model" --cache content=fp8,rope=bf16 --cache content=q4_0,rope=q4_0 \
    --cache content=int4:g64,rope=int4:g64 --cache content=int2:g64,rope=int4:g64 \
    --cache content=bf16,rope=int2:g64
  echo "rtn evaluated after $(($(date +%s) - start)) s" >>"$work/progress"
) &
(
  compare hadamard --model "$model" --transform hadamard --seed 0 \
    --cache content=int4:g64,rope=int4:g64 --cache content=int2:g64,rope=int4:g64
  echo "hadamard evaluated after $(($(date +%s) - start)) s" >>"$work/progress"
) &
for spec in ${PASSKEY_SPECS:-bf16 content=fp8,rope=bf16 content=q4_0,rope=q4_0 \
  content=int4:g64,rope=int4:g64 content=int2:g64,rope=int4:g64 content=bf16,rope=int2:g64}; do
  passkey "rtn-${spec//[=,:]/_}" "$pk_threads" --model "$model" --cache "$spec" &
done
passkey hadamard-int2-int4 "$pk_threads" --model "$model" --transform hadamard --seed 0 \
  --cache content=int2:g64,rope=int4:g64 &
wait
echo "all done after $(($(date +%s) - start)) s" >>"$work/progress"
touch "$work/done"
