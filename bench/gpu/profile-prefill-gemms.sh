#!/usr/bin/env bash
# On the GPU machine: Nsight Compute over the routed experts' products of a 2K prefill, our
# expert_gemm (gated, 4 stages) beside cuBLAS's padded strided-batched product (its first
# algorithm), one launch each after the warm-ups: throughput of each unit, L2 and DRAM traffic,
# stall reasons, pipe use (ncu's demangled names: expert_gemm_kernel<(bool)1, (int)4>). Needs bench_prefill_gemms built in BUILD (default build-gpu-full).
#   bash bench/gpu/profile-prefill-gemms.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
bench=${BUILD:-build-gpu-full}/bench/gpu/bench_prefill_gemms
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
  --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis
  --section InstructionStats)
profile() {  # NAME KERNEL_REGEX ROWS
  ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:$2" --launch-skip 3 \
    --launch-count 1 "${sections[@]}" "$bench" --skew 0 --repeats 1 --only "$3" \
    >"$out/ncu-$1.txt" 2>&1 || true
  # The stall reasons (warps stalled per issued instruction) and the tensor pipes' use, in a
  # run of their own so that a metric name this ncu lacks cannot cost the sections above.
  ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:$2" --launch-skip 3 \
    --launch-count 1 --metrics "regex:smsp__average_warps_issue_stalled_.+_per_issue_active\.ratio,regex:sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active" \
    "$bench" --skew 0 --repeats 1 --only "$3" >"$out/ncu-$1-stalls.txt" 2>&1 || true
  grep -E "stalled|pipe_tensor" "$out/ncu-$1-stalls.txt" | awk '$NF + 0 >= 0.05' | sed "s|^|$1: |" || true
  grep -E "Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issue Slots Busy|L2 Hit|No Eligible|Executed Ipc|Executed Instructions|Grid Size|Block Size|Pipe" \
    "$out/ncu-$1.txt" | head -70 | sed "s|^|$1: |" || true
}
profile expert-gemm-gated-s4 'expert_gemm_kernel<\(bool\)1, \(int\)4>' "gate+up+silu expert_gemm"
profile cublas-gate-up-padded 'nvjet|sm90|gemm' "experts gate+up padded"
