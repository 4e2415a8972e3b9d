#!/usr/bin/env bash
# On the GPU machine, in one call: the full build with the CUDA runner (the Debian dependencies
# from .carry/deps.tar.xz, scripts/device-deps.sh), the GPU kernels' tests, the GPU fixtures of
# make_gpu_fixtures.py and the runner's test against transformers and the CPU runner, eval-ppl on
# both devices, and the runner benchmark on a random V2-Lite. Results go to $OUT (or gpu-results).
#   bash bench/gpu/run-runner.sh [STAGES]   STAGES: any of build,ops,runner,ppl,bench (default all)
# Needs .carry/shared (scripts/device-carry.sh): tools/make_gpu_fixtures.py, the mla-tiny tokenizer
# files, the first 100000 ids of valid.ids.i32, wikitext2-test.ids.i32.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
stages=${1:-build,ops,runner,ppl,bench}
mkdir -p "$out"
build=build-gpu-full
has() { [[ ",$stages," == *",$1,"* ]]; }
status=0
nproc_=$(nproc)
export OMP_NUM_THREADS=$nproc_

if has build; then
  mkdir -p /tmp/deps && tar -xJf .carry/deps.tar.xz -C /tmp/deps
  cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DQUANTMLA_CUDA=ON \
    -DQUANTMLA_DEPS_ROOT=/tmp/deps -DQUANTMLA_BUILD_TESTS=OFF -DQUANTMLA_BUILD_BENCH=OFF \
    >"$out/configure.txt" 2>&1 || { tail -20 "$out/configure.txt"; exit 1; }
  start=$(date +%s)
  ninja -C $build quantmla test_model_ops test_cuda_runner bench_runner >"$out/build.txt" 2>&1 ||
    { grep -E "error|Error" -A3 "$out/build.txt" | head -40; exit 1; }
  echo "== built in $(($(date +%s) - start)) s"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"

if has ops; then
  echo "== model ops"
  $build/tests/gpu/test_model_ops 2>&1 | tee "$out/test-model-ops.txt" | tail -25 || status=1
fi
if has runner; then
  echo "== runner vs transformers and the CPU runner"
  python3 .carry/shared/tools/make_gpu_fixtures.py .carry/shared /tmp/fixtures >"$out/fixtures.txt" 2>&1 ||
    { tail -5 "$out/fixtures.txt"; status=1; }
  $build/tests/gpu/test_cuda_runner --fixtures /tmp/fixtures --model models/mla-tiny 2>&1 |
    tee "$out/test-cuda-runner.txt" || status=1
fi
if has ppl; then
  echo "== eval-ppl, cpu vs cuda (WikiText-2, ctx 1024, first ${PPL_WINDOWS:=100} windows)"
  ids=.carry/shared/reference/wikitext2-test.ids.i32
  for spec in bf16 content=int4:g64,rope=int4:g64 content=int2:g64,rope=int4:g64; do
    for device in cpu cuda; do
      $build/quantmla eval-ppl --device $device --ids $ids --ctx 1024 --max-windows $PPL_WINDOWS \
        --cache $spec --json 2>/dev/null | tee -a "$out/ppl.jsonl"
    done
  done
fi
if has bench; then
  echo "== runner benchmark (random V2-Lite)"
  $build/quantmla make-random-model --preset deepseek-v2-lite --out /tmp/v2-lite --seed 1 \
    2>/dev/null | tail -1
  $build/bench/gpu/bench_runner --model /tmp/v2-lite --json "$out/runner.json" 2>&1 |
    tee "$out/bench-runner.txt" || status=1
fi
exit $status
