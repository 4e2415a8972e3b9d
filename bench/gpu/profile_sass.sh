#!/usr/bin/env bash
# On the GPU machine: per-SASS-instruction execution counts of the decode kernel for one benchmark
# shape (Nsight Compute source counters), as CSV in $OUT. After bench/gpu/run.sh built build-gpu.
#   bash bench/gpu/profile_sass.sh "int4g64/int4,16,32768,16"
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
name=$(echo "$1" | tr '/,@' '___')
ncu --clock-control none --kernel-name regex:mla_decode_ --launch-skip 1 --launch-count 1 \
  --section SourceCounters --section InstructionStats -o "/tmp/$name" -f \
  build-gpu/bench/gpu/bench_gpu_decode --only "$1" >/dev/null 2>&1
ncu --import "/tmp/$name.ncu-rep" --page source --csv --print-source sass >"$out/sass-$name.csv" 2>&1
ncu --import "/tmp/$name.ncu-rep" --page details --section InstructionStats >"$out/inst-$name.txt" 2>&1
wc -l "$out/sass-$name.csv"
