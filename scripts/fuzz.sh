#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer over the whole library, and runs each for SECONDS (default 60) from a
# corpus seeded with real inputs (../shared's chat templates, conversations and texts, the bundled
# model's weights). A crash leaves its input in build-fuzz/findings/ and the script exits non-zero.
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] ||
  targets=(fuzz_chat_template fuzz_chat_messages fuzz_tokenizer fuzz_tokenizer_json fuzz_safetensors
    fuzz_model_config fuzz_server_request)
shared=${QUANTMLA_SHARED_DIR:-$(cd .. && pwd)/shared}
build=build-fuzz
flags="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined -g -O1"
CC=clang CXX=clang++ cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DQUANTMLA_FUZZ=ON -DQUANTMLA_BUILD_TESTS=OFF -DQUANTMLA_BUILD_BENCH=OFF \
  -DQUANTMLA_SHARED_DIR="$shared" -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_C_FLAGS="$flags" >/dev/null
cmake --build $build --target "${targets[@]}"
mkdir -p $build/findings
seed() {  # seed DIR: the target's starting corpus from real inputs
  local dir=$1 target=$2
  mkdir -p "$dir"
  case $target in
    fuzz_chat_template)
      python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['template_source'], end='')" \
        "$shared/reference/chat-template-reference.json" >"$dir/deepseek-v3.jinja" ;;
    fuzz_chat_messages)
      python3 - "$shared/reference/chat-template-reference.json" "$dir" <<'PY'
import json, sys
for i, case in enumerate(json.load(open(sys.argv[1]))["cases"]):
    open(f"{sys.argv[2]}/case{i}.json", "w").write(json.dumps(case["messages"], ensure_ascii=False))
PY
      ;;
    fuzz_tokenizer)
      python3 - "$shared/reference/tokenizer-reference.json" "$dir" <<'PY'
import json, sys
texts = json.load(open(sys.argv[1]))["texts"]
for name, value in texts.items():
    for i, text in enumerate(value if isinstance(value, list) else [value]):
        open(f"{sys.argv[2]}/{name}{i}", "wb").write(text.encode()[:4000])
PY
      printf 'Hello <｜begin▁of▁sentence｜> world' >"$dir/special" ;;
    fuzz_server_request)  # the first byte picks the route (even: completions, odd: chat)
      printf '\x00{"prompt": "The Debian", "max_tokens": 3, "logprobs": 2, "stop": ["x"]}' \
        >"$dir/completion"
      printf '\x00{"prompt": [1, 400, 500], "n": 2, "stream": true, "seed": 7}' >"$dir/ids"
      printf '\x00{"prompt": "a b", "max_tokens": 5, "temperature": 0.7, "top_k": 40, "min_p": 0.1, '\
'"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, '\
'"logit_bias": {"7": -100, "1234": 5}, "min_tokens": 2, "stop_token_ids": [3, 9]}' >"$dir/controls"
      printf '\x00{"prompt": [1, 400, 500, 600], "max_tokens": 1, "echo": true, "logprobs": 2, '\
'"prompt_logprobs": 3}' >"$dir/scoring"
      printf '\x01{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", '\
'"content": "hi"}], "max_tokens": 4, "logprobs": true, "top_logprobs": 3}' >"$dir/chat"
      printf '\x01{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '\
'"function": {"name": "f", "parameters": {"type": "object"}}}], "stream": true, '\
'"stream_options": {"include_usage": true}}' >"$dir/tools" ;;
    fuzz_tokenizer_json)  # the bundled tokenizer cut to its byte symbols and first merges
      python3 - models/mla-tiny/tokenizer.json "$dir/small.json" <<'PY'
import json, sys
spec = json.load(open(sys.argv[1]))
vocab = dict(list(spec["model"]["vocab"].items())[:300])
spec["model"]["vocab"] = vocab
spec["model"]["merges"] = [m for m in spec["model"]["merges"][:400]
                           if "".join(m) in vocab and all(p in vocab for p in m)][:40]
json.dump(spec, open(sys.argv[2], "w"), ensure_ascii=False)
PY
      ;;
    fuzz_model_config)
      cp models/mla-tiny/config.json "$dir/mla-tiny.json"
      for m in "$shared"/models/*/config.json; do cp "$m" "$dir/$(basename "$(dirname "$m")").json"; done
      if [[ -x build/quantmla ]]; then  # the presets' configs, when the main build is there
        for preset in deepseek-v2-lite moonlight-16b deepseek-v3; do
          build/quantmla make-random-model --preset $preset --out "$dir/unused" --config-only \
            >"$dir/$preset.json"
        done
      fi ;;
    fuzz_safetensors)
      python3 - "$dir/small.safetensors" <<'PY'
import json, struct, sys
header = json.dumps({"__metadata__": {"format": "pt"},
                     "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                     "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(header)) + header + bytes(range(22)))
PY
      head -c 8192 models/mla-tiny/model-00004-of-00004.safetensors >"$dir/shard-head" ;;
  esac
}
status=0
for target in "${targets[@]}"; do
  corpus=$build/corpus/$target
  [[ -d $corpus ]] || seed "$corpus" "$target"
  echo "== $target, $seconds s"
  if ! ASAN_OPTIONS=detect_leaks=0 $build/tests/fuzz/$target "$corpus" -max_total_time="$seconds" \
    -max_len=8192 -timeout=10 -rss_limit_mb=4096 -artifact_prefix=$build/findings/$target- \
    -print_final_stats=1 2>$build/$target.log; then
    echo "$target: FOUND a failure (tail of $build/$target.log):"
    tail -30 $build/$target.log
    status=1
  else
    grep -E "stat::number_of_executed_units|cov:" $build/$target.log | tail -2
  fi
done
exit $status
