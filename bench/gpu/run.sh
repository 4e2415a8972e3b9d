#!/usr/bin/env bash
# On the GPU machine, in one call: builds the kernels (a kernels-only build: nvcc and CMake, none of
# the Debian packages), runs the correctness test, compute-sanitizer memcheck on the quick test,
# counts the tensor-core instructions in the SASS, and runs the benchmark. Where the FlashMLA
# anchor is carried in .anchor/ (../shared/anchors/flashmla/, see its README), it is built beside
# ours and timed on the same grid and s_q, and bench/gpu/merge_anchor.py writes both into
# decode-v2-DATE.json. Results go to $OUT (the device tool's folder) or ./gpu-results. Extra
# arguments go to the benchmark (e.g. --s-q 2, --heads 16, --quick).
#   bash bench/gpu/run.sh [--quick] [--max-seconds S] [--s-q 1|2] [--heads 16|128]
# BASELINE_DIFF=FILE (a `git diff` of the change, carried): the tree without the change (a copy with
# the diff reversed) is built beside ours and timed after it with the same arguments, into
# gpu-decode-baseline.json (and decode-v2-DATE-sqN-baseline.json beside FlashMLA), so that a kernel
# change is measured against its base in the same call.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=build-gpu
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" -DQUANTMLA_CUDA=ON -DQUANTMLA_KERNELS_ONLY=ON \
  -DCMAKE_BUILD_TYPE=Release >"$out/configure.txt"
s_q=1
for ((i = 1; i <= $#; ++i)); do [[ ${!i} == --s-q ]] && { j=$((i + 1)); s_q=${!j}; }; done
anchor_pid=
if [[ -f .anchor/bench_flashmla.py ]]; then
  # FlashMLA's build (about 100 s) and timing run beside ours; it waits for the GPU only while
  # timing, after our build, so the two never time at once.
  fa=$(mktemp -d) && tar -xJf .anchor/flashmla-anchor.tar.xz -C "$fa"
  (MAX_JOBS=6 python3 .anchor/bench_flashmla.py --root "$fa" --s-q "$s_q" \
    --json "$out/flashmla.json" >"$out/flashmla.txt" 2>&1) &
  anchor_pid=$!
fi
baseline=
baseline_pid=
if [[ -n ${BASELINE_DIFF:-} ]]; then
  [[ -f $BASELINE_DIFF ]] || { echo "BASELINE_DIFF=$BASELINE_DIFF: no such file" >&2; exit 2; }
  diff_file=$(realpath "$BASELINE_DIFF")
  baseline=$(mktemp -d)
  cp -r . "$baseline/tree" && rm -rf "$baseline/tree/$build"
  (cd "$baseline/tree" && patch -R -p1 <"$diff_file" >/dev/null &&
    cmake -S . -B "$build" "${generator[@]}" -DQUANTMLA_CUDA=ON -DQUANTMLA_KERNELS_ONLY=ON \
      -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build "$build" -j "$(nproc)" --target bench_gpu_decode >"$out/build-baseline.txt" 2>&1) &
  baseline_pid=$!
fi
cmake --build "$build" -j "$(nproc)" 2>&1 | tail -3
if [[ -n $anchor_pid ]]; then
  wait $anchor_pid || { echo "FlashMLA anchor failed:"; tail -5 "$out/flashmla.txt"; }
  tail -3 "$out/flashmla.txt"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total \
  --format=csv | tee "$out/device.txt"

status=0
echo "== correctness"
"$build/tests/gpu/test_wgmma_operands" 2>&1 | tee "$out/test-wgmma-operands.txt" || status=1
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
grep -oE "(HMMA|HGMMA|LDSM|LDGSTS|UBLKCP)[.A-Z0-9_]*" "$out/sass.txt" | sort | uniq -c | tee "$out/sass-summary.txt"
rm -f "$out/sass.txt"
echo "== benchmark"
"$build/bench/gpu/bench_gpu_decode" --json "$out/gpu-decode.json" "$@" 2>&1 | tee "$out/bench.txt" ||
  status=1
if [[ -n $baseline_pid ]]; then
  if wait "$baseline_pid"; then
    echo "== benchmark of the baseline (the tree with $BASELINE_DIFF reversed)"
    "$baseline/tree/$build/bench/gpu/bench_gpu_decode" --json "$out/gpu-decode-baseline.json" "$@" \
      2>&1 | tee "$out/bench-baseline.txt" || status=1
  else
    echo "baseline build failed:"; tail -5 "$out/build-baseline.txt"; status=1
  fi
fi
if [[ -f $out/flashmla.json ]]; then
  python3 bench/gpu/merge_anchor.py --ours "$out/gpu-decode.json" --flashmla "$out/flashmla.json" \
    --out "$out/decode-v2-$(date -u +%F)-sq$s_q.json" | tee "$out/vs-flashmla.txt" || status=1
  if [[ -f $out/gpu-decode-baseline.json ]]; then
    python3 bench/gpu/merge_anchor.py --ours "$out/gpu-decode-baseline.json" \
      --flashmla "$out/flashmla.json" --out "$out/decode-v2-$(date -u +%F)-sq$s_q-baseline.json" \
      >"$out/vs-flashmla-baseline.txt" || status=1
  fi
fi
exit $status
