#!/usr/bin/env bash
# The waiting measurements of bench/gpu/patches/README.md as numbered device calls, each under the
# device tool's 600 s: `bash bench/gpu/next-session.sh STEP` on the GPU machine, the results (and
# every log) packed into $OUT/results-STEP.tgz. Steps, in the README's order, with what to carry:
#   1  the shared experts in the routed products: ab-runner A/B on decode steps of 64-256
#      tokens and the runner test (.carry/deps.tar.xz, .carry/shared made by `RUNNER_ONLY=1 bash
#      scripts/device-carry.sh`, data/ moved out: the whole slice no longer fits beside the tree)
#   2  the pipelined fragment kernel against its base beside FlashMLA, 16 heads (.anchor,
#      .carry/fragments-pipelined-pages.diff: cp bench/gpu/patches/fragments-pipelined-pages.diff
#      .carry/)
#   3  the decode-heavy workload at 512 requests, warm (the shape warm-up) (.carry/deps.tar.xz,
#      .carry/deps-server.tar.xz)
#   4  the seesaw schedule under Nsight Compute (B 64, 32K, 128 heads: stall reasons and their
#      source lines), the quick GPU test first and the 16-head BF16 grid on the seesaw beside the
#      tiled kernel after it (nothing carried; ~220 s)
#   5  int and FP8 content on the seesaw schedule against today's kernels beside FlashMLA, 128
#      heads (.anchor, .carry/seesaw-converted.diff: cp bench/gpu/patches/seesaw-converted.diff
#      .carry/; ~360 s)
# Here first: `mv data /tmp/data-aside` (data/ would travel; put it back after), `bash
# scripts/device-carry.sh` where .carry/ lacks the dependencies or .carry/shared, `mkdir -p .anchor
# && cp ../shared/anchors/flashmla/* .anchor/` for step 2; then run with the carries above.
set -uo pipefail
cd "$(dirname "$0")/../.."
step=${1:-}
[[ $step =~ ^[1-5]$ ]] ||
  { echo "usage: bash bench/gpu/next-session.sh 1|2|3|4|5 (bench/gpu/patches/README.md)" >&2; exit 2; }
# What each step needs carried, checked before any device time goes into building.
needs=()
case $step in
  1) needs=(.carry/deps.tar.xz .carry/shared) ;;
  2) needs=(.anchor/bench_flashmla.py .carry/fragments-pipelined-pages.diff) ;;
  3) needs=(.carry/deps.tar.xz .carry/deps-server.tar.xz) ;;
  5) needs=(.anchor/bench_flashmla.py .carry/seesaw-converted.diff) ;;
esac
for need in "${needs[@]}"; do
  [[ -e $need ]] || { echo "next-session.sh $step: $need was not carried (see the header)" >&2; exit 2; }
done
final_out=${OUT:-gpu-results}
mkdir -p "$final_out/r" && final_out=$(realpath "$final_out")
export OUT=$final_out/r
patches=bench/gpu/patches
status=0
# Every command gets what is left of 560 s, so that the results are packed before the device
# tool's 600 s end the call.
deadline=$((SECONDS + 560))
within() { timeout $((deadline - SECONDS > 1 ? deadline - SECONDS : 1)) "$@"; }
# A patch applied for a step is taken out again (the tree is the next call's too on a warm machine).
revert() { git checkout -q -- . && git clean -fdq src tests; }
case $step in
  1)
    RUNNER_TEST=1 GEMMS=none SHAPE="decode:64 decode:128 decode:256" ROUNDS=2 \
      within bash bench/gpu/ab-runner.sh $patches/shared-experts-grouped.diff >"$OUT/ab.txt" 2>&1 ||
      status=1
    ;;
  2)
    {
      git apply $patches/fragments-pipelined-pages.diff &&
        BASELINE_DIFF=.carry/fragments-pipelined-pages.diff within bash bench/gpu/run.sh \
          --heads 16 --formats int4g64/int4@fragments,int2g64/int4@fragments,fp8/bf16@fragments
    } >"$OUT/run.txt" 2>&1 || status=1
    revert
    ;;
  3)
    SKIP_U=1 TAG=decode-heavy-512 within bash bench/gpu/run-serve.sh 512 256 1024 \
      >"$OUT/serve.txt" 2>&1 || status=1
    ;;
  4)
    {
      cmake -S . -B build-gpu -G Ninja -DQUANTMLA_CUDA=ON -DQUANTMLA_KERNELS_ONLY=ON \
        -DCMAKE_BUILD_TYPE=Release >/dev/null &&
        within cmake --build build-gpu -j "$(nproc)" --target test_gpu_mla bench_gpu_decode |
        tail -1
    } >"$OUT/build.txt" 2>&1 || status=1
    within build-gpu/tests/gpu/test_gpu_mla --quick >"$OUT/test-quick.txt" 2>&1 || status=1
    within build-gpu/bench/gpu/bench_gpu_decode --heads 16 --formats bf16/bf16,bf16/bf16@warpgroup \
      --json "$OUT/seesaw-h16.json" >"$OUT/seesaw-h16.txt" 2>&1 || status=1
    within ncu --clock-control none --kernel-name regex:mla_decode_seesaw --launch-skip 1 \
      --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis --section SourceCounters \
      build-gpu/bench/gpu/bench_gpu_decode --only "bf16/bf16,64,32768,128" \
      >"$OUT/ncu-seesaw.txt" 2>&1 || status=1
    ;;
  5)
    {
      git apply $patches/seesaw-converted.diff &&
        BASELINE_DIFF=.carry/seesaw-converted.diff within bash bench/gpu/run.sh --heads 128 \
          --formats int4g64/int4,int2g64/int4,fp8/bf16
    } >"$OUT/run.txt" 2>&1 || status=1
    revert
    ;;
esac
tail -n 25 "$OUT"/*.txt
tar czf "$final_out/results-$step.tgz" -C "$final_out" r && rm -rf "$final_out/r"
exit $status
