// Cache codec throughput: encode_path and decode_path of 512-wide content rows in each path format
// (what every cache write and every CPU cache read does): 1024 different rows of random normal
// values in turn, so that the branch predictor cannot learn one row's pattern.
//   build/bench/bench_codecs [--benchmark_format=json]
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "quantmla/cache_format.h"

namespace {

constexpr int64_t kWidth = 512;
constexpr int64_t kRows = 1024;
const char* const kFormats[] = {"bf16", "fp8", "int8:g64", "int4:g64", "int4:g128", "int2:g64"};

std::vector<float> random_rows(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> rows(kRows * kWidth);
  for (float& v : rows) v = normal(rng);
  return rows;
}

void BM_Encode(benchmark::State& state, const std::string& spec) {
  const quantmla::PathFormat format = quantmla::PathFormat::parse(spec);
  const std::vector<float> rows = random_rows(1);
  const int64_t bytes = format.encoded_bytes(kWidth);
  std::vector<uint8_t> records(static_cast<size_t>(kRows * bytes));
  int64_t r = 0;
  for (auto _ : state) {
    quantmla::encode_path(format, rows.data() + r * kWidth, kWidth, records.data() + r * bytes);
    benchmark::DoNotOptimize(records.data());
    r = (r + 1) % kRows;
  }
  state.counters["values/s"] = benchmark::Counter(static_cast<double>(state.iterations() * kWidth),
                                                  benchmark::Counter::kIsRate);
}

void BM_Decode(benchmark::State& state, const std::string& spec) {
  const quantmla::PathFormat format = quantmla::PathFormat::parse(spec);
  const std::vector<float> rows = random_rows(2);
  const int64_t bytes = format.encoded_bytes(kWidth);
  std::vector<uint8_t> records(static_cast<size_t>(kRows * bytes));
  for (int64_t r = 0; r < kRows; ++r) {
    quantmla::encode_path(format, rows.data() + r * kWidth, kWidth, records.data() + r * bytes);
  }
  std::vector<float> out(kWidth);
  int64_t r = 0;
  for (auto _ : state) {
    quantmla::decode_path(format, records.data() + r * bytes, kWidth, out.data());
    benchmark::DoNotOptimize(out.data());
    r = (r + 1) % kRows;
  }
  state.counters["values/s"] = benchmark::Counter(static_cast<double>(state.iterations() * kWidth),
                                                  benchmark::Counter::kIsRate);
}

const bool registered = [] {
  for (const char* spec : kFormats) {
    benchmark::RegisterBenchmark((std::string("BM_Encode/") + spec).c_str(), BM_Encode, spec);
    benchmark::RegisterBenchmark((std::string("BM_Decode/") + spec).c_str(), BM_Decode, spec);
  }
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
