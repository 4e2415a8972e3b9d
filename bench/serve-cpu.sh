#!/usr/bin/env bash
# bench-serve's two workloads scaled down to the bundled model on the CPU (docs/benchmarks.md):
# P (cache pressure: the budget holds 1/8 of the workload's peak tokens in BF16) and U (the budget
# holds every request at once), four cache formats on the same requests each.
#   bash bench/serve-cpu.sh [OUTDIR]      (default docs/benchmarks/serving)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/benchmarks/serving}
mkdir -p "$out"
# 64 requests x (256 + 64) tokens = 20480 peak tokens; mla-tiny BF16: 6 layers x 1152 B a token.
peak_bytes=$((64 * 320 * 6 * 1152))
formats=(--cache bf16 --cache content=fp8,rope=bf16 --cache content=int4:g64,rope=int4:g64
  --cache content=int2:g64,rope=int4:g64)
common=(--num-prompts 64 --input-len 256 --output-len 64 --seed 0 "${formats[@]}")
build/quantmla bench-serve "${common[@]}" --cache-memory $((peak_bytes / 8)) --check-outputs 8 \
  --json "$out/cpu-mla-tiny-pressure.json" --plot "$out/cpu-mla-tiny-pressure.svg"
build/quantmla bench-serve "${common[@]}" --cache-memory $((peak_bytes + peak_bytes / 8)) \
  --json "$out/cpu-mla-tiny-no-pressure.json" --plot "$out/cpu-mla-tiny-no-pressure.svg"
