#!/usr/bin/env bash
# On the GPU machine, after run-runner.sh's build stage: what each operation of a layer costs
# inside a runner step, where no timeline profiler can look (Nsight Compute times kernels one by
# one, outside the graph and the programmatic launches, each from a cold L2). For each operation
# the runner leaves it out of every layer (QUANTMLA_ABLATE, profiling only: the outputs are wrong)
# and bench_runner times the step; the difference to the full step is the operation's in-step cost.
# A 3-layer random V2-Lite (one dense, two MoE layers); decode at ctx 1K, BF16 cache, or a prefill.
#   bash bench/gpu/ablate-runner.sh [SHAPE ...]   SHAPE: decode:B or prefill:P (bench_runner
#   --only; a bare number B means decode:B; default decode:1), or blocks:B: decode:B with whole
#   blocks of every layer left out (attention, MoE, dense MLP, all three: what is left is the
#   step's embedding, LM head and sampling); CACHE=SPEC: decode on that cache format (default
#   bf16); table to stdout and $OUT/ablation.txt
# Ablating an operation that routing depends on (router, route_sort) changes which experts are
# read, and so the weight bound and the experts' padding: the decode table prints each run's bound
# beside its time, the prefill table the padding.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
build=build-gpu-full
mkdir -p "$out"
shapes=("$@")
[[ ${#shapes[@]} -gt 0 ]] || shapes=(decode:1)
source bench/gpu/three-layer-model.sh
decode_ops=(none q_kv_a write,rope_queries uk decode uv o_proj router route_sort shared experts
  combine mlp)
attention=input_norm,q_kv_a,write,rope_queries,uk,decode,uv,o_proj
moe=post_norm,router,route_sort,shared,experts,combine
block_ops=(none $attention $moe mlp $attention,$moe,mlp)
prefill_ops=(none input_norm q_kv_a write rope_queries prefill_attention o_proj post_norm router
  route_sort shared experts combine mlp)
{
  echo "# QUANTMLA_ABLATE=OP bench_runner --model $model --only SHAPE --cache ${CACHE:-bf16} --repeats 30"
  for shape in "${shapes[@]}"; do
    [[ $shape == *:* ]] || shape=decode:$shape
    ops=("${decode_ops[@]}")
    [[ $shape == prefill:* ]] && ops=("${prefill_ops[@]}")
    [[ $shape == blocks:* ]] && ops=("${block_ops[@]}") && shape=decode:${shape#blocks:}
    full=""
    for op in "${ops[@]}"; do
      ablate=$op
      [[ $op == none ]] && ablate=""
      line=$(QUANTMLA_ABLATE=$ablate $build/bench/gpu/bench_runner --model $model \
        --only "$shape" --cache "${CACHE:-bf16}" --repeats 30 2>/dev/null |
        grep -E "ctx|prefill" | tail -1)
      if [[ $shape == prefill:* ]]; then
        step=$(sed -E 's/.*tokens: +([0-9.]+) ms.*/\1/' <<<"$line")
        # In place of a bound: the experts' padding (routing changes it).
        beside="padding $(sed -E 's/.*, ([0-9]+)% more on the experts.*/\1%/' <<<"$line")"
      else
        step=$(sed -E 's/.*step +([0-9.]+) ms.*/\1/' <<<"$line")
        beside="bound $(sed -E 's/.*bound +([0-9.]+) ms.*/\1/' <<<"$line") ms"
        beside+=", kernels $(sed -E 's/.*kernels ([0-9.]+) ms.*/\1/' <<<"$line") ms"
      fi
      [[ $op == none ]] && full=$step
      saved=$(python3 -c "print(f'{($full - $step) * 1000:8.1f}')" 2>/dev/null || echo "?")
      printf "%-11s %-18s step %8s ms  %-34s  saved %s us\n" "$shape" "$op" "$step" "$beside" \
        "$saved"
    done
  done
} | tee "$out/ablation.txt"
