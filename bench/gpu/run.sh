#!/usr/bin/env bash
# On the GPU machine, in one call: builds the kernels (a kernels-only build: nvcc and CMake, none of
# the Debian packages), runs the correctness test, compute-sanitizer memcheck on the quick test,
# counts the tensor-core instructions in the SASS, and runs the benchmark. Results go to $OUT (the
# device tool's folder) or ./gpu-results. Extra arguments go to the benchmark.
#   bash bench/gpu/run.sh [--quick] [--max-seconds S]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
build=build-gpu
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" -DQUANTMLA_CUDA=ON -DQUANTMLA_KERNELS_ONLY=ON \
  -DCMAKE_BUILD_TYPE=Release >"$out/configure.txt"
cmake --build "$build" -j "$(nproc)" 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total \
  --format=csv | tee "$out/device.txt"

status=0
echo "== correctness"
"$build/tests/gpu/test_gpu_mla" 2>&1 | tee "$out/test.txt" || status=1
echo "== compute-sanitizer memcheck (quick cases)"
if command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --error-exitcode 3 "$build/tests/gpu/test_gpu_mla" --quick \
    >"$out/memcheck.txt" 2>&1 || status=1
  tail -3 "$out/memcheck.txt"
else
  echo "compute-sanitizer not found" | tee "$out/memcheck.txt"
fi
echo "== tensor-core instructions in the SASS of the decode kernels"
cuobjdump --dump-sass "$build/src/kernels/cuda/libquantmla_cuda.a" >"$out/sass.txt" 2>&1 || true
grep -oE "(HMMA|HGMMA|LDSM|LDGSTS)[.A-Z0-9_]*" "$out/sass.txt" | sort | uniq -c | tee "$out/sass-summary.txt"
rm -f "$out/sass.txt"
echo "== benchmark"
"$build/bench/gpu/bench_gpu_decode" --json "$out/gpu-decode.json" "$@" 2>&1 | tee "$out/bench.txt" ||
  status=1
exit $status
