// prefill_attention (the expanded-form flash kernel, prefill_attention.h) on DeepSeek-V2-Lite's
// attention shape (16 heads, nope = v = 128, rope 64, rank 512): chunks of 512-4096 queries after
// cached prefixes. Per shape: the whole call (the kv_b up-projection plus the attention kernel),
// the up-projection alone (prefill_attention_projection), and the attention kernel's share with its
// causal FLOP rate (2 (nope + rope + v) per visible query-key pair and head).
//
// Timing: CUDA events around one call, median of the repeats after 3 warm-ups. The inputs
// (a few hundred MB at most) are rewritten by nothing between repeats: the kernel is bound by
// its arithmetic, not by DRAM, so the L2 is not flushed.
//   bench_prefill_attention [--json FILE] [--repeats N]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/prefill_attention.h"
#include "quantmla/gpu_mla.h"

namespace {

using namespace quantmla;
using gpu::DeviceArray;

constexpr int kHeads = 16, kNope = 128, kRope = 64, kV = 128, kRank = 512;

struct Row {
  int64_t tokens, context;
  double total_us, projection_us, attention_us, attention_tflops;
};

template <class F>
double time_us(F&& f, int repeats) {
  return bench::median_us(f, repeats, [](int) {});
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  int repeats = 20;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json_path = argv[++i];
    } else if (std::strcmp(argv[i], "--repeats") == 0 && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--json FILE] [--repeats N]\n", argv[0]);
      return 2;
    }
  }
  try {
    if (!gpu::device_available()) {
      std::printf("no CUDA device: nothing to time\n");
      return 77;
    }
    cudaDeviceProp prop{};
    QUANTMLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const int64_t max_context = 8192, max_tokens = 4096;
    constexpr int kQk = kNope + kRope, kRow = kRank + kRope;
    DeviceArray<uint16_t> q(static_cast<size_t>(max_tokens * kHeads * kQk));
    DeviceArray<uint16_t> keys(static_cast<size_t>(max_context * kRow));
    DeviceArray<uint16_t> kv_b(static_cast<size_t>(kHeads * (kNope + kV) * kRank));
    DeviceArray<uint16_t> out(static_cast<size_t>(max_tokens * kHeads * kV));
    bench::random_bf16<<<bench::fill_blocks(q.size()), 256>>>(q.data(), q.size(), 1.0f, 1);
    bench::random_bf16<<<bench::fill_blocks(keys.size()), 256>>>(keys.data(), keys.size(), 1.0f, 2);
    bench::random_bf16<<<bench::fill_blocks(kv_b.size()), 256>>>(kv_b.data(), kv_b.size(), 0.044f,
                                                                 3);
    QUANTMLA_CUDA_CHECK_LAUNCH();
    const size_t bytes = gpu::PrefillAttentionWorkspace::bytes_for(kHeads, kNope, kV, max_context);
    DeviceArray<uint8_t> workspace(bytes);
    gpu::GemmRunner gemm;
    std::printf("%s: prefill attention, %d heads, nope %d, rope %d, v %d\n", prop.name, kHeads,
                kNope, kRope, kV);
    std::printf("%8s %8s %10s %10s %10s %10s\n", "queries", "context", "total us", "kv_b us",
                "attn us", "attn TF/s");
    std::vector<Row> rows;
    const int64_t shapes[][2] = {{512, 512}, {2048, 2048}, {2048, 8192}, {4096, 4096}};
    for (const auto& shape : shapes) {
      const int64_t tokens = shape[0], context = shape[1];
      gpu::PrefillAttentionParams p;
      p.q = q.data();
      p.keys = keys.data();
      p.keys_stride = kRow;
      p.kv_b = kv_b.data();
      p.out = out.data();
      p.out_stride = kHeads * kV;
      p.tokens = tokens;
      p.context = context;
      p.heads = kHeads;
      p.nope = kNope, p.rope = kRope, p.v = kV, p.rank = kRank;
      p.softmax_scale = 0.0723f;
      const gpu::PrefillAttentionWorkspace w{workspace.data(), bytes, max_context};
      const double projection =
          time_us([&] { gpu::prefill_attention_projection(gemm, p, w, nullptr); }, repeats);
      const double total = time_us([&] { gpu::prefill_attention(gemm, p, w, nullptr); }, repeats);
      // Visible pairs: query t (at position context - tokens + t) sees that many + 1 keys.
      const double pairs = static_cast<double>(tokens) * (context - tokens) +
                           static_cast<double>(tokens) * (tokens + 1) / 2;
      const double flops = 2.0 * kHeads * (kQk + kV) * pairs;
      const Row row{tokens,
                    context,
                    total,
                    projection,
                    total - projection,
                    flops / ((total - projection) * 1e-6) / 1e12};
      std::printf("%8lld %8lld %10.1f %10.1f %10.1f %10.0f\n", static_cast<long long>(tokens),
                  static_cast<long long>(context), row.total_us, row.projection_us,
                  row.attention_us, row.attention_tflops);
      rows.push_back(row);
    }
    if (!json_path.empty()) {
      std::ofstream f(json_path);
      f << "{\n  \"device\": \"" << prop.name << "\",\n  \"heads\": " << kHeads
        << ",\n  \"rows\": [\n";
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        f << "    {\"tokens\": " << r.tokens << ", \"context\": " << r.context
          << ", \"total_us\": " << r.total_us << ", \"projection_us\": " << r.projection_us
          << ", \"attention_us\": " << r.attention_us
          << ", \"attention_tflops\": " << r.attention_tflops << "}"
          << (i + 1 < rows.size() ? ",\n" : "\n");
      }
      f << "  ]\n}\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_prefill_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
