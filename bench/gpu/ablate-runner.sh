#!/usr/bin/env bash
# On the GPU machine, after run-runner.sh's build stage: what each operation of a layer costs
# inside a captured decode step, where no timeline profiler can look (Nsight Compute times
# kernels one by one, outside the graph and the programmatic launches). For each operation the
# runner leaves it out of every layer (QUANTMLA_ABLATE, profiling only: the outputs are wrong) and
# bench_runner times the step; the difference to the full step is the operation's in-graph cost.
# A 3-layer random V2-Lite (one dense, two MoE layers), decode at ctx 1K, BF16 cache.
#   bash bench/gpu/ablate-runner.sh [BATCH ...]   (default 1); table to stdout and $OUT/ablation.txt
# Ablating an operation that routing depends on (router, route_sort) changes which experts are
# read, and so the weight bound: the table prints each run's bound beside its time.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
build=build-gpu-full
mkdir -p "$out"
batches=("$@")
[[ ${#batches[@]} -gt 0 ]] || batches=(1)
source bench/gpu/three-layer-model.sh
ops=(none q_kv_a write,rope_queries uk decode uv o_proj router route_sort shared experts combine
  mlp)
{
  echo "# QUANTMLA_ABLATE=OP bench_runner --model $model --only decode:B --repeats 30"
  for batch in "${batches[@]}"; do
    full=""
    for op in "${ops[@]}"; do
      ablate=$op
      [[ $op == none ]] && ablate=""
      line=$(QUANTMLA_ABLATE=$ablate $build/bench/gpu/bench_runner --model $model \
        --only "decode:$batch" --repeats 30 2>/dev/null | grep "ctx" | tail -1)
      step=$(sed -E 's/.*step +([0-9.]+) ms.*/\1/' <<<"$line")
      bound=$(sed -E 's/.*bound +([0-9.]+) ms.*/\1/' <<<"$line")
      [[ $op == none ]] && full=$step
      saved=$(python3 -c "print(f'{($full - $step) * 1000:8.1f}')" 2>/dev/null || echo "?")
      printf "B %4s  %-14s step %8s ms  bound %8s ms  saved %s us\n" "$batch" "$op" "$step" \
        "$bound" "$saved"
    done
  done
} | tee "$out/ablation.txt"
