#!/usr/bin/env bash
# The waiting measurements of bench/gpu/patches/README.md as numbered device calls, each under the
# device tool's 600 s: `bash bench/gpu/next-session.sh STEP` on the GPU machine, the results (and
# every log) packed into $OUT/results-STEP.tgz. Steps, in the README's order, with what to carry:
#   1  the shared experts in the routed products: ab-runner A/B on decode steps of 64-256
#      tokens and the runner test (.carry/deps.tar.xz, .carry/shared made by `RUNNER_ONLY=1 bash
#      scripts/device-carry.sh`, data/ moved out: the whole slice no longer fits beside the tree)
#   3  the decode-heavy workload at 512 requests, warm (the shape warm-up) (.carry/deps.tar.xz,
#      .carry/deps-server.tar.xz)
#   4  the rescale skip for int content (rescale-skip-int.diff) beside main and FlashMLA at 16
#      heads, BF16 included (main's transposed kernel) (.anchor)
# Here first: `mv data /tmp/data-aside` (data/ would travel; put it back after), `bash
# scripts/device-carry.sh` where .carry/ lacks the dependencies or .carry/shared; then run with the
# carries above. Steps 2, 4, 5 and 6 (kernel patches) ran on 2026-12-05 (docs/benchmarks.md,
# twentieth session); a kernel patch is measured with BASELINE_DIFF=PATCH bash bench/gpu/run.sh
# on the tree with it applied, as they were.
set -uo pipefail
cd "$(dirname "$0")/../.."
step=${1:-}
[[ $step =~ ^[134]$ ]] ||
  { echo "usage: bash bench/gpu/next-session.sh 1|3|4 (bench/gpu/patches/README.md)" >&2; exit 2; }
# What each step needs carried, checked before any device time goes into building.
needs=()
case $step in
  1) needs=(.carry/deps.tar.xz .carry/shared) ;;
  3) needs=(.carry/deps.tar.xz .carry/deps-server.tar.xz) ;;
  4) needs=(.anchor/bench_flashmla.py) ;;
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
case $step in
  1)
    RUNNER_TEST=1 GEMMS=none SHAPE="decode:64 decode:128 decode:256" ROUNDS=2 \
      within bash bench/gpu/ab-runner.sh $patches/shared-experts-grouped.diff >"$OUT/ab.txt" 2>&1 ||
      status=1
    ;;
  3)
    SKIP_U=1 TAG=decode-heavy-512 within bash bench/gpu/run-serve.sh 512 256 1024 \
      >"$OUT/serve.txt" 2>&1 || status=1
    ;;
  4)
    git apply $patches/rescale-skip-int.diff >"$OUT/run.txt" 2>&1 || status=1
    ((status)) || BASELINE_DIFF=$patches/rescale-skip-int.diff within bash bench/gpu/run.sh \
      --heads 16 --formats bf16/bf16,int4g64/int4,int2g64/int4 >>"$OUT/run.txt" 2>&1 || status=1
    git apply -R $patches/rescale-skip-int.diff
    ;;
esac
tail -n 25 "$OUT"/*.txt
tar czf "$final_out/results-$step.tgz" -C "$final_out" r && rm -rf "$final_out/r"
exit $status
