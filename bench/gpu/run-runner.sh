#!/usr/bin/env bash
# On the GPU machine, in one call: the full build with the CUDA runner (bench/gpu/device-build.sh,
# the Debian dependencies carried in .carry/), the GPU kernels' tests, the GPU fixtures of
# make_gpu_fixtures.py and the runner's test against transformers and the CPU runner, eval-ppl on
# both devices, and the runner benchmark on a random V2-Lite. Results go to $OUT (or gpu-results).
#   bash bench/gpu/run-runner.sh [STAGES]
#   STAGES: any of build,ops,memcheck,runner,ppl,calib,passkey,long,longcalib,calibrated,bench,
#   nopdl,fusion,gemms,prefill,expertgemm (default build,ops,runner,ppl,bench); prefill: bench's
#   prefill rows only (bench_runner --prefill); expertgemm: the same with each form of the routed
#   experts (CudaRunnerOptions::expert_products; EXPERTS, ROUNDS and SHAPE below); gemms:
#   bench_prefill_gemms (a 2K prefill's products: cuBLASLt's first algorithm against its best, the
#   padded routed experts against expert_gemm); memcheck: compute-sanitizer over the GPU
#   checks' kernels (test_gpu_mla --quick, test_model_ops --prefill-attention, test_fused_ops);
#   nopdl: the runner benchmark again with the kernels launched without programmatic dependent
#   launch (bench_runner --no-pdl), beside bench's;
#   fusion: decode at batch 1, 4, 16 with and without the fused decode launches
#   ppl: WikiText-2 ctx 1024 on mla-tiny, cpu vs cuda, BF16 / INT4 / INT2 caches, each window as
#   one prefill step (which never reaches the decode kernel: chunks of 128 tokens or more take the
#   prefill attention), then the CUDA runner fed one token a step (eval-ppl --chunk 1: every
#   position through the decode kernel, PPL_DECODE_WINDOWS side by side, default 64, the batch at
#   which INT4 takes the fragment kernel) against the CPU's whole windows; calib: the same
#   and pass-key for an INT4/INT4 model calibrated here; passkey: mla-tiny's pass-key, cpu vs cuda;
#   long: ctx 4096 and all 120 pass-key prompts on .carry/shared/models/mla-tiny-v2-4k; longcalib:
#   the same for an INT4/INT4 mla-tiny-v2-4k calibrated here (windows of --seq 512); calibrated:
#   eval-ppl (ctx CALIBRATED_CTX, default 4096) and pass-key of a model calibrated elsewhere
#   (CALIBRATED=DIR bash scripts/device-carry.sh), with its sha256. Every
#   comparison must agree (bench/gpu/compare_devices.py: PPL within 0.1%, the same prompts pass).
# Needs .carry/shared (scripts/device-carry.sh): tools/make_gpu_fixtures.py, the mla-tiny tokenizer
# files, the first 100000 ids of valid.ids.i32, wikitext2-test.ids.i32, passkey-public.json.
# PACK=1: everything written goes into one $OUT/results.tgz at the end (the device tool brings
# back only a few files of a call: the runner's JSON was among the ones left out once).
# FULL=1: the evaluations score the whole WikiText-2 test text (data/wikitext2-test.raw, tokenized
# there: 462 windows at ctx 1024, 115 at 4096) instead of the first PPL_WINDOWS / LONG_WINDOWS.
# DEVICES="cuda": evaluate on the GPU only (the CPU figures measured elsewhere on the same files;
# the calibrated models' sha256 go to $OUT/calibrated.sha256 so that the same weights can be shown).
# CALIB_THREADS=N: calibrate with N threads (calibration is reproducible for a seed and a thread
# count). The pass-key evaluations are skipped, and say so, where the prompts are not carried.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
if [[ -n ${PACK:-} ]]; then
  packed_to=$out
  mkdir -p "$packed_to"
  out=$(mktemp -d)
  export OUT=$out  # device-build.sh's logs too
  trap 'tar -C "$out" -czf "$packed_to/results.tgz" . && rm -rf "$out"' EXIT
fi
stages=${1:-build,ops,runner,ppl,bench}
mkdir -p "$out"
build=build-gpu-full
has() { [[ ",$stages," == *",$1,"* ]]; }
status=0
nproc_=$(nproc)
export OMP_NUM_THREADS=$nproc_

if has build; then
  start=$(date +%s)
  bash bench/gpu/device-build.sh quantmla test_model_ops test_fused_ops test_cuda_runner \
    test_gpu_mla test_decode_schedule bench_runner bench_skinny bench_prefill_attention \
    bench_gpu_decode bench_prefill_gemms || exit 1
  echo "== built in $(($(date +%s) - start)) s"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"

if has ops; then
  echo "== decode schedule, decode kernels, model ops"
  $build/tests/gpu/test_decode_schedule 2>&1 | tail -1 || status=1
  $build/tests/gpu/test_gpu_mla 2>&1 | tee "$out/test-gpu-mla.txt" | tail -3 || status=1
  $build/tests/gpu/test_model_ops 2>&1 | tee "$out/test-model-ops.txt" | tail -25 || status=1
  $build/tests/gpu/test_fused_ops 2>&1 | tee "$out/test-fused-ops.txt" | grep -v " equal$" ||
    status=1
  $build/bench/gpu/bench_skinny --json "$out/skinny.json" 2>&1 | tee "$out/bench-skinny.txt" ||
    status=1
fi
# memcheck: compute-sanitizer over the decode kernels' quick cases (with the cache read-back), the
# prefill attention cases and the fused decode launches.
if has memcheck; then
  echo "== compute-sanitizer memcheck"
  for check in "test_gpu_mla --quick" "test_model_ops --prefill-attention" "test_fused_ops"; do
    name=${check%% *}
    compute-sanitizer --tool memcheck --error-exitcode 3 $build/tests/gpu/$check \
      >"$out/memcheck-$name.txt" 2>&1 || status=1
    echo "$check: $(tail -1 "$out/memcheck-$name.txt")"
  done
fi
if has gemms; then
  echo "== a 2K prefill's products on cuBLASLt"
  $build/bench/gpu/bench_prefill_gemms --json "$out/prefill-gemms.json" 2>&1 |
    tee "$out/prefill-gemms.txt" || status=1
fi
if has runner; then
  echo "== runner vs transformers and the CPU runner"
  python3 .carry/shared/tools/make_gpu_fixtures.py .carry/shared /tmp/fixtures >"$out/fixtures.txt" 2>&1 ||
    { tail -5 "$out/fixtures.txt"; status=1; }
  $build/tests/gpu/test_cuda_runner --fixtures /tmp/fixtures --model models/mla-tiny 2>&1 |
    tee "$out/test-cuda-runner.txt" || status=1
fi
# One evaluation on both devices: its JSON lines (cpu, then cuda) appended to $out/$1.jsonl;
# CUDA_ARGS: further arguments for the cuda run only.
both() {
  local file=$1
  shift
  for device in ${DEVICES:-cpu cuda}; do
    local extra=()
    [[ $device == cuda ]] && extra=(${CUDA_ARGS:-})
    $build/quantmla "$@" "${extra[@]}" --device $device --json 2>>"$out/eval-stderr.txt" \
      >>"$out/$file.jsonl" ||
      { echo "$file on $device failed: $(tail -1 "$out/eval-stderr.txt")"; status=1; }
  done
}
# The pairs' comparison (compare_devices.py), when both devices ran.
compare() {
  [[ ${DEVICES:-cpu cuda} == "cpu cuda" ]] ||
    { echo "(cpu vs cuda not compared here: DEVICES=$DEVICES)"; return 0; }
  python3 bench/gpu/compare_devices.py "$@"
}
ids=.carry/shared/reference/wikitext2-test.ids.i32
# The scored text and how much of it: the carried ids' first windows, or (FULL=1) the whole text.
if [[ -n ${FULL:-} ]]; then
  corpus="--text data/wikitext2-test.raw"
  PPL_WINDOWS=0 LONG_WINDOWS=0
else
  corpus="--ids $ids"
fi
prompts=.carry/shared/reference/passkey-public.json
have_prompts() { [[ -f $prompts ]] || { echo "(pass-key skipped: no $prompts)"; return 1; }; }
if has ppl; then
  [[ -n ${FULL:-} || -f $ids ]] ||
    { echo "ppl: $ids was not carried (scripts/device-carry.sh without RUNNER_ONLY)"; status=1; }
  echo "== eval-ppl, cpu vs cuda (WikiText-2, ctx 1024, first ${PPL_WINDOWS:=100} windows)"
  for spec in bf16 content=int4:g64,rope=int4:g64 content=int2:g64,rope=int4:g64; do
    both ppl eval-ppl $corpus --ctx 1024 --max-windows $PPL_WINDOWS --cache $spec
  done
  compare mla-tiny-ctx1024="$out/ppl.jsonl" || status=1
  echo "== eval-ppl, cpu whole windows vs cuda one token a step (the decode kernel; first" \
    "${PPL_DECODE_WINDOWS:=64} windows)"
  for spec in bf16 content=int4:g64,rope=int4:g64 content=int2:g64,rope=int4:g64; do
    CUDA_ARGS="--chunk 1" both ppl-decode eval-ppl $corpus --ctx 1024 \
      --max-windows $PPL_DECODE_WINDOWS --cache $spec
  done
  compare mla-tiny-decode-path="$out/ppl-decode.jsonl" || status=1
fi
# INT4/INT4 calibration of model $1 (empty: the bundled one) into $2, its log in $out/$3.
calibrate_int4() {
  local start
  start=$(date +%s)
  $build/quantmla calibrate ${1:+--model $1} --cache content=int4:g64,rope=int4:g64 --out "$2" \
    --threads "${CALIB_THREADS:-$nproc_}" >"$out/$3" 2>&1 || { tail -5 "$out/$3"; status=1; }
  echo "calibrated in $(($(date +%s) - start)) s"
}
# A calibrated model $2 on both devices, into $out/$1.jsonl and compared as $3: its sha256,
# eval-ppl at ctx $4 over $5 windows, pass-key (with any further arguments).
evaluate_calibrated() {
  local file=$1 model=$2 label=$3 ctx=$4 windows=$5
  shift 5
  sha256sum "$model"/*.safetensors | tee -a "$out/calibrated.sha256"
  both $file eval-ppl --model "$model" $corpus --ctx $ctx --max-windows $windows
  have_prompts && both $file eval-passkey --model "$model" --prompts $prompts "$@"
  compare $label="$out/$file.jsonl" || status=1
}
if has calib; then
  echo "== calibrated INT4/INT4 mla-tiny: eval-ppl and pass-key, cpu vs cuda"
  calibrate_int4 "" /tmp/mla-tiny-q4 calibrate.txt
  evaluate_calibrated calib /tmp/mla-tiny-q4 mla-tiny-q4 1024 ${PPL_WINDOWS:=100} --per-cell ${PER_CELL:=2}
fi
if has passkey; then
  echo "== pass-key, cpu vs cuda (mla-tiny, ${PER_CELL:=2} prompts per cell)"
  both passkey eval-passkey --prompts $prompts --per-cell $PER_CELL --cache bf16
  compare mla-tiny-passkey="$out/passkey.jsonl" || status=1
fi
long=.carry/shared/models/mla-tiny-v2-4k
# The bundled tokenizer for make-random-model; the long stages' call leaves models/mla-tiny out of
# the checkout (device size limit) and has the tokenizer in .carry/shared.
tokenizer=models/mla-tiny/tokenizer.json
[[ -f $tokenizer ]] || tokenizer=.carry/shared/models/mla-tiny/tokenizer.json
if { has long || has longcalib; } && [[ ! -d $long && -f $long.tar.xz ]]; then
  xz -dc $long.tar.xz | tar -C .carry/shared/models -xf - || status=1
fi
if has long; then
  echo "== mla-tiny-v2-4k: eval-ppl ctx 4096 (${LONG_WINDOWS:=20} windows), all pass-key prompts"
  for spec in bf16 content=int4:g64,rope=int4:g64 content=int2:g64,rope=int4:g64; do
    both long eval-ppl --model $long $corpus --ctx 4096 --max-windows $LONG_WINDOWS --cache $spec
  done
  have_prompts && both long eval-passkey --model $long --prompts $prompts --cache bf16
  compare mla-tiny-v2-4k="$out/long.jsonl" || status=1
fi
if has longcalib; then
  echo "== calibrated INT4/INT4 mla-tiny-v2-4k: eval-ppl ctx 4096, all pass-key prompts"
  calibrate_int4 $long /tmp/v2-4k-q4 calibrate-long.txt
  evaluate_calibrated longcalib /tmp/v2-4k-q4 mla-tiny-v2-4k-q4 4096 ${LONG_WINDOWS:=20}
fi
if has calibrated; then
  echo "== a model calibrated elsewhere: eval-ppl ctx ${CALIBRATED_CTX:=4096}, pass-key"
  calibrated=/tmp/calibrated
  rm -rf $calibrated && mkdir -p $calibrated
  xz -dc .carry/shared/models/calibrated.tar.xz | tar -C $calibrated -xf - --strip-components=1 ||
    status=1
  evaluate_calibrated calibrated $calibrated calibrated $CALIBRATED_CTX ${LONG_WINDOWS:=20}
fi
if has bench || has prefill; then
  echo "== runner benchmark (random V2-Lite)"
  $build/quantmla make-random-model --preset deepseek-v2-lite --out /tmp/v2-lite --seed 1 \
    --tokenizer "$tokenizer" 2>/dev/null | tail -1
  $build/bench/gpu/bench_runner --model /tmp/v2-lite --json "$out/runner.json" \
    $(has bench || echo --prefill) 2>&1 | tee "$out/bench-runner.txt" || status=1
  # The fixture rows of the same call's runner test, when it ran (merge_fixtures.py).
  if [[ -f $out/test-cuda-runner.txt && -f $out/runner.json ]]; then
    python3 bench/gpu/merge_fixtures.py "$out/runner.json" "$out/test-cuda-runner.txt" || status=1
  fi
fi
# expertgemm: the prefill rows (SHAPE, default all of them) with each of EXPERTS' forms of the
# routed experts (default cublas ours-gated ours), one process each in turn for
# ROUNDS rounds (default 1): each process tunes its own cuBLAS algorithms, which moves a 2K
# prefill by up to 5%, so forms are compared over rounds.
if has expertgemm; then
  [[ -d /tmp/v2-lite ]] || $build/quantmla make-random-model --preset deepseek-v2-lite \
    --out /tmp/v2-lite --seed 1 --tokenizer "$tokenizer" 2>/dev/null | tail -1
  for round in $(seq 1 "${ROUNDS:-1}"); do
    for experts in ${EXPERTS:-cublas ours-gated ours}; do
      echo "== round $round, prefill with the routed experts' products: $experts" \
        "(CudaRunnerOptions::expert_products)"
      $build/bench/gpu/bench_runner --model /tmp/v2-lite --experts $experts \
        $([[ -n ${SHAPE:-} ]] && echo --only "$SHAPE" || echo --prefill) \
        --json "$out/runner-experts-$experts-$round.json" 2>&1 |
        tee "$out/bench-runner-experts-$experts-$round.txt" | grep -E "prefill|error|cuBLAS" || status=1
    done
  done
fi
# One variant of the runner: bench_runner again with its flags, beside bench's default.
variant() {
  local name=$1
  shift
  echo "== runner benchmark, $*"
  [[ -f /tmp/v2-lite/config.json ]] || $build/quantmla make-random-model --preset deepseek-v2-lite \
    --out /tmp/v2-lite --seed 1 --tokenizer "$tokenizer" 2>/dev/null | tail -1
  $build/bench/gpu/bench_runner --model /tmp/v2-lite "$@" --json "$out/runner-$name.json" \
    2>&1 | tee "$out/bench-runner-$name.txt" || status=1
}
has nopdl && variant nopdl --no-pdl
# fusion: decode at batch 1, 4 and 16 with the decode step's fused launches and without, one
# after the other (bench_runner --quick, --no-fusion).
if has fusion; then
  variant fused --quick
  variant unfused --quick --no-fusion
fi
exit $status
