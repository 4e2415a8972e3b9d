#!/usr/bin/env bash
# On the GPU machine: Nsight Compute profile of the decode kernel (tiled or fragment) for single benchmark shapes
# (after bench/gpu/run.sh built build-gpu): throughput, memory, stall reasons, occupancy.
#   bash bench/gpu/profile.sh "int4g64/int4,16,32768,16" ["bf16/bf16,16,32768,16" ...]
# DETAILS=1 adds the source counters and prints every metric of the sections, among them each stall
# reason's cycles per issued instruction and its sampled warps.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
details=()
[[ ${DETAILS:-0} == 1 ]] && details=(--section SourceCounters --print-details all)
for shape in "$@"; do
  name=$(echo "$shape" | tr '/,@' '___')
  ncu --clock-control none --kernel-name regex:mla_decode_ --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats \
    --section ComputeWorkloadAnalysis --section InstructionStats "${details[@]}" \
    build-gpu/bench/gpu/bench_gpu_decode --only "$shape" >"$out/ncu-$name.txt" 2>&1 || true
  grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issue Slots Busy|L2 Hit|No Eligible|One or More|Executed Ipc|Executed Instructions|Pipe" \
    "$out/ncu-$name.txt" | head -60 | sed "s|^|$name: |"
done
