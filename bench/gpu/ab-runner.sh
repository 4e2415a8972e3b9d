#!/usr/bin/env bash
# On the GPU machine, in one call: kernel changes as patches beside the checkout they apply to,
# each built in a tree of its own, checked and timed side by side. Processes alternate between the
# trees (the same code differs by up to ~3% from one process to the next: cuBLAS tunes per
# process), so a comparison is only made within one call.
#   bash bench/gpu/ab-runner.sh PATCH...      (made here with `git diff main...BRANCH > PATCH`)
# For the checkout ("base") and each patch: test_model_ops (its summary line; FAIL lines kept),
# then bench_prefill_gemms --skew 0 --only "$GEMMS" (default expert_gemm), then ROUNDS (default 2)
# rounds of `bench_runner --only "$SHAPE"` (default prefill:1) on the 27-layer random V2-Lite,
# one process a tree in turn; RUNNER_TEST=1 also runs each patch's runner test against the
# fixtures (needs .carry/shared: scripts/device-carry.sh). The Debian dependencies come from
# .carry/deps.tar.xz as for run-runner.sh. Results in $OUT (or gpu-results), one file a step.
set -uo pipefail
patches=()
for patch in "$@"; do patches+=("$(realpath "$patch")"); done
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out" && out=$(realpath "$out")  # the trees' steps run from their own directories
[[ $# -ge 1 ]] || { echo "usage: bash bench/gpu/ab-runner.sh PATCH..."; exit 2; }
targets=(quantmla bench_runner bench_prefill_gemms test_model_ops test_cuda_runner)
status=0

# The trees: the checkout as it is, and a copy of it per patch with the patch applied.
trees=(.)
names=(base)
for patch in "${patches[@]}"; do
  name=$(basename "$patch" .diff)
  tree=/tmp/ab/$name
  rm -rf "$tree" && mkdir -p "$tree"
  tar --exclude=./build-gpu-full --exclude=./.git -cf - . | tar -C "$tree" -xf -
  patch -s -d "$tree" -p1 <"$patch" || { echo "$name: the patch does not apply"; exit 1; }
  trees+=("$tree")
  names+=("$name")
done
for i in "${!trees[@]}"; do
  start=$(date +%s)
  (cd "${trees[$i]}" && OUT=$out/build-${names[$i]} bash bench/gpu/device-build.sh "${targets[@]}") ||
    { echo "${names[$i]}: the build failed"; exit 1; }
  echo "== ${names[$i]} built in $(($(date +%s) - start)) s"
done

for i in "${!trees[@]}"; do
  bin=${trees[$i]}/build-gpu-full
  timeout 300 "$bin/tests/gpu/test_model_ops" >"$out/test-model-ops-${names[$i]}.txt" 2>&1 ||
    status=1
  echo "${names[$i]}: test_model_ops $(tail -1 "$out/test-model-ops-${names[$i]}.txt")"
  grep -E "FAIL" "$out/test-model-ops-${names[$i]}.txt" | head -5
done
for i in "${!trees[@]}"; do
  echo "== ${names[$i]}: bench_prefill_gemms --only ${GEMMS:=expert_gemm}"
  timeout 200 "${trees[$i]}/build-gpu-full/bench/gpu/bench_prefill_gemms" --skew 0 --repeats 10 \
    --only "$GEMMS" 2>&1 | tee "$out/prefill-gemms-${names[$i]}.txt" | grep -vE "^(NVIDIA|product)"
done
if [[ -n ${RUNNER_TEST:-} ]]; then
  for i in "${!trees[@]}"; do
    [[ $i == 0 ]] && continue
    (cd "${trees[$i]}" && OUT=$out/runner-${names[$i]} timeout 300 bash bench/gpu/run-runner.sh runner |
      grep -E "FAIL|PASS" | tail -3) || status=1
  done
fi
model=/tmp/v2-lite
[[ -f $model/config.json ]] || ./build-gpu-full/quantmla make-random-model --preset deepseek-v2-lite \
  --out $model --seed 1 --tokenizer models/mla-tiny/tokenizer.json 2>&1 | tail -1
for round in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!trees[@]}"; do
    line=$(timeout 150 "${trees[$i]}/build-gpu-full/bench/gpu/bench_runner" --model $model \
      --only "${SHAPE:-prefill:1}" --repeats 10 2>&1 | tail -1)
    echo "round $round ${names[$i]}: $line"
  done
done | tee "$out/runner-ab.txt"
exit $status
