#!/usr/bin/env bash
# On the GPU machine, in one call: kernel changes as patches against the checkout, each built,
# checked and timed side by side with it. Processes alternate between the builds (the same code
# differs by up to ~6% from one process to the next: cuBLAS tunes per process; from one machine to
# the next, more), so a comparison is only made within one call, over several rounds.
#   bash bench/gpu/ab-runner.sh PATCH...      (made here with `git diff main BRANCH > PATCH`, the
#                                              branch rebased on main)
# For the checkout ("base") and each patch (built one after the other in the checkout's own build
# tree, each patch applied and then reversed): test_model_ops on each patch (with OPS_ARGS, e.g.
# --expert-gemm, or OPS_ARGS=none to skip it; its summary line, FAIL lines kept), with GPU_TEST=1
# each patch's `test_gpu_mla --quick` (the decode kernels' checks), then bench_prefill_gemms
# --skew 0 --only "$GEMMS" (default expert_gemm; GEMMS=none for no rows) on every build, and with
# ATTENTION=1 bench_prefill_attention on every build, then ROUNDS (default 2)
# rounds of `bench_runner --only SHAPE` for each of $SHAPE's shapes (default prefill:1; several
# separated by spaces, e.g. "decode:64 decode:256") on the 27-layer random V2-Lite, one process a
# build in turn (decode shapes on the BF16 cache, or on each of CACHES's, space-separated, e.g.
# CACHES="bf16 content=int4:g64,rope=int4:g64"; CACHE=SPEC for one); RUNNER_TEST=1 then runs each
# build's runner test against the fixtures (needs .carry/shared: scripts/device-carry.sh), after
# the timing, so that a call short of time still has it. The Debian dependencies come from
# .carry/deps.tar.xz as for run-runner.sh. Results in $OUT (or gpu-results), one file a step.
# AB_REUSE=1 skips the builds that an earlier call on the same warm machine left in /tmp/ab (made
# from the same patches: nothing checks that).
set -uo pipefail
patches=()
for patch in "$@"; do patches+=("$(realpath "$patch")"); done
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out" && out=$(realpath "$out")
[[ $# -ge 1 ]] || { echo "usage: bash bench/gpu/ab-runner.sh PATCH..."; exit 2; }
# What each build keeps (paths in the build tree; the ninja targets are their names): AB_BINARIES
# (space-separated) where a call needs fewer, e.g. no prefill benchmarks (GEMMS=none) and no
# test_model_ops (OPS_ARGS=none).
# shellcheck disable=SC2206 # AB_BINARIES: words
binaries=(${AB_BINARIES:-quantmla bench/gpu/bench_runner bench/gpu/bench_prefill_gemms
  bench/gpu/bench_prefill_attention tests/gpu/test_model_ops tests/gpu/test_cuda_runner
  tests/gpu/test_gpu_mla})
targets=()
for binary in "${binaries[@]}"; do targets+=("$(basename "$binary")"); done
status=0

# Every patch must apply before any device time goes into building.
for patch in "${patches[@]}"; do
  patch -s --dry-run -p1 <"$patch" >/dev/null ||
    { echo "$(basename "$patch"): the patch does not apply"; exit 1; }
done
# The files an earlier call's patches changed are touched first: on a machine kept warm from
# that call the build tree holds objects of its last patch, newer than the checkout's copies of
# those files, which ninja would otherwise link into the checkout's build (a mixed build, which
# crashed). Each patch's files are recorded for the next call as it is applied.
patched=build-gpu-full/ab-patched-files
if [[ -f $patched ]]; then
  while read -r file; do [[ -f $file ]] && touch "$file"; done <"$patched"
  rm -f "$patched"
fi
# One build tree: the checkout, then each patch applied, built incrementally (only what the patch
# touches recompiles: about half a full build's time each) and reversed; each build's binaries
# (statically linked to the project) are copied to /tmp/ab/NAME.
names=(base)
for patch in "${patches[@]}"; do names+=("$(basename "$patch" .diff)"); done
for i in "${!names[@]}"; do
  start=$(date +%s)
  # AB_REUSE=1 (a warm machine's next call with the same patches): the builds it kept are reused.
  if [[ -n ${AB_REUSE:-} && -x /tmp/ab/${names[$i]}/bench_runner ]]; then
    echo "== ${names[$i]} reused from /tmp/ab (AB_REUSE)"
    continue
  fi
  if (( i > 0 )); then
    sed -n 's|^+++ b/||p' "${patches[$((i - 1))]}" >>"$patched"  # the base built the tree
    patch -s -p1 <"${patches[$((i - 1))]}"
  fi
  OUT=$out/build-${names[$i]} bash bench/gpu/device-build.sh "${targets[@]}" ||
    { echo "${names[$i]}: the build failed"; exit 1; }
  (( i > 0 )) && patch -s -R -p1 <"${patches[$((i - 1))]}"
  rm -rf "/tmp/ab/${names[$i]}" && mkdir -p "/tmp/ab/${names[$i]}"
  for binary in "${binaries[@]}"; do cp "build-gpu-full/$binary" "/tmp/ab/${names[$i]}/"; done
  echo "== ${names[$i]} built in $(($(date +%s) - start)) s"
done

for i in "${!names[@]}"; do
  (( i == 0 )) && continue  # the checkout's own were run when it landed
  if [[ ${OPS_ARGS:-} != none ]]; then
    # shellcheck disable=SC2086
    timeout 300 "/tmp/ab/${names[$i]}/test_model_ops" ${OPS_ARGS:-} \
      >"$out/test-model-ops-${names[$i]}.txt" 2>&1 || status=1
    echo "${names[$i]}: test_model_ops $(tail -1 "$out/test-model-ops-${names[$i]}.txt")"
    grep -E "FAIL" "$out/test-model-ops-${names[$i]}.txt" | head -5
  fi
  if [[ -n ${GPU_TEST:-} ]]; then
    timeout 120 "/tmp/ab/${names[$i]}/test_gpu_mla" --quick \
      >"$out/test-gpu-mla-quick-${names[$i]}.txt" 2>&1 || status=1
    echo "${names[$i]}: test_gpu_mla --quick $(tail -1 "$out/test-gpu-mla-quick-${names[$i]}.txt")"
    grep -E "FAIL" "$out/test-gpu-mla-quick-${names[$i]}.txt" | head -5
  fi
done
for i in "${!names[@]}"; do
  [[ -n ${ATTENTION:-} ]] || continue
  echo "== ${names[$i]}: bench_prefill_attention"
  timeout 200 "/tmp/ab/${names[$i]}/bench_prefill_attention" --repeats 20 2>&1 |
    tee "$out/prefill-attention-${names[$i]}.txt" | grep -vE "^NVIDIA"
done
for i in "${!names[@]}"; do
  [[ ${GEMMS:=expert_gemm} != none ]] || continue
  echo "== ${names[$i]}: bench_prefill_gemms --only $GEMMS"
  timeout 200 "/tmp/ab/${names[$i]}/bench_prefill_gemms" --skew 0 --repeats 10 \
    --only "$GEMMS" 2>&1 | tee "$out/prefill-gemms-${names[$i]}.txt" | grep -vE "^(NVIDIA|product)"
done
model=/tmp/v2-lite
[[ -f $model/config.json ]] || /tmp/ab/base/quantmla make-random-model --preset deepseek-v2-lite \
  --out $model --seed 1 --tokenizer models/mla-tiny/tokenizer.json 2>&1 | tail -1
for round in $(seq 1 "${ROUNDS:-2}"); do
  for shape in ${SHAPE:-prefill:1}; do
    for cache in ${CACHES:-${CACHE:-bf16}}; do
      for i in "${!names[@]}"; do
        line=$(timeout 150 "/tmp/ab/${names[$i]}/bench_runner" --model $model \
          --only "$shape" --cache "$cache" --repeats 10 2>&1 | tail -1)
        # A process that ends without its row (a crash prints nothing more) is said to have failed.
        [[ $line == prefill* || $line == *" B "* ]] || line="FAILED (last line: $line)"
        echo "round $round ${names[$i]} $cache: $line"
      done
    done
  done
done | tee "$out/runner-ab.txt"
grep -q FAILED "$out/runner-ab.txt" && status=1
if [[ -n ${RUNNER_TEST:-} ]]; then
  # The fixtures once (run-runner.sh's runner stage), then each build's runner against them (the
  # checkout's too: a check added since its last GPU run is then run on it as well).
  python3 .carry/shared/tools/make_gpu_fixtures.py .carry/shared /tmp/fixtures \
    >"$out/fixtures.txt" 2>&1 || { tail -5 "$out/fixtures.txt"; status=1; }
  for i in "${!names[@]}"; do
    timeout 300 "/tmp/ab/${names[$i]}/test_cuda_runner" --fixtures /tmp/fixtures \
      --model models/mla-tiny >"$out/test-cuda-runner-${names[$i]}.txt" 2>&1 || status=1
    echo "${names[$i]}: test_cuda_runner $(grep -E "FAIL|PASS" "$out/test-cuda-runner-${names[$i]}.txt" | tail -1)"
  done
fi
exit $status
