#!/usr/bin/env bash
# On the GPU machine: bench-serve on a random V2-Lite (27 layers), workload P (the cache budget
# holds 1/8 of the workload's peak tokens in BF16) and workload U (it holds every request), four
# cache formats on the same requests. JSON and SVG to $OUT (or gpu-results).
#   bash bench/gpu/run-serve.sh [NUM_PROMPTS INPUT_LEN OUTPUT_LEN]   (default 256 512 128)
# DECODE_KERNELS="auto tiled": workload P once per decode kernel (QUANTMLA_DECODE_KERNEL; the
# "tiled" run's files end in -tiled), to see how much of a kernel's gain reaches the whole job.
# TAG=NAME: the files are named CARD-v2-lite-NAME-... (e.g. TAG=decode-heavy for 128 256 1024),
# CARD h200 or h100 as nvidia-smi names the card.
# BATCH_INVARIANT=1: workload P only, with --batch-invariant (the runner's reproducible mode), into
# ...-pressure-batch-invariant.json: the greedy check with and without preemption in that mode,
# and what the mode costs beside the default run's figures.
# FORMATS="SPEC ...": the cache formats (default bf16, fp8, int4/int4 and int2/int4).
# SKIP_U=1: workload P only.
# P_DIVISOR=K: workload P's budget holds 1/K of the peak (default 8; the issue asks "at most 1/8";
# 32 gives 512 x 256/1024 the 637 MB of bench/serve_projection.py's projections).
# SERVE_ARGS="...": more bench-serve flags for every run (e.g. "--max-batched-tokens 8192": the
# prefill chunks' token budget, 2048 by default; name such runs with TAG).
# WARMUP=none|shapes|full: bench-serve --warmup before each format's timed run (its default on the
# GPU is shapes, each step shape in seconds; full is an untimed pass of the whole workload, which
# doubles the call's time; none times cold runs, as every run up to 2026-12-04 did, when the
# first format, BF16, also paid the process's one-time costs).
# Each run also writes its steps (decodes, their keys, prefill tokens, tokens generated, pages
# held, requests waiting, swap bytes, ms, the kernels' ms) to ...-steps.csv: the step time
# against the batch as the serving run met it (bench/serve_projection.py's input).
# Needs .carry/deps.tar.xz (scripts/device-carry.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
n=${1:-256} input=${2:-512} output=${3:-128}
case $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) in
  *H200*) card=h200 ;;
  *H100*) card=h100 ;;
  *) card=gpu ;;
esac
name=$card-v2-lite${TAG:+-$TAG}
build=build-gpu-full
bash bench/gpu/device-build.sh quantmla || exit 1
[[ -f /tmp/v2-lite/config.json ]] ||
  $build/quantmla make-random-model --preset deepseek-v2-lite --out /tmp/v2-lite --seed 1 2>/dev/null | tail -1
# V2-Lite BF16: 27 layers x 1152 bytes a token.
peak=$((n * (input + output) * 27 * 1152))
formats=()
for spec in ${FORMATS:-bf16 content=fp8,rope=bf16 content=int4:g64,rope=int4:g64 \
  content=int2:g64,rope=int4:g64}; do
  formats+=(--cache "$spec")
done
common=(--device cuda --model /tmp/v2-lite --num-prompts "$n" --input-len "$input"
  --output-len "$output" --seed 0 "${formats[@]}")
# shellcheck disable=SC2206
common+=(${SERVE_ARGS:-})
[[ -n ${WARMUP:-} ]] && common+=(--warmup "$WARMUP")
mode=
if [[ -n ${BATCH_INVARIANT:-} ]]; then
  common+=(--batch-invariant)
  mode=-batch-invariant
fi
divisor=${P_DIVISOR:-8}
for kernel in ${DECODE_KERNELS:-auto}; do
  suffix=$([[ $kernel == auto ]] || echo "-$kernel")$mode
  echo "== workload P: $((peak / divisor)) bytes of cache (1/$divisor of the BF16 peak), decode kernel $kernel"
  QUANTMLA_DECODE_KERNEL=$kernel $build/quantmla bench-serve "${common[@]}" \
    --cache-memory $((peak / divisor)) --check-outputs 16 --json "$out/$name-pressure$suffix.json" \
    --plot "$out/$name-pressure$suffix.svg" --step-log "$out/$name-pressure$suffix-steps.csv" \
    2>"$out/p$suffix.err"
done
if [[ -z $mode && -z ${SKIP_U:-} ]]; then
  echo "== workload U: $((peak + peak / 8)) bytes (every request at once)"
  $build/quantmla bench-serve "${common[@]}" --cache-memory $((peak + peak / 8)) \
    --json "$out/$name-no-pressure.json" --plot "$out/$name-no-pressure.svg" \
    --step-log "$out/$name-no-pressure-steps.csv" 2>"$out/u.err"
fi
tail -n 3 "$out"/*.err
