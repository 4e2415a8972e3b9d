// Tokenizer throughput: whole-text encoding of WikiText-2 test with the bundled tokenizer.
#include <benchmark/benchmark.h>

#include <fstream>
#include <sstream>
#include <string>

#include "quantmla/tokenizer.h"

namespace {

constexpr const char* kTextPath = QUANTMLA_SOURCE_DIR "/data/wikitext2-test.raw";
constexpr const char* kModelDir = QUANTMLA_SOURCE_DIR "/models/mla-tiny";

std::string read_text() {
  std::ifstream stream(kTextPath, std::ios::binary);
  std::ostringstream content;
  content << stream.rdbuf();
  return std::move(content).str();
}

void report(benchmark::State& state, size_t text_bytes, size_t token_count) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text_bytes));
  state.counters["tokens"] = static_cast<double>(token_count);
  state.counters["tokens/s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * token_count), benchmark::Counter::kIsRate);
}

// Steady state: the per-word merge cache is filled by the first iteration.
void BM_EncodeWikiText2(benchmark::State& state) {
  const std::string text = read_text();
  const quantmla::Tokenizer tokenizer = quantmla::Tokenizer::from_model_dir(kModelDir);
  size_t token_count = 0;
  for (auto _ : state) {
    const std::vector<int32_t> ids = tokenizer.encode(text);
    token_count = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  report(state, text.size(), token_count);
}
BENCHMARK(BM_EncodeWikiText2)->Unit(benchmark::kMillisecond);

// First encode with a fresh tokenizer (empty cache): what a one-shot evaluation run pays.
void BM_EncodeWikiText2ColdCache(benchmark::State& state) {
  const std::string text = read_text();
  size_t token_count = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const quantmla::Tokenizer tokenizer = quantmla::Tokenizer::from_model_dir(kModelDir);
    state.ResumeTiming();
    const std::vector<int32_t> ids = tokenizer.encode(text);
    token_count = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  report(state, text.size(), token_count);
}
BENCHMARK(BM_EncodeWikiText2ColdCache)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
