#!/usr/bin/env bash
# The waiting device measurements as numbered device calls, each under the device tool's 600 s:
# `bash bench/gpu/next-session.sh STEP` on the GPU machine, the results (and every log) packed
# into $OUT/results-STEP.tgz. Steps, with what to carry:
#   1  workload P lengthened (768 x 256/1024 in 637 MB, 1/48 of its BF16 peak, --swap-space 16),
#      FP8/BF16 alone (~250 s; a cold machine's build and model ~450 s; carry .carry/deps.tar.xz
#      and .carry/deps-server.tar.xz): issue 14's INT4 >= 1.7x FP8 on the job whose INT4 and INT2
#      ran on 2026-12-06 (H100: INT4 6,426, INT2 9,772, BF16 2,144 output tok/s)
#   2  the same job, INT4/INT4 and INT2/INT4 (~230 s; cold ~430 s; the same carry): on an H200
#      (the issue's card) or to repeat the H100's
#   3  the same job, BF16 alone (~380 s: on a machine that ran step 1 or 2, whose build and model
#      it reuses; the same carry)
#   4  the decode kernels at a serving step's mixed contexts (~300 s; carry nothing): the
#      --short-contexts grid at 16 heads with every sequence's length uniform in
#      [0.33, 1.67] x ctx (bench_gpu_decode --range-ratio 0.67, workload P's 256-1,280 tokens)
#      beside the same grid at one length; the plan's split against forced runs of 4-32 pages at
#      INT4's serving batch (87 sequences around 768 tokens); Nsight Compute's stall reasons for
#      INT4 at 128 x 512 (DETAILS=1 profile.sh): where the fixed cost of a short sequence's work
#      goes (~54 us a layer against ~7 us of bytes)
#   5  the kernel grid on main beside FlashMLA (run.sh, ~450 s; carry .anchor): issue 15's figures
#      with subnormal scores merged, on whichever card comes
# Order, where the device time is short: 1 (then 3 on the same machine if 2 ran there too), 4, 5.
# Here first: `mv data /tmp/data-aside` (data/ would travel; put it back after), `bash
# scripts/device-carry.sh` where .carry/ lacks what a step needs; then run with the carries above.
set -uo pipefail
cd "$(dirname "$0")/../.."
step=${1:-}
[[ $step =~ ^[1-5]$ ]] ||
  { echo "usage: bash bench/gpu/next-session.sh 1-5 (see the header)" >&2; exit 2; }
# What each step needs carried, checked before any device time goes into building.
needs=()
((step <= 3)) && needs=(.carry/deps.tar.xz .carry/deps-server.tar.xz)
((step == 5)) && needs=(.anchor/bench_flashmla.py)
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
case $step in
  1 | 2 | 3)
    formats=(fp8 "content=fp8,rope=bf16")
    ((step == 2)) && formats=(int4-int2 "content=int4:g64,rope=int4:g64 content=int2:g64,rope=int4:g64")
    ((step == 3)) && formats=(bf16 bf16)
    FORMATS=${formats[1]} P_DIVISOR=48 SKIP_U=1 SERVE_ARGS="--swap-space 16" \
      TAG=decode-heavy-768-637mb-swap-${formats[0]} within bash bench/gpu/run-serve.sh 768 256 1024 \
      >"$OUT/serve.txt" 2>&1 || status=1
    ;;
  4)
    # run.sh's kernels-only build, of the benchmark alone.
    bash bench/gpu/touch-changed-sources.sh build-gpu
    { cmake -S . -B build-gpu -G Ninja -DQUANTMLA_CUDA=ON -DQUANTMLA_KERNELS_ONLY=ON \
      -DCMAKE_BUILD_TYPE=Release >"$OUT/configure.txt" 2>&1 &&
      within cmake --build build-gpu -j "$(nproc)" --target bench_gpu_decode >"$OUT/build.txt" 2>&1 &&
      bash bench/gpu/touch-changed-sources.sh build-gpu --record; } || status=1
    decode=build-gpu/bench/gpu/bench_gpu_decode
    grid=bf16/bf16,fp8/bf16,int4g64/int4,int2g64/int4
    if ((status == 0)); then
      within $decode --short-contexts --heads 16 --formats $grid --range-ratio 0.67 \
        --json "$OUT/decode-mixed.json" >"$OUT/decode-mixed.txt" 2>&1 || status=1
      within $decode --short-contexts --heads 16 --formats $grid \
        --json "$OUT/decode-uniform.json" >"$OUT/decode-uniform.txt" 2>&1 || status=1
      for split in 0 4 8 16 32; do
        within $decode --only int4g64/int4,87,768,16 --range-ratio 0.67 --pages-per-split $split |
          grep "B=87" | sed "s/^/runs of $split pages (0: the plan's): /"
      done >"$OUT/decode-splits.txt" 2>&1 || status=1
      DETAILS=1 within bash bench/gpu/profile.sh "int4g64/int4,128,512,16" >"$OUT/profile.txt" 2>&1 ||
        status=1
    fi
    ;;
  5) within bash bench/gpu/run.sh >"$OUT/grid.txt" 2>&1 || status=1 ;;
esac
tail -n 25 "$OUT"/*.txt
tar czf "$final_out/results-$step.tgz" -C "$final_out" r && rm -rf "$final_out/r"
exit $status
