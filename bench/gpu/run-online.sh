#!/usr/bin/env bash
# On the GPU machine: the OpenAI server's online throughput beside the offline engine on the same
# requests (issue 16). The offline `bench-serve` runs them in-process; then `quantmla serve` is
# started with the same model, cache format, budget and scheduler limits, and `bench-serve --url`
# sends them over HTTP at a fixed concurrency. JSON of both to $OUT (or gpu-results).
#   [WARM=1] bash bench/gpu/run-online.sh [NUM_PROMPTS INPUT_LEN OUTPUT_LEN CONCURRENCY]
#   (default 256 512 128 256). WARM=1 runs the workload twice on each side (one process each) and
#   compares the second runs: no first-time costs (CUDA graph captures, cuBLASLt plans); the
#   offline side through bench-serve --warmup full (up to 2026-12-04: the format given twice, the
#   JSON's second row).
# Needs .carry/deps.tar.xz and .carry/deps-server.tar.xz (scripts/device-carry.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out"
n=${1:-256} input=${2:-512} output=${3:-128} concurrency=${4:-256}
build=build-gpu-full
bash bench/gpu/device-build.sh quantmla || exit 1
$build/quantmla serve --help >/dev/null 2>&1 || { echo "this build has no server"; exit 1; }
[[ -f /tmp/v2-lite/config.json ]] ||
  $build/quantmla make-random-model --preset deepseek-v2-lite --out /tmp/v2-lite --seed 1 2>/dev/null | tail -1
cache=content=int4:g64,rope=int4:g64
budget=$((n * (input + output) * 27 * 1152 * 9 / 8))  # every request at once, in BF16 terms
workload=(--num-prompts "$n" --input-len "$input" --output-len "$output" --seed 0)
limits=(--max-seqs 256 --max-batched-tokens 2048)
echo "== offline: $n requests $input/$output, $cache, $budget bytes of cache"
# The offline run's warm-up pass (bench-serve --warmup) matches the online side's: none, or one.
$build/quantmla bench-serve --device cuda --model /tmp/v2-lite --cache $cache \
  --warmup "$([[ -n ${WARM:-} ]] && echo full || echo none)" --cache-memory $budget \
  "${workload[@]}" "${limits[@]}" --json "$out/offline.json" 2>"$out/offline.err" | tail -3
echo "== online: quantmla serve + bench-serve --url, concurrency $concurrency"
$build/quantmla serve --device cuda --model /tmp/v2-lite --cache $cache --cache-memory $budget \
  "${limits[@]}" --port 8000 >"$out/server.out" 2>"$out/server.err" &
server=$!
for _ in $(seq 120); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')" \
    2>/dev/null && break
  kill -0 $server 2>/dev/null || { echo "server exited"; tail -5 "$out/server.err"; exit 1; }
  sleep 1
done
online=(bench-serve --url http://127.0.0.1:8000 --model /tmp/v2-lite --concurrency "$concurrency"
  "${workload[@]}")
[[ -n ${WARM:-} ]] && $build/quantmla "${online[@]}" 2>"$out/online-warmup.err" | tail -1
$build/quantmla "${online[@]}" --json "$out/online.json" 2>"$out/online.err" | tail -4
kill -TERM $server
wait $server
echo "server exit status $?"
python3 - "$out/offline.json" "$out/online.json" <<'PY'
import json, sys
off = json.load(open(sys.argv[1]))["formats"][-1]  # the warm run when there are two
on = json.load(open(sys.argv[2]))
rate = on.get("output_tok_s") or on["formats"][0]["output_tok_s"]
print(f"output tok/s: offline {off['output_tok_s']:.0f}, online {rate:.0f}: {rate / off['output_tok_s']:.3f}x")
PY
