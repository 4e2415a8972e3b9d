#!/usr/bin/env bash
# On the GPU machine: Nsight Compute profile of the decode kernel (tiled or fragment) for single benchmark shapes
# (after bench/gpu/run.sh built build-gpu): throughput, memory, stall reasons, occupancy.
#   bash bench/gpu/profile.sh "int4g64/int4,16,32768,16" ["bf16/bf16,16,32768,16" ...]
# DETAILS=1 adds the source counters and prints every metric of the sections, among them each stall
# reason's cycles per issued instruction and its sampled warps.
# A shape "flashmla,B,CTX,H" profiles FlashMLA's dense decode kernel instead, with the same
# sections, from the anchor unpacked in ANCHOR_ROOT (.anchor/README.md; build it there first,
# outside the profiler: bench_flashmla.py reuses that build).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
details=()
[[ ${DETAILS:-0} == 1 ]] && details=(--section SourceCounters --print-details all)
for shape in "$@"; do
  name=$(echo "$shape" | tr '/,@' '___')
  kernel=mla_decode_ command=(build-gpu/bench/gpu/bench_gpu_decode --only "$shape")
  if [[ $shape == flashmla,* ]]; then
    IFS=, read -r _ batch ctx heads <<<"$shape"
    kernel=flash_fwd_splitkv_mla command=(python3 .anchor/bench_flashmla.py --root "$ANCHOR_ROOT"
      --heads "$heads" --contexts "$ctx" --batches "$batch")
  fi
  ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats \
    --section ComputeWorkloadAnalysis --section InstructionStats "${details[@]}" \
    "${command[@]}" >"$out/ncu-$name.txt" 2>&1 || true
  grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issue Slots Busy|L2 Hit|No Eligible|One or More|Executed Ipc|Executed Instructions|Pipe" \
    "$out/ncu-$name.txt" | head -60 | sed "s|^|$name: |" || true  # head may close the pipe early
done
