#!/usr/bin/env bash
# On the GPU machine, after run-runner.sh's build stage: where a runner step's time goes, on a
# 3-layer random V2-Lite (one dense layer, two MoE layers). For each shape (decode at batch 1 and
# 16, a 2K prefill) it times the steps without a profiler, then runs them under Nsight Compute and
# sums the kernels' durations per kernel name, so that wall time minus kernel time shows the host
# and launch overhead.
#   bash bench/gpu/profile-runner.sh [SHAPE ...]   SHAPE: decode:B or prefill:P (bench_runner --only)
#   e.g. decode:32 decode:128 decode:208 for the decode batches of the serving benchmark's workload P;
#   each table starts with the step's split into GEMMs, attention and the rest. A decode shape's
#   cache is CACHE (default bf16), or its own after a second colon: decode:81:content=int4:g64,...
#   (a third field of bench_runner's own, the context, is not taken here: 1K).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
build=build-gpu-full
mkdir -p "$out"
shapes=("$@")
[[ ${#shapes[@]} -gt 0 ]] || shapes=(decode:1 decode:16 prefill:1)
source bench/gpu/three-layer-model.sh
for shape in "${shapes[@]}"; do
  cache=${CACHE:-bf16}
  if [[ $shape == decode:*:* ]]; then
    cache=${shape#decode:*:}
    shape=${shape%%:$cache}
  fi
  name=${shape/:/-}-${cache//[^a-z0-9]/}
  echo "== $shape, cache $cache"
  $build/bench/gpu/bench_runner --model $model --only "$shape" --cache "$cache" --repeats 10 \
    2>&1 | tail -1
  # --repeats 1: three steps (two warm-up); the last step's kernels are the ones summed.
  ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    $build/bench/gpu/bench_runner --model $model --only "$shape" --cache "$cache" --repeats 1 \
    >"$out/ncu-$name.csv" 2>"$out/ncu-$name.err"
  python3 bench/gpu/ncu_step_table.py "$out/ncu-$name.csv" | tee "$out/ncu-$name.txt"
done
