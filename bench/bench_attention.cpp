// Decode attention over a long cache in each format: one query, H heads, the cache filled with
// random rows. Reports the median time of one attention call, the bytes of cache it reads
// (records of every visible token) and the effective GB/s.
// Usage: bench_attention [--keys N] [--repeats R] [--json FILE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "quantmla/cache.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Measurement {
  std::string format;
  int64_t heads;
  double seconds;
  double bytes;
};

Measurement measure(const std::string& spec, int64_t heads, int64_t keys, int repeats) {
  const quantmla::CacheShape shape{1, 512, 64};
  const quantmla::CacheFormat format = quantmla::CacheFormat::parse(spec);
  auto cache = quantmla::make_cache(shape, format, keys);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int64_t kChunk = 1024;
  std::vector<float> c(kChunk * 512), k_pe(kChunk * 64);
  for (int64_t pos = 0; pos < keys; pos += kChunk) {
    const int64_t n = std::min(kChunk, keys - pos);
    for (float& v : c) v = normal(rng);
    for (float& v : k_pe) v = normal(rng);
    cache->write(0, pos, n, c.data(), k_pe.data());
    cache->set_length(pos + n);
  }
  std::vector<float> q(heads * 576), out(heads * 512), lse(heads);
  for (float& v : q) v = normal(rng) * 0.05f;
  const quantmla::CacheQuery query{q.data(), 1, heads, keys - 1, 0.0722f};
  cache->attend(0, query, out.data(), lse.data());  // warm-up
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    cache->attend(0, query, out.data(), lse.data());
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return {format.to_string(), heads, times[times.size() / 2],
          static_cast<double>(keys) * static_cast<double>(cache->bytes_per_token_per_layer())};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t keys = 32 * 1024;
  int repeats = 7;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--keys" && i + 1 < argc)
      keys = std::stoll(argv[++i]);
    else if (arg == "--repeats" && i + 1 < argc)
      repeats = std::stoi(argv[++i]);
    else if (arg == "--json" && i + 1 < argc)
      json_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--keys N] [--repeats R] [--json FILE]\n", argv[0]);
      return 2;
    }
  }
  const char* formats[] = {"f32", "bf16", "content=int4:g64,rope=int4:g64",
                           "content=int2:g64,rope=int4:g64"};
  std::printf("decode attention, 1 query, %lld keys, median of %d calls after warm-up\n",
              static_cast<long long>(keys), repeats);
  std::printf("%-34s %5s %10s %10s %8s\n", "format", "heads", "ms", "MB read", "GB/s");
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t heads : {8, 16}) {
    for (const char* spec : formats) {
      const Measurement m = measure(spec, heads, keys, repeats);
      std::printf("%-34s %5lld %10.3f %10.2f %8.2f\n", m.format.c_str(),
                  static_cast<long long>(heads), m.seconds * 1e3, m.bytes / 1e6,
                  m.bytes / m.seconds / 1e9);
      rows.push_back({{"format", m.format},
                      {"heads", heads},
                      {"keys", keys},
                      {"ms", m.seconds * 1e3},
                      {"bytes", m.bytes},
                      {"gb_per_s", m.bytes / m.seconds / 1e9}});
    }
  }
  if (!json_path.empty()) std::ofstream(json_path) << rows.dump(2) << "\n";
  return 0;
}
