// skinny_gemm on DeepSeek-V2-Lite's decode shapes (hidden 2048) for m = 1, 4, 16, 64 rows (and
// 256 for the routed experts, where 32-row tiles are chosen and timed beside 16-row ones): the
// time, the weight bandwidth (bytes of the weights touched over the time) against the
// device-to-device copy bandwidth measured in the same run, and cuBLASLt (GemmRunner::linear) on
// the same dense product (kSiluMul: one linear over the stacked [2n, k] gate and up weights, no
// activation; grouped: one linear per expert with rows, as moe_expert_mlps does).
//
// Timing: CUDA events around one launch, the L2 flushed before each repeat by writing a 256 MB
// buffer and reading it back (a write alone leaves the L2 full of dirty lines, and the timed
// kernel would pay for writing them back: 60 MB, as much as a whole expert layer reads), median
// of the repeats after 3 warm-ups. "floor" is an empty kernel timed the same way (the launch).
// Routing: m = 1 puts its 6 slots on 6 distinct experts; larger m picks 6 distinct experts per
// token at random (seeded). --sweep also times every tiling (16- and 32-row tiles where a group
// has more than 8 rows on average) and prints the best (to tune skinny_gemm_tiling); --only NAME
// keeps the shapes whose name contains NAME, --ms 64,256 sets the row counts.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/skinny_gemm.h"
#include "quantmla/gpu_mla.h"

namespace {

using namespace quantmla;
using gpu::DeviceArray;

void fill_random(DeviceArray<uint16_t>& a, uint64_t seed) {
  bench::random_bf16<<<1024, 256>>>(a.data(), static_cast<int64_t>(a.size()), 0.05f, seed);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

__global__ void nothing() {}

struct Shape {
  const char* name;
  int64_t n, k;
  bool silu;
  bool experts;  // 64 routed experts, 6 per token
};

struct Row {
  std::string shape;
  int m;
  gpu::SkinnyTiling tiling;
  double us, weight_mb, gbps, cublas_us, best_us;
  gpu::SkinnyTiling best;
  double one_mma_tile_us = 0;  // m_tiles 2: the same tiling with 16-row tiles
  std::vector<std::pair<gpu::SkinnyTiling, double>> sweep;
};

constexpr int kExperts = 64, kPerToken = 6;

// Expert rows of m tokens: counts per expert and the tokens in expert order (token_of_slot).
void route(int m, std::mt19937& rng, std::vector<int32_t>& offsets, std::vector<int32_t>& tokens) {
  std::vector<std::vector<int32_t>> of_expert(kExperts);
  std::vector<int> order(kExperts);
  std::iota(order.begin(), order.end(), 0);
  for (int t = 0; t < m; ++t) {
    std::shuffle(order.begin(), order.end(), rng);
    for (int j = 0; j < kPerToken; ++j) of_expert[order[j]].push_back(t);
  }
  offsets.assign(kExperts + 1, 0);
  tokens.clear();
  for (int e = 0; e < kExperts; ++e) {
    offsets[e + 1] = offsets[e] + static_cast<int32_t>(of_expert[e].size());
    tokens.insert(tokens.end(), of_expert[e].begin(), of_expert[e].end());
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  bool sweep = false;
  int repeats = 20;
  std::string only;
  std::vector<int> ms = {1, 4, 16, 64, 256};  // 256 for the routed experts only (a serving batch)
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--sweep")) {
      sweep = true;
    } else if (!std::strcmp(argv[i], "--repeats") && i + 1 < argc) {
      repeats = std::max(1, std::stoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];
    } else if (!std::strcmp(argv[i], "--ms") && i + 1 < argc) {
      ms.clear();
      std::stringstream list(argv[++i]);
      for (std::string item; std::getline(list, item, ',');) {
        const int m = std::atoi(item.c_str());
        if (m < 1) {
          std::fprintf(stderr, "--ms: \"%s\" is not a row count >= 1\n", item.c_str());
          return 2;
        }
        ms.push_back(m);
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--json FILE] [--sweep] [--repeats N] [--only NAME] [--ms M,M,...]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!gpu::device_available()) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  try {
    cudaDeviceProp prop{};
    QUANTMLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    DeviceArray<uint8_t> flush(size_t{256} << 20);
    double copy_gbps = 0;
    {
      const size_t bytes = size_t{1} << 30;
      DeviceArray<uint8_t> a(bytes), b(bytes);
      a.fill_bytes(1);
      const double us = bench::median_us_flushed(
          [&] {
            QUANTMLA_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDefault));
          },
          flush, 10);
      copy_gbps = 2.0 * static_cast<double>(bytes) / (us * 1e3);  // read + write
    }
    const double floor_us = bench::median_us_flushed([] { nothing<<<1, 32>>>(); }, flush, repeats);
    std::printf("%s, %d SMs; copy bandwidth %.0f GB/s (read + write); floor %.2f us\n", prop.name,
                prop.multiProcessorCount, copy_gbps, floor_us);

    const Shape shapes[] = {
        {"q_proj", 3072, 2048, false, false},        {"kv_a_proj", 576, 2048, false, false},
        {"o_proj", 2048, 2048, false, false},        {"shared gate+up", 2816, 2048, true, false},
        {"shared down", 2048, 2816, false, false},   {"lm_head", 102400, 2048, false, false},
        {"experts gate+up", 1408, 2048, true, true}, {"experts down", 2048, 1408, false, true},
    };
    gpu::GemmRunner gemm;
    std::mt19937 rng(1234);
    std::vector<Row> rows;
    std::printf("%-16s %3s %9s %9s %9s %7s %10s %9s%s\n", "shape", "m", "tiling", "us", "GB/s",
                "% copy", "cuBLAS us", "speed-up", sweep ? "   best tiling" : "");
    for (const Shape& s : shapes) {
      if (!only.empty() && std::string(s.name).find(only) == std::string::npos) continue;
      const int copies = s.experts ? kExperts : 1;
      const auto matrix = static_cast<size_t>(s.n * s.k);
      // Gate and up of one matrix next to each other ([2n, k]), so cuBLAS reads the same bytes.
      const size_t per_copy = matrix * (s.silu ? 2 : 1);
      DeviceArray<uint16_t> weights(per_copy * copies);
      fill_random(weights, 7);
      std::vector<const uint16_t*> gate(copies), up(copies);
      for (int e = 0; e < copies; ++e) {
        gate[e] = weights.data() + e * per_copy;
        up[e] = gate[e] + matrix;
      }
      DeviceArray<const uint16_t*> dgate(gate), dup(up);
      for (const int m : ms) {
        if (m > 64 && !s.experts) continue;
        std::vector<int32_t> offsets, tokens;
        const int64_t rows_total = s.experts ? int64_t{m} * kPerToken : m;
        if (s.experts) route(m, rng, offsets, tokens);
        const bool gathered = s.experts && s.silu;  // the gate/up read the tokens' hidden rows
        const int64_t x_rows = gathered ? m : rows_total;
        DeviceArray<uint16_t> x(static_cast<size_t>(x_rows * s.k));
        fill_random(x, 11);
        DeviceArray<int32_t> doffsets(offsets), dtokens(tokens);
        DeviceArray<uint8_t> y(static_cast<size_t>(rows_total * s.n * 4));
        DeviceArray<float> y_cublas(static_cast<size_t>(rows_total * s.n * (s.silu ? 2 : 1)));

        gpu::SkinnyGemmParams p;
        p.x = x.data(), p.ldx = s.k, p.x_rows = x_rows, p.max_rows = rows_total;
        p.row_index = gathered ? dtokens.data() : nullptr;
        if (s.experts) {
          p.offsets = doffsets.data(), p.groups = kExperts, p.w = dgate.data();
          p.w2 = s.silu ? dup.data() : nullptr;
        } else {
          p.weight = gate[0], p.weight2 = s.silu ? up[0] : nullptr;
        }
        p.n = s.n, p.k = s.k, p.y = y.data(), p.ldy = s.n;
        p.out_dtype = s.silu ? DType::kBF16 : DType::kF32;
        p.epilogue = s.silu ? gpu::SkinnyEpilogue::kSiluMul : gpu::SkinnyEpilogue::kStore;
        int touched = 1;
        if (s.experts) {
          touched = 0;
          for (int e = 0; e < kExperts; ++e) touched += offsets[e + 1] > offsets[e];
        }
        const double weight_bytes = static_cast<double>(per_copy) * 2 * touched;

        Row row{s.name, m, gpu::skinny_gemm_tiling(p), 0, weight_bytes / 1e6, 0, 0, 0, {}, 0, {}};
        row.us = bench::median_us_flushed([&] { gpu::skinny_gemm(p, nullptr); }, flush, repeats);
        row.gbps = weight_bytes / (row.us * 1e3);
        row.cublas_us = bench::median_us_flushed(
            [&] {
              if (!s.experts) {
                gemm.linear(m, s.n * (s.silu ? 2 : 1), s.k, x.data(), s.k, gate[0], s.k,
                            y_cublas.data(), s.n * (s.silu ? 2 : 1), DType::kF32, 0.0f, nullptr);
                return;
              }
              for (int e = 0; e < kExperts; ++e) {
                const int64_t count = offsets[e + 1] - offsets[e];
                if (count == 0) continue;
                // The expert's rows (gate/up: the first tokens stand in for moe_gather's copy).
                const uint16_t* rows_of_e = x.data() + (gathered ? 0 : offsets[e] * s.k);
                gemm.linear(count, s.n * (s.silu ? 2 : 1), s.k, rows_of_e, s.k, gate[e], s.k,
                            y_cublas.data() + offsets[e] * s.n * (s.silu ? 2 : 1),
                            s.n * (s.silu ? 2 : 1), DType::kF32, 0.0f, nullptr);
              }
            },
            flush, repeats);
        row.best_us = row.us, row.best = row.tiling;
        if (row.tiling.m_tiles > 1) {  // the same tiling with 16-row tiles, for the comparison
          gpu::SkinnyTiling t = row.tiling;
          t.m_tiles = 1;
          row.one_mma_tile_us =
              bench::median_us_flushed([&] { gpu::skinny_gemm(p, t, nullptr); }, flush, repeats);
        }
        if (sweep) {
          const int most_m_tiles = rows_total > 16 * (s.experts ? kExperts : 1) / 2 ? 2 : 1;
          for (int m_tiles = 1; m_tiles <= most_m_tiles; ++m_tiles) {
            for (const int tile_n : {8, 16, 32, 64}) {
              for (const int warps : {1, 2, 3, 4, 6, 8}) {
                const gpu::SkinnyTiling t{tile_n, warps, m_tiles};
                try {
                  const double us =
                      bench::median_us_flushed([&] { gpu::skinny_gemm(p, t, nullptr); }, flush, 7);
                  row.sweep.emplace_back(t, us);
                  if (us < row.best_us) row.best_us = us, row.best = t;
                } catch (const InvalidArgument&) {  // more warps than the shared memory holds
                }
              }
            }
          }
        }
        std::printf("%-16s %3d %5d x %d %9.2f %9.0f %6.0f%% %10.2f %8.2fx", s.name, m,
                    row.tiling.tile_n, row.tiling.warps, row.us, row.gbps,
                    100.0 * row.gbps / copy_gbps, row.cublas_us, row.cublas_us / row.us);
        if (sweep) {
          std::printf("   %d x %d (%d-row) %.2f us", row.best.tile_n, row.best.warps,
                      16 * row.best.m_tiles, row.best_us);
        }
        if (row.tiling.m_tiles > 1) {
          std::printf("   (32-row tiles; 16-row: %.2f us)", row.one_mma_tile_us);
        }
        std::printf("\n");
        rows.push_back(row);
      }
    }
    if (!json_path.empty()) {
      FILE* f = std::fopen(json_path.c_str(), "w");
      if (f == nullptr) throw IoError("cannot write " + json_path);
      std::fprintf(f, "{\n  \"card\": \"%s\",\n  \"sms\": %d,\n  \"copy_gbps\": %.1f,\n", prop.name,
                   prop.multiProcessorCount, copy_gbps);
      std::fprintf(f, "  \"floor_us\": %.3f,\n", floor_us);
      std::fprintf(f, "  \"repeats\": %d,\n  \"rows\": [\n", repeats);
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        std::fprintf(f,
                     "    {\"shape\": \"%s\", \"m\": %d, \"tile_n\": %d, \"warps\": %d, "
                     "\"m_tiles\": %d, \"us\": %.3f, \"us_16_row_tiles\": %.3f, \"weight_mb\": "
                     "%.3f, \"gbps\": %.1f, \"cublas_us\": %.3f, \"best_tile_n\": %d, "
                     "\"best_warps\": %d, \"best_m_tiles\": %d, \"best_us\": %.3f, \"sweep\": [",
                     r.shape.c_str(), r.m, r.tiling.tile_n, r.tiling.warps, r.tiling.m_tiles, r.us,
                     r.tiling.m_tiles > 1 ? r.one_mma_tile_us : r.us, r.weight_mb, r.gbps,
                     r.cublas_us, r.best.tile_n, r.best.warps, r.best.m_tiles, r.best_us);
        for (size_t j = 0; j < r.sweep.size(); ++j) {
          std::fprintf(f, "%s[%d, %d, %d, %.3f]", j ? ", " : "", r.sweep[j].first.tile_n,
                       r.sweep[j].first.warps, r.sweep[j].first.m_tiles, r.sweep[j].second);
        }
        std::fprintf(f, "]}%s\n", i + 1 < rows.size() ? "," : "");
      }
      std::fprintf(f, "  ]\n}\n");
      std::fclose(f);
      std::printf("wrote %s\n", json_path.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
