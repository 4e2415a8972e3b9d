#!/usr/bin/env bash
# The waiting device measurements as numbered device calls, each under the device tool's 600 s:
# `bash bench/gpu/next-session.sh STEP` on the GPU machine, the results (and every log) packed
# into $OUT/results-STEP.tgz. Steps, with what to carry:
#   1  workload P lengthened (768 x 256/1024 in 637 MB, 1/48 of its BF16 peak, --swap-space 16),
#      INT4/INT4 and INT2/INT4 (~230 s; a cold machine's build and model ~325 s; carry
#      .carry/deps.tar.xz and .carry/deps-server.tar.xz): on an H200, the issue's card (the H100s'
#      figures, output tok/s: INT4 6,331, INT2 9,563, BF16 2,107, FP8 3,366 on one machine, the
#      twenty-ninth session; INT4 6,299, INT2 9,532, BF16 2,088 on another, the twenty-eighth)
#   2  the same job, BF16 alone (~400 s on an H100: on the machine that ran step 1, whose build and
#      model it reuses; the same carry)
#   3  the same job, FP8/BF16 alone (~250 s; the same machine and carry)
#   4  where the fragment kernel's time goes at short and long contexts (~150 s; carry nothing):
#      bench_gpu_decode at 1 and 128 sequences of 64-1,024 tokens, with the plan's split and with
#      one run a sequence (the fixed cost of a launch and a block against the cost of a page), and
#      Nsight Compute's per-instruction samples (profile_sass.sh) of INT4 at 128 x 512 and 16 x
#      32K, to join here with `census-fragments.sh --as-built` by bench/gpu/stall_lines.py
#   5  the kernel grid on main beside FlashMLA (run.sh, ~450 s; carry .anchor): issue 15's figures
#      on whichever card comes, with the full GPU test and compute-sanitizer's memcheck; RUN_ARGS
#      (run.sh's flags, e.g. "--heads 128") and LEAN=1 (the quick cases only) for a shorter call
#   6  which kernels of a decode step grow with the batch, beside the decode kernel and the routed
#      experts (whose growth the ablation measured): Nsight Compute's per-kernel times
#      (profile-runner.sh) on the 3-layer V2-Lite at 1K, BF16 at 25, 81 and 139 sequences (workload
#      P's mean batches of BF16, INT4 and INT2), INT4 at 81 and INT2 at 139 (~300 s cold; carry
#      .carry/deps.tar.xz)
#   7  kernel changes against main's kernels in one call (~190 s for one, ~350 s for two; carry
#      .carry/patch.diff, `git diff` of the change, or .carry/patches/NAME.diff for several, with
#      the changes themselves not in the tree that travels): a copy of the tree with each diff
#      applied built beside it, each changed tree's quick GPU test within 60 s (a tree that fails
#      or hangs there left out of the timing), then the
#      fragment kernel's formats at 16 heads, each tree in turn, three rounds (AB_ROUNDS: fewer
#      where device time is short): the serving shapes
#      (--short-contexts) and the grid, and a table of each changed tree against main (ab.txt,
#      by bench/gpu/ab_table.py), last each changed tree's full GPU test (under 200 s, within
#      what is left of the call); AB_FORMATS (bench_gpu_decode's names, comma-separated) and
#      AB_ARGS (more of its flags, e.g. "--s-q 2") time other formats or shapes (a kernel the plan
#      does not take is a format of its own, e.g. int4g64/int4@transposed: bench_gpu_decode sets
#      QUANTMLA_DECODE_KERNEL for each run itself); two patches a
#      call at most (bench/gpu/patches/README.md says how; none waiting now)
#   8  the kernel grid at s_q = 2 beside FlashMLA (LEAN=1 run.sh --s-q 2: the quick correctness
#      cases only, ~160-200 s on a cold machine; carry .anchor): the issue's s_q = 2 rows
#   10 issue 13's batch-1 decode on main (its latest figure, 2026-12-04, predates the transposed
#      BF16 kernel that batch 1 now takes): the build with the CUDA runner, the random V2-Lite
#      made there, `bench_runner --only decode:1` on the BF16 and INT4/INT4 caches, two rounds
#      (~350 s cold; carry .carry/deps.tar.xz)
#   9  the 128-head BF16 kernel (the seesaw) and FlashMLA's under Nsight Compute at one shape,
#      PROFILE_SHAPE (bench_gpu_decode's --only, default bf16/bf16,64,32768,128): the same sections
#      with every detail for both, where issue 15's 0.9x at 128 heads is missed (~200 s; carry
#      .anchor)
#   11 where the page schedule's time goes at one shape (PROFILE_SHAPE, default
#      int4g64/int4@warpgroup,64,32768,128): its warps' stalls instruction by instruction
#      (profile_sass.sh's samples, to join here by bench/gpu/stall_lines.py with lines.txt, the
#      line table of the default shape's kernel built alone there), and beside it a copy of the
#      tree with bench/gpu/probes/page-schedule-phase-clocks.diff applied, whose block 0 stamps the
#      SM's clock at each phase of pages 100-104 for both multiplying warpgroups and the converting
#      ones (phase.txt; ~150 s cold; carry nothing; then here `python3
#      bench/gpu/page_schedule_model.py --phases phase.txt`: the measured durations in the slot
#      ring's timing model, beside the measured period, for main's order and the one before it)
#   12 whether the BF16 seesaw's long shapes at 128 heads lose to the clock (~90 s warm, ~150 s
#      cold; carry nothing, or .anchor to time FlashMLA's same shapes alone too, ~100 s more for
#      its build beside ours): the SM clock, power and throttle reasons sampled every 100 ms
#      (clocks.csv) through its rows of the grid (the grid's pool and order) and through the long
#      shapes alone, each its own process, in two orders (alone.txt; with .anchor each shape's
#      FlashMLA run follows ours); STEP12_SHAPES names other shapes (B,CTX pairs), STEP12_FORMAT
#      and STEP12_HEADS another format and head count (e.g. fp8/bf16 at 16 heads, whose H200
#      figures fall from 1.63-1.72x FlashMLA at 32K to 1.40-1.50x at 128K while the H100s' do not:
#      `STEP12_FORMAT=fp8/bf16 STEP12_HEADS=16 STEP12_SHAPES="128,32768 128,131072 64,131072"`)
#   13 where issue 13's batch-1 decode step goes on main, operation by operation (~110 s cold;
#      carry .carry/deps.tar.xz): ablate-runner.sh decode:1 on the 3-layer V2-Lite, BF16 and
#      INT4/INT4 caches (each operation's in-step cost: the step without it), then the decode
#      attention alone at 1 x 1K, 16 heads, with the plan's split and with runs of 1, 2, 4 and 16
#      pages (split.txt), and INT4/INT4's batch-1 step with the plan's kernel (tiled) against
#      the fragment kernel, three rounds (int4-kernel.txt)
#   14 the flush's dirty lines (~170 s cold on an H200; carry .anchor): the BF16 grid at 128
#      heads and the BF16 and INT4/INT4 ones at 16, ours and FlashMLA's, each with the anchor's
#      flush (a 256 MB memset, which leaves the L2 dirty) and with a clean one (the memset read
#      back: bench_gpu_decode --clean-flush, bench/gpu/flashmla_clean_flush.py), FlashMLA's
#      memset-flushed 128-head grid twice (first, beside our build, and after its clean one),
#      into flush-*.txt
#   15 one change to the runner or the kernels a decode step launches (.carry/patches/NAME.diff,
#      written as for step 7) against main at issue 13's batch 1 (ab-runner.sh, ~550-600 s cold,
#      so start it on a fresh machine with a full call; carry .carry/deps.tar.xz and
#      .carry/shared): both builds, the change's quick GPU test, `bench_runner --only decode:1` on
#      the BF16 and INT4/INT4 caches in turn, AB_ROUNDS rounds (default 3), then both builds'
#      runner test against the fixtures (its graph check compares programmatic dependent launches
#      with plain ones bit for bit), in ab-runner.txt and one file a step; with two patches
#      (three builds) a cold call runs out of time after the timing or sooner: the next call on
#      the warm machine with AB_REUSE=1 reuses the builds (ab-runner.sh) for more rounds and the
#      runner test
#   16 the follow-ups of main's decode plans on one build (~250 s cold; after step 5 on the same
#      machine its build is reused; carry nothing): the transposed kernel's converting form
#      against the fragment kernel (int g64) and the tiled one (int g128) at 1-128 sequences of
#      4K-128K, with dispatch_scan.py's reading (converting*.txt); the fifty-first session's
#      batch-1 BF16 rule at its edges, one sequence of 1K-20K tokens at 32, 64 and 128 heads on
#      each kernel, and one INT4 sequence at 128 heads on each (batch1-bf16.txt); then Nsight
#      Compute on the converting form at 15 x 128K (profile.txt, and profile_sass.sh's
#      per-instruction samples, to join here with `census-fragments.sh --transposed --as-built`
#      by bench/gpu/stall_lines.py)
# Waiting (2026-12-08, fifty-first session, which got no device: the fiftieth's list), in order:
# - 1, 2, 3 on one machine where an H200 comes (the issue's card: every run of this job so far
#   was on an H100; ~975 s, so start them with most of a session's budget left: the
#   forty-seventh got an H200 with only 670 s left);
# - 5 on whichever card comes (carry .anchor): the full GPU test and memcheck on main, first of
#   all: the fiftieth session merged the converting form's two warpgroups, register keys and int2
#   content after a quick test of 474 checks and a full test cut by its call's deadline after 125
#   comparisons (none failing); then 10 there (issue 13's batch 1 with them) and the runner test
#   (test_cuda_runner against the fixtures: carry .carry/shared, build it with
#   bench/gpu/device-build.sh); then 16 on the same machine: the converting form against the
#   fragment kernel where the plan keeps the latter (from 16 sequences; int2 g64 from one) and
#   against the tiled kernel that int g128 takes from 16 sequences (4.76 ms at 128 x 128K on the
#   H200, FlashMLA's speed: the converting form may be the faster there too), the batch-1 BF16
#   rule of the fifty-first session (the transposed kernel for one sequence up to 256 pages from
#   64 heads, chosen from 4K and 32K times only) at its edges, and at 32 heads, which that session
#   gave the transposed kernel by the grids at 16 and 128 heads, and a profile of the converting
#   form (its limit after the traffic it shed: where its 1,675 instructions a warp and page wait);
# - 7 for fp8-bf16-page-schedule.diff (FP8/BF16 on the 128-head page schedule), and 7 for
#   int4-rows32-warpgroup.diff (int4 at 32 query rows a sequence on the page schedule;
#   AB_FORMATS=int4g64/int4,int2g64/int4 AB_ARGS="--s-q 2": bench/gpu/patches/README.md);
# - 10 on the H200 (issue 13's batch 1 there);
# - 12 on an H200 for FP8 at 16 heads (~150 s cold, the command in its entry above: whether the
#   clock falls where FP8's time a page rises from 32K to 128K), and 8 on the H200.
# bench/gpu/patches/README.md has each patch's command and what decides its merge. The plan that
# fills all 132 SMs at 128 heads (the forty-fifth session's lever) was written and measured with
# step 7 and dropped (docs/benchmarks.md "Forty-sixth session"), so step 12's 66-against-64 check
# is moot.
# Steps 4 and 6 ran on an H100 in the
# twenty-seventh session, 5, 7, 1 and 2 (the patch applied) in the twenty-eighth, 5, 7, 1, 2 and 3
# in the twenty-ninth, 7 (four times) and 5 in the thirtieth, 7 (three times) in the thirty-first,
# 5, 1, 2 and 3 in the thirty-second, with 8's command by hand on the next machine, 7 (BF16 at s_q =
# 2) and 8's command without its packing in the thirty-third, 5, 9 and 7 (the 128-head kernels'
# operands) in the thirty-fourth, 7 twice (four patches) in the thirty-fifth, 7, 5 (LEAN, 128
# heads), 10 and 9 (INT4 at 128 heads) in the thirty-sixth, none in the thirty-seventh (every
# start refused; docs/benchmarks.md), 7 (the crossover), 11, 7 (two patches) and the memcheck's
# command by hand in the thirty-eighth, 7 twice (three patches, out of time; then the converting
# warpgroups), 5 (LEAN, 128 heads) and memcheck and synccheck by hand in the thirty-ninth, none in
# the fortieth (eleven starts failed), 11, 7 (four patches in three calls) and 5 on an H200 in the
# forty-first, none in the forty-second (93 s of device time), 5, 11, 10, 8, 1 and 2 on H100s
# in the forty-third, 12, 11 and 7 on one H100 in the forty-fourth (after seven failed starts),
# 12 twice (with .anchor) on one H100 in the forty-fifth (after six failed starts), 7 twice (two
# versions of one patch) on H100s in the forty-sixth (after six failed starts), 13 twice (each
# the fallback of a call whose first choice was 1 on an H200), 7 (`kv-evict-first.diff`) on
# H100s, then 14, 10 and 5 (LEAN, 128 heads) on one H200 in the forty-seventh, none in the
# forty-eighth (twelve starts failed, 90-180 s of device time each), 7 four times and 15 twice on
# H100s in the forty-ninth (after an hour without a lent machine; one start failed on each kind),
# 7 once on an H100 in the fiftieth (after eleven failed starts, with 674 s left), none in the
# fifty-first (four failed starts, then lending paused).
# Here first: `mv data /tmp/data-aside; mv docs/benchmarks /tmp/benchmarks-aside` (neither is
# needed there, and with them the tree and the carries pass the device tool's 64 MiB; put both
# back after, and commit nothing meanwhile), `bash scripts/device-carry.sh` where .carry/ lacks
# what a step needs; then run with the carries above. To wait for an H200 at ~30 s a look, ask
# for either card (`kind: nvidia-h200`) with `nvidia-smi --query-gpu=name --format=csv,noheader |
# grep -q H200 && bash bench/gpu/next-session.sh 1` and hand an H100 back at once (the
# twenty-ninth session got an H100 five times of five that way, the thirtieth six of six, the
# forty-seventh five of five; its one H200 came on the first call after a failed start, when the
# device tool asks for an H200 only, but its H100 work had left 670 s: keep ~1,000 s for 1-3; the
# forty-eighth's starts all failed, for either card, for an H100 named and after failed starts
# alike: after two or three failures, keep what is left for a step that fits it). The
# device tool refused the tree with only a diff carried in the thirty-fourth session (66.6 MB of
# tracked bytes; ~68.5 MB in disk blocks, which it seems to count, over 64 MiB = 67.1 MB): move
# docs/benchmarks aside for every step.
set -uo pipefail
cd "$(dirname "$0")/../.."
step=${1:-}
[[ $step =~ ^([1-9]|1[0-6])$ ]] ||
  { echo "usage: bash bench/gpu/next-session.sh 1-16 (see the header)" >&2; exit 2; }
# What each step needs carried, checked before any device time goes into building.
needs=()
((step <= 3)) && needs=(.carry/deps.tar.xz .carry/deps-server.tar.xz)
((step == 5 || step == 8 || step == 9 || step == 14)) && needs=(.anchor/bench_flashmla.py)
((step == 6 || step == 10 || step == 13)) && needs=(.carry/deps.tar.xz)
((step == 15)) && needs=(.carry/deps.tar.xz .carry/shared/tools/make_gpu_fixtures.py)
if ((step == 7 || step == 15)); then
  # The changes: .carry/patch.diff (the tree "changed") or .carry/patches/NAME.diff (trees NAME).
  diffs=(.carry/patches/*.diff)
  [[ -e ${diffs[0]} ]] || diffs=(.carry/patch.diff)
  needs+=("${diffs[@]}")
fi
for need in "${needs[@]}"; do
  [[ -e $need ]] || { echo "next-session.sh $step: $need was not carried (see the header)" >&2; exit 2; }
done
final_out=${OUT:-gpu-results}
# A warm machine can keep an earlier call's r/ (one cut off before packing): start it empty.
rm -rf "$final_out/r" && mkdir -p "$final_out/r" && final_out=$(realpath "$final_out")
export OUT=$final_out/r
status=0
# Every command gets what is left of DEADLINE_S (560 s), so that the results are packed before the
# device tool ends the call (at 600 s, or sooner where less device time is left: pass the call's
# timeout less ~40 s).
deadline=$((SECONDS + ${DEADLINE_S:-560}))
within() { timeout $((deadline - SECONDS > 1 ? deadline - SECONDS : 1)) "$@"; }
# The kernels-only build of TARGET... in build-gpu of the current directory, logs to LOG.
build_kernels() {
  local log=$1
  shift
  bash bench/gpu/configure-kernels.sh build-gpu >"$log" 2>&1 &&
    within cmake --build build-gpu -j 8 --target "$@" >>"$log" 2>&1
}
# This tree's bench_gpu_decode in build-gpu (a warm machine's earlier build reused only where the
# sources it was built from are these: touch-changed-sources.sh), log in build.txt.
build_main_decode() {
  bash bench/gpu/touch-changed-sources.sh build-gpu
  build_kernels "$OUT/build.txt" bench_gpu_decode &&
    bash bench/gpu/touch-changed-sources.sh build-gpu --record
}
# FlashMLA's anchor unpacked into ANCHOR_ROOT and its extension built in the background with JOBS
# compile jobs (beside our build), then timed at the shape that bench_flashmla.py's further
# arguments give, into LOG; its pid in anchor_pid.
start_flashmla_build() {
  local jobs=$1 log=$2
  shift 2
  ANCHOR_ROOT=$(mktemp -d) && export ANCHOR_ROOT
  tar -xJf .anchor/flashmla-anchor.tar.xz -C "$ANCHOR_ROOT"
  (MAX_JOBS=$jobs within python3 .anchor/bench_flashmla.py --root "$ANCHOR_ROOT" "$@" \
    >"$log" 2>&1) &
  anchor_pid=$!
}
# One shape (bench_gpu_decode's --only FORMAT,B,CTX,H) timed by the benchmark DECODE with runs of
# SPLIT pages (0: the plan's), its row prefixed with the split.
time_split() {
  local decode=$1 shape=$2 split=$3
  within $decode --only "$shape" --pages-per-split "$split" | grep "B=" |
    sed "s/^/runs of $split pages (0: the plan's): /"
}
case $step in
  1 | 2 | 3)
    formats=(int4-int2 "content=int4:g64,rope=int4:g64 content=int2:g64,rope=int4:g64")
    ((step == 2)) && formats=(bf16 bf16)
    ((step == 3)) && formats=(fp8 "content=fp8,rope=bf16")
    FORMATS=${formats[1]} P_DIVISOR=48 SKIP_U=1 SERVE_ARGS="--swap-space 16" \
      TAG=decode-heavy-768-637mb-swap-${formats[0]} within bash bench/gpu/run-serve.sh 768 256 1024 \
      >"$OUT/serve.txt" 2>&1 || status=1
    ;;
  4)
    build_main_decode || status=1
    decode=build-gpu/bench/gpu/bench_gpu_decode
    if ((status == 0)); then
      # Runs of 64 pages: one block a sequence at these contexts, and no combine.
      for format in int4g64/int4 bf16/bf16; do
        for batch in 1 128; do
          for ctx in 64 128 256 512 1024; do
            for split in 0 64; do
              time_split $decode $format,$batch,$ctx,16 $split || status=1
            done
          done
        done
      done >"$OUT/fixed-cost.txt" 2>&1
      for shape in int4g64/int4,128,512,16 int4g64/int4,16,32768,16; do
        within bash bench/gpu/profile_sass.sh $shape >>"$OUT/profile.txt" 2>&1 || status=1
      done
    fi
    ;;
  5) within bash bench/gpu/run.sh ${RUN_ARGS:-} >"$OUT/grid.txt" 2>&1 || status=1 ;;
  9)
    IFS=, read -r _ batch ctx heads <<<"${PROFILE_SHAPE:=bf16/bf16,64,32768,128}"
    # FlashMLA built (and timed at the shape) outside the profiler, beside our build.
    start_flashmla_build 8 "$OUT/flashmla.txt" --heads "$heads" --contexts "$ctx" --batches "$batch"
    bash bench/gpu/touch-changed-sources.sh build-gpu
    build_kernels "$OUT/build.txt" bench_gpu_decode || status=1
    wait $anchor_pid || status=1
    ((status == 0)) && { DETAILS=1 within bash bench/gpu/profile.sh "$PROFILE_SHAPE" \
      "flashmla,$batch,$ctx,$heads" >"$OUT/profile.txt" 2>&1 || status=1; }
    ;;
  11)
    shape=${PROFILE_SHAPE:-int4g64/int4@warpgroup,64,32768,128}
    probe=$(mktemp -d)/tree
    (bash bench/gpu/patched-tree.sh bench/gpu/probes/page-schedule-phase-clocks.diff "$probe" &&
      cd "$probe" && build_kernels "$OUT/build-probe.txt" bench_gpu_decode) &
    probe_pid=$!
    build_main_decode || status=1
    # The phase clocks first (seconds), then the samples (a minute or more): a call short of time
    # still brings back the clocks.
    if wait $probe_pid; then
      within "$probe/build-gpu/bench/gpu/bench_gpu_decode" --only "$shape" 2>&1 |
        grep -E "phase|B=" >"$OUT/phase.txt" || status=1
    else
      status=1
    fi
    ((status == 0)) &&
      { within bash bench/gpu/profile_sass.sh "$shape" >"$OUT/profile.txt" 2>&1 || status=1; }
    # The default shape's kernel alone, built by this machine's nvcc, and its line table for the
    # join (one built on the development machine differed in 61 of the 567 opcodes the join
    # checks in the forty-first session).
    if [[ $shape == int4g64/int4@warpgroup,* ]]; then
      unit=$(mktemp -d)/one.cu
      printf '%s\n' '#include "kernels/cuda/decode_launch.cuh"' 'namespace quantmla::gpu {' \
        'template void launch_decode_warpgroup<ContentInt<4, 64>, RopeInt4>(' \
        '    const DecodeKernelParams&, int, int, int, cudaStream_t);' '}' >"$unit"
      (source bench/gpu/library-nvcc-flags.sh &&
        within "$nvcc" -I"$PWD/include" -I"$PWD/src" "${library_nvcc_flags[@]}" -cubin \
          -o "${unit%.cu}.cubin" "$unit" &&
        python3 bench/gpu/sass_census.py lines "${unit%.cu}.cubin" >"$OUT/lines.txt") ||
        echo "next-session.sh: no line table of the kernel built here" >&2
    fi
    ;;
  8) LEAN=1 within bash bench/gpu/run.sh --s-q 2 >"$OUT/grid.txt" 2>&1 || status=1 ;;
  16)
    build_main_decode || status=1
    decode=build-gpu/bench/gpu/bench_gpu_decode
    if ((status == 0)); then
      converting=int4g64/int4,int4g64/int4@transposed,int2g64/int4,int2g64/int4@transposed
      converting+=,int4g128/int4,int4g128/int4@transposed,int2g128/int4,int2g128/int4@transposed
      within $decode --heads 16 --formats $converting --batches 1,16,64,128 --max-seconds 180 \
        --json "$OUT/converting.json" >"$OUT/converting.txt" 2>&1 || status=1
      python3 bench/gpu/dispatch_scan.py "$OUT/converting.json" >"$OUT/converting-scan.txt" 2>&1
      for heads in 32 64 128; do
        for ctx in 1024 8192 16384 20000; do
          for kernel in "" @transposed @warpgroup @tiled; do
            within $decode --only "bf16/bf16$kernel,1,$ctx,$heads" 2>&1 | grep "B=" |
              sed "s|^|bf16/bf16$kernel: |"
          done
        done
      done >"$OUT/batch1-bf16.txt" || status=1
      # INT4 at 128 heads, one short sequence: the plan's tiled kernel against the converting form
      # (BF16's transposed kernel took 0.70-0.78x the plan's time at 1 x 4K there).
      for ctx in 4096 16384; do
        for kernel in "" @transposed @warpgroup @fragments; do
          within $decode --only "int4g64/int4$kernel,1,$ctx,128" 2>&1 | grep "B=" |
            sed "s|^|int4g64/int4$kernel: |"
        done
      done >>"$OUT/batch1-bf16.txt" || status=1
      shape=int4g64/int4@transposed,15,131072,16
      DETAILS=1 within bash bench/gpu/profile.sh "$shape" >"$OUT/profile.txt" 2>&1 || status=1
      within bash bench/gpu/profile_sass.sh "$shape" >>"$OUT/profile.txt" 2>&1 || status=1
    fi
    ;;
  12)
    # STEP12_FORMAT and STEP12_HEADS: another format or head count (bench_gpu_decode's names),
    # e.g. fp8/bf16 at 16 heads, whose H200 figures fall from 32K to 128K.
    format=${STEP12_FORMAT:-bf16/bf16} heads=${STEP12_HEADS:-128}
    # FlashMLA's extension built beside ours where .anchor is carried (its first run builds it,
    # about 100 s; later runs load it), to time its same shapes alone as well.
    anchor_pid=
    if [[ -f .anchor/bench_flashmla.py ]]; then
      start_flashmla_build 6 "$OUT/flashmla-build.txt" --heads "$heads" --contexts 4096 --batches 1
    fi
    build_main_decode || status=1
    decode=build-gpu/bench/gpu/bench_gpu_decode
    if [[ -n $anchor_pid ]] && ! wait $anchor_pid; then
      echo "next-session.sh: FlashMLA's build failed; timing ours alone" >&2
      anchor_pid=
    fi
    if ((status == 0)); then
      query=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active
      nvidia-smi --query-gpu=$query --format=csv -lms 100 >"$OUT/clocks.csv" 2>&1 &
      sampler=$!
      echo "grid $(date +%T.%N)" >"$OUT/marks.txt"
      within $decode --formats "$format" --heads "$heads" >"$OUT/grid.txt" 2>&1 || status=1
      # STEP12_SHAPES: other B,CTX pairs (space-separated), e.g. "64,32768 66,32768" (66
      # sequences make 132 blocks at 128 heads, one an SM; 64 make 128).
      read -ra shapes <<<"${STEP12_SHAPES:-64,32768 16,131072 64,131072 128,32768}"
      for order in forward reverse; do
        if [[ $order == reverse ]]; then
          for ((i = 0, j = ${#shapes[@]} - 1; i < j; i++, j--)); do
            swap=${shapes[i]} shapes[i]=${shapes[j]} shapes[j]=$swap
          done
        fi
        for shape in "${shapes[@]}"; do
          sleep 2  # a pause between processes, visible in the samples
          echo "$order $shape $(date +%T.%N)" >>"$OUT/marks.txt"
          within $decode --only "$format,$shape,$heads" 2>&1 | grep "B=" | sed "s/^/$order: /" ||
            status=1
          if [[ -n $anchor_pid ]]; then
            sleep 2
            echo "$order flashmla $shape $(date +%T.%N)" >>"$OUT/marks.txt"
            within python3 .anchor/bench_flashmla.py --root "$ANCHOR_ROOT" --heads "$heads" \
              --contexts "${shape#*,}" --batches "${shape%,*}" 2>&1 | grep "^flashmla bf16 B=" |
              sed "s/^/$order: flashmla /" || status=1
          fi
        done
      done >"$OUT/alone.txt"
      kill $sampler
    fi
    ;;
  10)
    within bash bench/gpu/device-build.sh quantmla bench_runner || status=1
    if ((status == 0)); then
      within build-gpu-full/quantmla make-random-model --preset deepseek-v2-lite --out /tmp/v2-lite \
        --seed 1 --tokenizer models/mla-tiny/tokenizer.json 2>&1 | tail -1
      for round in 1 2; do
        for cache in bf16 content=int4:g64,rope=int4:g64; do
          within build-gpu-full/bench/gpu/bench_runner --model /tmp/v2-lite --only decode:1 \
            --cache "$cache" --repeats 20 2>&1 | tail -1 | sed "s/^/round $round: /" || status=1
        done
      done >"$OUT/batch1.txt"
    fi
    ;;
  13)
    within bash bench/gpu/device-build.sh quantmla bench_runner bench_gpu_decode || status=1
    build=build-gpu-full  # device-build.sh's tree, which three-layer-model.sh reads too
    if ((status == 0)); then
      within bash bench/gpu/ablate-runner.sh decode:1 >"$OUT/ablation-bf16.txt" 2>&1 || status=1
      CACHE=content=int4:g64,rope=int4:g64 within bash bench/gpu/ablate-runner.sh decode:1 \
        >"$OUT/ablation-int4.txt" 2>&1 || status=1
      for format in bf16/bf16 int4g64/int4; do
        for split in 0 1 2 4 16; do
          time_split $build/bench/gpu/bench_gpu_decode $format,1,1024,16 $split || status=1
        done
      done >"$OUT/split.txt" 2>&1
      # INT4/INT4's batch-1 kernel in the step: the plan's (tiled) against the fragment kernel,
      # alternated three times on the 3-layer model (QUANTMLA_DECODE_KERNEL forces a kernel).
      source bench/gpu/three-layer-model.sh
      for round in 1 2 3; do
        for kernel in auto fragments; do
          QUANTMLA_DECODE_KERNEL=$kernel within $build/bench/gpu/bench_runner \
            --model "$model" --only decode:1 --cache content=int4:g64,rope=int4:g64 --repeats 30 \
            2>&1 | tail -1 | sed "s/^/round $round, $kernel: /" || status=1
        done
      done >"$OUT/int4-kernel.txt"
    fi
    ;;
  14)
    start_flashmla_build 8 "$OUT/flush-flashmla-h128-dirty.txt" --heads 128
    build_main_decode || status=1
    wait $anchor_pid || status=1
    decode=build-gpu/bench/gpu/bench_gpu_decode
    flashmla() {  # FLUSH HEADS: FlashMLA's grid at HEADS with the anchor's flush or a clean one
      local runner=(.anchor/bench_flashmla.py)
      [[ $1 == clean ]] && runner=(bench/gpu/flashmla_clean_flush.py .anchor/bench_flashmla.py)
      within python3 "${runner[@]}" --root "$ANCHOR_ROOT" --heads "$2" \
        >"$OUT/flush-flashmla-h$2-$1${3:-}.txt" 2>&1 || status=1
    }
    ours() {  # FORMATS HEADS: our grid with the anchor's flush, then with a clean one
      for flush in dirty clean; do
        local flag= && [[ $flush == clean ]] && flag=--clean-flush
        within $decode --formats "$1" --heads "$2" $flag >"$OUT/flush-ours-h$2-$flush.txt" 2>&1 ||
          status=1
      done
    }
    if ((status == 0)); then
      ours bf16/bf16 128
      flashmla clean 128
      flashmla dirty 128 -again
      ours int4g64/int4,bf16/bf16 16
      flashmla dirty 16
      flashmla clean 16
    fi
    ;;
  15)
    GPU_TEST=1 OPS_ARGS=none GEMMS=none SHAPE=decode:1 ROUNDS=${AB_ROUNDS:-3} RUNNER_TEST=1 \
      CACHES="bf16 content=int4:g64,rope=int4:g64" AB_BINARIES="quantmla bench/gpu/bench_runner
      tests/gpu/test_cuda_runner tests/gpu/test_gpu_mla" \
      within bash bench/gpu/ab-runner.sh "${diffs[@]}" >"$OUT/ab-runner.txt" 2>&1 || status=1
    ;;
  6)
    within bash bench/gpu/device-build.sh quantmla bench_runner || status=1
    ((status)) || within bash bench/gpu/profile-runner.sh decode:25 decode:81 decode:139 \
      decode:81:content=int4:g64,rope=int4:g64 decode:139:content=int2:g64,rope=int4:g64 \
      >"$OUT/profile-batches.txt" 2>&1 || status=1
    ;;
  7)
    # Each changed tree: a copy with its diff applied, built beside main's (this tree), all at once.
    declare -A tree_of
    pids=() names=()
    for diff in "${diffs[@]}"; do
      name=$(basename "$diff" .diff)
      [[ $name == patch ]] && name=changed
      tree_of[$name]=$(mktemp -d)/tree
      (bash bench/gpu/patched-tree.sh "$diff" "${tree_of[$name]}" && cd "${tree_of[$name]}" &&
        build_kernels "$OUT/build-$name.txt" bench_gpu_decode test_gpu_mla) &
      pids+=($!) names+=("$name")
    done
    build_main_decode || status=1
    for k in "${!pids[@]}"; do
      wait "${pids[$k]}" || { echo "this tree's build failed" >>"$OUT/build-${names[$k]}.txt"; status=1; }
    done
    if ((status == 0)); then
      for name in "${!tree_of[@]}"; do
        gpu_test=${tree_of[$name]}/build-gpu/tests/gpu/test_gpu_mla
        # The quick cases first, briefly: a tree whose kernel fails or hangs (a barrier nobody
        # reaches) is left out of the timing instead of costing the call.
        if ! within timeout 60 "$gpu_test" --quick >"$OUT/test-quick-$name.txt" 2>&1; then
          echo "$name: the quick GPU test failed or hung; not timed" | tee -a "$OUT/test-quick-$name.txt"
          unset "tree_of[$name]"
          status=1
        fi
      done
      formats=${AB_FORMATS:-int4g64/int4,int2g64/int4,fp8/bf16}
      bench() {  # TREE NAME ARGS...: one benchmark run of that tree
        local decode=build-gpu/bench/gpu/bench_gpu_decode tree=$1 name=$2
        shift 2
        [[ $tree != main ]] && decode=${tree_of[$tree]}/build-gpu/bench/gpu/bench_gpu_decode
        # shellcheck disable=SC2086 # AB_ARGS: words
        within $decode --heads 16 --formats $formats ${AB_ARGS:-} "$@" >"$OUT/$name-$tree.txt" 2>&1 ||
          status=1
      }
      # The serving shapes and the grid, three rounds (AB_ROUNDS), each tree in turn.
      for round in $(seq "${AB_ROUNDS:-3}"); do
        for tree in "${!tree_of[@]}" main; do
          bench $tree short-$round --short-contexts --max-seconds 60
          bench $tree grid-$round --max-seconds 80
        done
      done
      python3 bench/gpu/ab_table.py "$OUT" >"$OUT/ab.txt" || status=1
      # The full tests last, within what is left of the deadline: a call with several trees that
      # runs out of time then still has their timing (the thirty-ninth session's first call of
      # three trees spent its 600 s in the full tests, before any timing).
      for name in "${!tree_of[@]}"; do
        within timeout 200 "${tree_of[$name]}/build-gpu/tests/gpu/test_gpu_mla" \
          >"$OUT/test-$name.txt" 2>&1 || status=1
        echo "$name: $(tail -1 "$OUT/test-$name.txt")"
      done
    fi
    ;;
esac
tail -n 25 "$OUT"/*.txt
tar czf "$final_out/results-$step.tgz" -C "$final_out" r && rm -rf "$final_out/r"
exit $status
