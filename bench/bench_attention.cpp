// Decode attention over a long cache in each format: one query, H heads, the cache filled with
// random rows. Reports the median time of one attention call, the bytes of cache it reads
// (records of every visible token) and the effective GB/s.
// Usage: bench_attention [--keys N] [--repeats R] [--json FILE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
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

// A one-layer cache of `keys` random rows in `spec`, and a query that attends over all of them.
struct Setup {
  std::string format;
  std::unique_ptr<quantmla::MlaCache> cache;
  std::vector<float> q, out, lse;
};

Setup make_setup(const std::string& spec, int64_t heads, int64_t keys) {
  const quantmla::CacheShape shape{1, 512, 64};
  const quantmla::CacheFormat format = quantmla::CacheFormat::parse(spec);
  Setup setup{format.to_string(), quantmla::make_cache(shape, format, keys), {}, {}, {}};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int64_t kChunk = 1024;
  std::vector<float> c(kChunk * 512), k_pe(kChunk * 64);
  for (int64_t pos = 0; pos < keys; pos += kChunk) {
    const int64_t n = std::min(kChunk, keys - pos);
    for (float& v : c) v = normal(rng);
    for (float& v : k_pe) v = normal(rng);
    setup.cache->write(0, pos, n, c.data(), k_pe.data());
    setup.cache->set_length(pos + n);
  }
  setup.q.resize(heads * 576);
  setup.out.resize(heads * 512);
  setup.lse.resize(heads);
  for (float& v : setup.q) v = normal(rng) * 0.05f;
  return setup;
}

// Every format is timed in the same rounds, one call each per round in a rotating order, so that
// drifts of a shared machine hit all of them alike and their ratios stay meaningful.
std::vector<Measurement> measure(const std::vector<std::string>& specs, int64_t heads, int64_t keys,
                                 int repeats) {
  std::vector<Setup> setups;
  for (const std::string& spec : specs) setups.push_back(make_setup(spec, heads, keys));
  std::vector<std::vector<double>> times(setups.size());
  for (int r = -1; r < repeats; ++r) {  // round -1 warms up
    for (size_t i = 0; i < setups.size(); ++i) {
      Setup& s = setups[(i + static_cast<size_t>(r + 1)) % setups.size()];
      const quantmla::CacheQuery query{s.q.data(), 1, heads, keys - 1, 0.0722f};
      const auto start = Clock::now();
      s.cache->attend(0, query, s.out.data(), s.lse.data());
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      if (r >= 0) times[(i + static_cast<size_t>(r + 1)) % setups.size()].push_back(seconds);
    }
  }
  std::vector<Measurement> result;
  for (size_t i = 0; i < setups.size(); ++i) {
    std::sort(times[i].begin(), times[i].end());
    result.push_back({setups[i].format, heads, times[i][times[i].size() / 2],
                      static_cast<double>(keys) *
                          static_cast<double>(setups[i].cache->bytes_per_token_per_layer())});
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t keys = 32 * 1024;
  int repeats = 21;
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
  const std::vector<std::string> formats = {"f32", "bf16", "content=int4:g64,rope=int4:g64",
                                            "content=int2:g64,rope=int4:g64"};
  std::printf("decode attention, 1 query, %lld keys, median of %d interleaved calls\n",
              static_cast<long long>(keys), repeats);
  std::printf("%-34s %5s %10s %10s %8s %9s\n", "format", "heads", "ms", "MB read", "GB/s",
              "vs bf16");
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t heads : {8, 16}) {
    const std::vector<Measurement> measured = measure(formats, heads, keys, repeats);
    const double bf16_seconds = measured[1].seconds;
    for (const Measurement& m : measured) {
      std::printf("%-34s %5lld %10.3f %10.2f %8.2f %8.2fx\n", m.format.c_str(),
                  static_cast<long long>(heads), m.seconds * 1e3, m.bytes / 1e6,
                  m.bytes / m.seconds / 1e9, bf16_seconds / m.seconds);
      rows.push_back({{"format", m.format},
                      {"heads", heads},
                      {"keys", keys},
                      {"ms", m.seconds * 1e3},
                      {"bytes", m.bytes},
                      {"gb_per_s", m.bytes / m.seconds / 1e9},
                      {"speedup_vs_bf16", bf16_seconds / m.seconds}});
    }
  }
  if (!json_path.empty()) std::ofstream(json_path) << rows.dump(2) << "\n";
  return 0;
}
