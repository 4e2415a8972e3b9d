#!/usr/bin/env bash
# The waiting measurements of bench/gpu/patches/README.md as numbered device calls, each under the
# device tool's 600 s: `bash bench/gpu/next-session.sh STEP` on the GPU machine, the results (and
# every log) packed into $OUT/results-STEP.tgz. Steps, with what to carry (.carry/deps.tar.xz and
# .carry/deps-server.tar.xz for 1 and 2, .anchor for 3 and 4):
#   1  workload P as bench/serve_projection.py projected it: 512 x 256/1024 in 637 MB (1/32 of the
#      BF16 peak), warm (the shape warm-up), BF16 and INT2/INT4 (~250 s of serving after the build)
#   2  the same workload, FP8/BF16 and INT4/INT4 (~200 s): INT4 against FP8 in one process, and
#      against BF16 across the two calls
#   3  subnormal-scores.diff beside main and FlashMLA at 16 heads, INT4 and INT2 (~310 s: the
#      full test_gpu_mla with the reference's new allowance, memcheck, the grid)
#   4  int4-fragments-long-context.diff beside main and FlashMLA at 16 heads, INT4 (~300 s; the
#      batch-16 rows at 32K and 128K change kernel). If kept, the CUDA runner's tests next
#      (`bash bench/gpu/run-runner.sh build,ops,runner`), its graphs keying on the new choice
# Here first: `mv data /tmp/data-aside` (data/ would travel; put it back after), `bash
# scripts/device-carry.sh` where .carry/ lacks the dependencies; then run with the carries
# above. The 2026-12-05 run of the same workload at the 1/8 budget (2.55 GB) is in
# docs/benchmarks.md (twenty-first session): there INT4 and INT2 met --max-seqs 256. A kernel
# patch is measured with BASELINE_DIFF=PATCH bash bench/gpu/run.sh on the tree with it applied.
set -uo pipefail
cd "$(dirname "$0")/../.."
step=${1:-}
[[ $step =~ ^[1234]$ ]] ||
  { echo "usage: bash bench/gpu/next-session.sh 1|2|3|4 (bench/gpu/patches/README.md)" >&2; exit 2; }
# What each step needs carried, checked before any device time goes into building.
needs=(.carry/deps.tar.xz .carry/deps-server.tar.xz)
((step >= 3)) && needs=(.anchor/bench_flashmla.py)
for need in "${needs[@]}"; do
  [[ -e $need ]] || { echo "next-session.sh $step: $need was not carried (see the header)" >&2; exit 2; }
done
final_out=${OUT:-gpu-results}
mkdir -p "$final_out/r" && final_out=$(realpath "$final_out")
export OUT=$final_out/r
status=0
# Every command gets what is left of 560 s, so that the results are packed before the device
# tool's 600 s end the call.
deadline=$((SECONDS + 560))
within() { timeout $((deadline - SECONDS > 1 ? deadline - SECONDS : 1)) "$@"; }
patches=bench/gpu/patches
case $step in
  1 | 2)
    formats="bf16 content=int2:g64,rope=int4:g64"
    ((step == 2)) && formats="content=fp8,rope=bf16 content=int4:g64,rope=int4:g64"
    FORMATS=$formats P_DIVISOR=32 SKIP_U=1 TAG=decode-heavy-512-637mb-$step \
      within bash bench/gpu/run-serve.sh 512 256 1024 >"$OUT/serve.txt" 2>&1 || status=1
    ;;
  3 | 4)
    patch=$patches/subnormal-scores.diff formats=int4g64/int4,int2g64/int4
    ((step == 4)) && patch=$patches/int4-fragments-long-context.diff formats=int4g64/int4
    git apply $patch >"$OUT/run.txt" 2>&1 || status=1
    ((status)) || BASELINE_DIFF=$patch within bash bench/gpu/run.sh --heads 16 \
      --formats $formats >>"$OUT/run.txt" 2>&1 || status=1
    git apply -R $patch
    ;;
esac
tail -n 25 "$OUT"/*.txt
tar czf "$final_out/results-$step.tgz" -C "$final_out" r && rm -rf "$final_out/r"
exit $status
