#!/usr/bin/env bash
# The waiting measurements of bench/gpu/patches/README.md as numbered device calls, each under the
# device tool's 600 s: `bash bench/gpu/next-session.sh STEP` on the GPU machine, the results (and
# every log) packed into $OUT/results-STEP.tgz. Steps, with what to carry:
#   1  short-context-one-block.diff's kernel gate and timing: run.sh on the patched tree (the GPU
#      kernel test, memcheck, SASS count) and bench_gpu_decode --short-contexts beside the tree
#      without it (BASELINE_DIFF), 16 heads, INT4 / FP8 / INT2 / BF16 (~350 s; carry nothing)
#   2  the same patch in the runner: its tests against the fixtures and the CPU runner, and the
#      decode step at workload P's mean batches (INT4 at 81 sequences, 1K; 128 at 512 tokens),
#      alternating with main (ab-runner.sh, ~400 s; carry .carry/deps.tar.xz and .carry/shared
#      from scripts/device-carry.sh RUNNER_ONLY=1)
#   3  the whole model's accuracy through the decode kernel, patched then main: run-runner.sh's
#      ppl stage (the CPU's whole windows against the CUDA runner fed one token a step, 64 windows
#      side by side; the prefill rows on 20 windows), each tree in its own folder (~400 s; carry
#      .carry/deps.tar.xz and .carry/shared from `PPL_ONLY=1 bash scripts/device-carry.sh`)
#   4  workload P at 637 MB with preemption by swap (bench-serve --swap-space 16), BF16 and
#      INT4/INT4 (run-serve.sh, ~360 s; carry .carry/deps.tar.xz and .carry/deps-server.tar.xz):
#      against 2026-12-05's recomputing runs (H100: BF16 2,077, INT4 5,833 output tok/s)
#   5  the same for INT2/INT4 and FP8/BF16 (~240 s; the same carry): against 9,090 and 3,256
#   6  the kernel grid on main beside FlashMLA (run.sh, ~450 s; carry .anchor): issue 15's figures
#      with subnormal scores merged, on whichever card comes
#   7  workload P made longer, 768 x 256/1024 in the same 637 MB (1/48 of its BF16 peak), with
#      swap, BF16 alone (~400 s: on a machine that ran step 8, 4 or 5, whose build and model it
#      reuses; the same carry): the final drain, ~1,024 steps in every format, is then a smaller
#      share of the low-bit formats' jobs (serve_projection.py: INT4 3.05x, INT2 4.58x BF16)
#   8  the same for INT4/INT4 and INT2/INT4 (~230 s with a cold machine's build and model ~430 s;
#      the same carry), then bench_runner --swap: the time a swap's copies take a sequence, each
#      format, through the pinned staging buffer and from pageable memory (~40 s;
#      SKIP_SWAP_BENCH=1 leaves it out)
# Order, where the device time is short: 8 then 7 (issue 14's targets, and the first GPU run of
# preemption by swap), then 1 and 2 (the waiting patch's gates), then 3, 4 or 5, 6.
# Here first: `mv data /tmp/data-aside` (data/ would travel; put it back after), `bash
# scripts/device-carry.sh` where .carry/ lacks what a step needs; then run with the carries above.
set -uo pipefail
cd "$(dirname "$0")/../.."
step=${1:-}
[[ $step =~ ^[1-8]$ ]] ||
  { echo "usage: bash bench/gpu/next-session.sh 1-8 (bench/gpu/patches/README.md)" >&2; exit 2; }
patch=bench/gpu/patches/short-context-one-block.diff
# What each step needs carried, checked before any device time goes into building.
needs=()
((step == 2)) && needs=(.carry/deps.tar.xz .carry/shared/tools/make_gpu_fixtures.py)
((step == 3)) && needs=(.carry/deps.tar.xz .carry/shared/reference/wikitext2-test.ids.i32)
((step == 4 || step == 5 || step >= 7)) && needs=(.carry/deps.tar.xz .carry/deps-server.tar.xz)
((step == 6)) && needs=(.anchor/bench_flashmla.py)
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
  1)
    git apply $patch || status=1
    ((status)) || BASELINE_DIFF=$patch within bash bench/gpu/run.sh --short-contexts --heads 16 \
      --formats bf16/bf16,fp8/bf16,int4g64/int4,int2g64/int4 >"$OUT/grid.txt" 2>&1 || status=1
    git apply -R $patch
    ;;
  2)
    CACHE=content=int4:g64,rope=int4:g64 SHAPE="decode:81 decode:128:512" RUNNER_TEST=1 GEMMS=none \
      within bash bench/gpu/ab-runner.sh $patch >"$OUT/ab.txt" 2>&1 || status=1
    ;;
  3)
    mkdir -p "$OUT/patched" "$OUT/main"
    git apply $patch || status=1
    ((status)) || OUT=$OUT/patched PPL_WINDOWS=20 within bash bench/gpu/run-runner.sh build,ppl \
      >"$OUT/ppl-patched.txt" 2>&1 || status=1
    git apply -R $patch
    OUT=$OUT/main PPL_WINDOWS=20 within bash bench/gpu/run-runner.sh build,ppl >"$OUT/ppl-main.txt" \
      2>&1 || status=1
    ;;
  4 | 5)
    formats="bf16 content=int4:g64,rope=int4:g64"
    ((step == 5)) && formats="content=int2:g64,rope=int4:g64 content=fp8,rope=bf16"
    FORMATS=$formats P_DIVISOR=32 SKIP_U=1 SERVE_ARGS="--swap-space 16" \
      TAG=decode-heavy-512-637mb-swap-$step within bash bench/gpu/run-serve.sh 512 256 1024 \
      >"$OUT/serve.txt" 2>&1 || status=1
    ;;
  6) within bash bench/gpu/run.sh >"$OUT/grid.txt" 2>&1 || status=1 ;;
  7 | 8)
    formats=bf16
    ((step == 8)) && formats="content=int4:g64,rope=int4:g64 content=int2:g64,rope=int4:g64"
    FORMATS=$formats P_DIVISOR=48 SKIP_U=1 SERVE_ARGS="--swap-space 16" \
      TAG=decode-heavy-768-637mb-swap-$step within bash bench/gpu/run-serve.sh 768 256 1024 \
      >"$OUT/serve.txt" 2>&1 || status=1
    if ((step == 8)) && [[ -z ${SKIP_SWAP_BENCH:-} ]]; then
      { within bash bench/gpu/device-build.sh bench_runner &&
        within build-gpu-full/bench/gpu/bench_runner --model /tmp/v2-lite --swap --repeats 10 \
          --json "$OUT/swap.json"; } >"$OUT/swap.txt" 2>&1 || status=1
    fi
    ;;
esac
tail -n 25 "$OUT"/*.txt
tar czf "$final_out/results-$step.tgz" -C "$final_out" r && rm -rf "$final_out/r"
exit $status
