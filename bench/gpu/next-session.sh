#!/usr/bin/env bash
# The waiting measurements of bench/gpu/patches/README.md as numbered device calls, each under the
# device tool's 600 s: `bash bench/gpu/next-session.sh STEP` on the GPU machine, the results (and
# every log) packed into $OUT/results-STEP.tgz. Steps, in the README's order, with what to carry:
#   1  the shared experts in the routed products: ab-runner A/B on decode steps of 64-256
#      tokens and the runner test (.carry/deps.tar.xz, .carry/shared made by `RUNNER_ONLY=1 bash
#      scripts/device-carry.sh`, data/ moved out: the whole slice no longer fits beside the tree)
#   2  the seesaw schedule with a third warpgroup that copies and converts (int and FP8 content)
#      against today's kernels and against its variant whose multiplying warpgroups issue the
#      copies (the stacked diff reversed), beside FlashMLA, 128 heads (.anchor,
#      .carry/seesaw-converting-warpgroup.diff, .carry/converting-warpgroup-copies.diff: cp
#      bench/gpu/patches/seesaw-converting-warpgroup.diff bench/gpu/patches/stacked/*.diff .carry/;
#      ~420 s)
#   3  the decode-heavy workload at 512 requests, warm (the shape warm-up) (.carry/deps.tar.xz,
#      .carry/deps-server.tar.xz)
#   4  the fragment kernel's scores on wgmma against today's fragment kernel, beside FlashMLA, 16
#      heads (.anchor; ~420 s)
#   5  the transposed kernel for a BF16 cache against the tiled one (the same build), beside
#      FlashMLA, 16 heads, then main's fragment kernel's stall reasons under Nsight Compute (INT4
#      and INT2 at batch 64, 32K) where time is left (.anchor; ~350 s + ~90 s)
#   6  the decode kernels skipping the accumulators' rescale where no row's maximum rose, against
#      main, beside FlashMLA, 16 heads (.anchor; ~420 s)
# Here first: `mv data /tmp/data-aside` (data/ would travel; put it back after), `bash
# scripts/device-carry.sh` where .carry/ lacks the dependencies or .carry/shared, `mkdir -p .anchor
# && cp ../shared/anchors/flashmla/* .anchor/` for steps 2, 4, 5, 6; then run with the carries
# above.
# Each step is a call of its own: a patched step takes its patch out again and deletes its build
# (the device's copy of the tree is no git checkout, and the next call's copy of the tree keeps its
# files' old times, so a build left behind would hold objects of the patched sources).
set -uo pipefail
cd "$(dirname "$0")/../.."
step=${1:-}
[[ $step =~ ^[1-6]$ ]] ||
  { echo "usage: bash bench/gpu/next-session.sh 1-6 (bench/gpu/patches/README.md)" >&2; exit 2; }
# What each step needs carried, checked before any device time goes into building.
needs=()
case $step in
  1) needs=(.carry/deps.tar.xz .carry/shared) ;;
  2) needs=(.anchor/bench_flashmla.py .carry/seesaw-converting-warpgroup.diff
       .carry/converting-warpgroup-copies.diff) ;;
  3) needs=(.carry/deps.tar.xz .carry/deps-server.tar.xz) ;;
  4 | 5 | 6) needs=(.anchor/bench_flashmla.py) ;;
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
# A patch applied for a step is taken out again, and the build of the patched sources deleted (the
# header says why).
revert() { git apply -R "$1" && rm -rf build-gpu; }
# run.sh with ARGS on the tree with PATCH applied (BASELINE_DIFF, when set, passed on), its log in
# run.txt; then AFTER_RUN (a command, when set) on that build; the patch then taken out again.
patched_run() {
  local patch=$patches/$1
  shift
  git apply "$patch" >"$OUT/run.txt" 2>&1 || { status=1; return; }
  within bash bench/gpu/run.sh "$@" >>"$OUT/run.txt" 2>&1 || status=1
  if [[ -n ${AFTER_RUN:-} ]]; then $AFTER_RUN >"$OUT/after-run.txt" 2>&1 || status=1; fi
  revert "$patch"
}
# Main's fragment kernel (unchanged by step 5's patch) under Nsight Compute where the call has
# the time left: each stall reason's share at batch 64, 32K (INT4 and INT2), and INT4's samples
# per SASS instruction (the CSV of profile_sass.sh) for the instruction census's source lines.
profile_fragments() {
  ((deadline - SECONDS > 100)) || { echo "profile_fragments: no time left"; return 0; }
  DETAILS=1 within bash bench/gpu/profile.sh "int4g64/int4@fragments,64,32768,16" \
    "int2g64/int4@fragments,64,32768,16"
  ((deadline - SECONDS > 60)) || { echo "profile_fragments: no time left for the SASS"; return 0; }
  within bash bench/gpu/profile_sass.sh "int4g64/int4@fragments,64,32768,16"
}
case $step in
  1)
    RUNNER_TEST=1 GEMMS=none SHAPE="decode:64 decode:128 decode:256" ROUNDS=2 \
      within bash bench/gpu/ab-runner.sh $patches/shared-experts-grouped.diff >"$OUT/ab.txt" 2>&1 ||
      status=1
    ;;
  2)
    BASELINE_DIFF=".carry/seesaw-converting-warpgroup.diff .carry/converting-warpgroup-copies.diff" \
      patched_run seesaw-converting-warpgroup.diff --heads 128 \
      --formats int4g64/int4,int2g64/int4,fp8/bf16
    ;;
  3)
    SKIP_U=1 TAG=decode-heavy-512 within bash bench/gpu/run-serve.sh 512 256 1024 \
      >"$OUT/serve.txt" 2>&1 || status=1
    ;;
  4)
    BASELINE_DIFF=$patches/fragments-wgmma-scores.diff patched_run fragments-wgmma-scores.diff \
      --heads 16 --formats int4g64/int4,int4g64/int4@fragments,int2g64/int4,fp8/bf16
    ;;
  5)
    AFTER_RUN=profile_fragments patched_run transposed-bf16.diff --heads 16 \
      --formats bf16/bf16,bf16/bf16@transposed
    ;;
  6)
    BASELINE_DIFF=$patches/rescale-skip.diff patched_run rescale-skip.diff --heads 16 \
      --formats bf16/bf16,int4g64/int4,int2g64/int4,fp8/bf16
    ;;
esac
tail -n 25 "$OUT"/*.txt
tar czf "$final_out/results-$step.tgz" -C "$final_out" r && rm -rf "$final_out/r"
exit $status
