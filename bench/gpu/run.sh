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
# change is measured against its base in the same call. Several files, separated by spaces: one
# baseline each (the second's files end in -baseline2, and so on), e.g. main and a variant.
# LEAN=1: the quick correctness cases only (no full test, memcheck or SASS count): a first timing
# of a change in a call with little device time left; the full run still decides a merge.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# Seconds since the start at the end of each phase, into phases.txt: where a device call's time
# goes, so that the next session's calls can be planned (the device tool gives each 600 s).
phase() { echo "$1 $SECONDS" >>"$out/phases.txt"; }
rm -f "$out/phases.txt"
build=build-gpu
bash bench/gpu/touch-changed-sources.sh "$build"
bash bench/gpu/configure-kernels.sh "$build" >"$out/configure.txt"
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
baseline_diffs=(${BASELINE_DIFF:-})
baselines=()     # each baseline's tree
baseline_pids=() # and its build
# The files of baseline n (0, 1, ...): *-baseline, *-baseline2, ...
baseline_name() { if (($1 > 0)); then echo "baseline$(($1 + 1))"; else echo baseline; fi; }
for n in "${!baseline_diffs[@]}"; do
  suffix=$(baseline_name "$n")
  dir=$(mktemp -d)
  bash bench/gpu/patched-tree.sh -R "${baseline_diffs[$n]}" "$dir/tree"
  (cd "$dir/tree" && bash bench/gpu/configure-kernels.sh "$build" >/dev/null &&
    cmake --build "$build" -j "$(nproc)" --target bench_gpu_decode >"$out/build-$suffix.txt" 2>&1) &
  baselines+=("$dir") && baseline_pids+=($!)
done
cmake --build "$build" -j "$(nproc)" 2>&1 | tail -3 &&
  bash bench/gpu/touch-changed-sources.sh "$build" --record
phase build
if [[ -n $anchor_pid ]]; then
  wait $anchor_pid || { echo "FlashMLA anchor failed:"; tail -5 "$out/flashmla.txt"; }
  tail -3 "$out/flashmla.txt"
  phase flashmla
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total \
  --format=csv | tee "$out/device.txt"

status=0
echo "== correctness"
# The quick cases first, with a time limit: a kernel that hangs (a wait nobody signals) ends the
# call here instead of at the device tool's limit.
timeout 120 "$build/tests/gpu/test_gpu_mla" --quick >"$out/test-quick.txt" 2>&1 || {
  rc=$?
  ((rc == 124)) && echo "test_gpu_mla --quick did not finish in 120 s: a kernel hangs" |
    tee -a "$out/test-quick.txt"
  tail -5 "$out/test-quick.txt"
  exit 1
}
"$build/tests/gpu/test_wgmma_operands" 2>&1 | tee "$out/test-wgmma-operands.txt" || status=1
"$build/tests/gpu/test_transposed_operands" 2>&1 | tee "$out/test-transposed-operands.txt" ||
  status=1
[[ -n ${LEAN:-} ]] || "$build/tests/gpu/test_gpu_mla" 2>&1 | tee "$out/test.txt" || status=1
phase tests
echo "== compute-sanitizer memcheck (quick cases)"
if [[ -n ${LEAN:-} ]]; then
  echo "LEAN: skipped"
elif command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --error-exitcode 3 "$build/tests/gpu/test_gpu_mla" --quick \
    >"$out/memcheck.txt" 2>&1 || status=1
  tail -3 "$out/memcheck.txt"
else
  echo "compute-sanitizer not found" | tee "$out/memcheck.txt"
fi
phase memcheck
if [[ -z ${LEAN:-} ]]; then
  echo "== tensor-core instructions in the SASS of the decode kernels"
  cuobjdump --dump-sass "$build/src/kernels/cuda/libquantmla_cuda.a" >"$out/sass.txt" 2>&1 || true
  grep -oE "(HMMA|HGMMA|LDSM|LDGSTS|UBLKCP)[.A-Z0-9_]*" "$out/sass.txt" | sort | uniq -c |
    tee "$out/sass-summary.txt"
  rm -f "$out/sass.txt"
fi
echo "== benchmark"
phase sass
"$build/bench/gpu/bench_gpu_decode" --json "$out/gpu-decode.json" "$@" 2>&1 | tee "$out/bench.txt" ||
  status=1
# The shapes where a kernel forced beside the plan's choice was the faster (decode.cu's
# select_decode_kernel may choose better there).
[[ -f $out/gpu-decode.json ]] &&
  python3 bench/gpu/dispatch_scan.py "$out/gpu-decode.json" | tee "$out/dispatch-scan.txt"
phase benchmark
for n in "${!baselines[@]}"; do
  suffix=$(baseline_name "$n")
  if wait "${baseline_pids[$n]}"; then
    echo "== benchmark of $suffix (the tree with ${baseline_diffs[$n]} reversed)"
    "${baselines[$n]}/tree/$build/bench/gpu/bench_gpu_decode" --json "$out/gpu-decode-$suffix.json" \
      "$@" 2>&1 | tee "$out/bench-$suffix.txt" || status=1
  else
    echo "$suffix build failed:"; tail -5 "$out/build-$suffix.txt"; status=1
  fi
done
phase baselines
if [[ -f $out/flashmla.json ]]; then
  python3 bench/gpu/merge_anchor.py --ours "$out/gpu-decode.json" --flashmla "$out/flashmla.json" \
    --out "$out/decode-v2-$(date -u +%F)-sq$s_q.json" | tee "$out/vs-flashmla.txt" || status=1
  for suffixed in "$out"/gpu-decode-baseline*.json; do
    [[ -f $suffixed ]] || continue
    suffix=$(basename "$suffixed" .json) && suffix=${suffix#gpu-decode-}
    python3 bench/gpu/merge_anchor.py --ours "$suffixed" --flashmla "$out/flashmla.json" \
      --out "$out/decode-v2-$(date -u +%F)-sq$s_q-$suffix.json" >"$out/vs-flashmla-$suffix.txt" ||
      status=1
  done
fi
exit $status
