// End-to-end CPU speed of the engine next to the machine's own sgemm rate, measured in one run:
//   prefill tokens/s and achieved GFLOP/s at a 1024-token context,
//   decode tokens/s (batch 1): each step attends over ctx keys (ctx - 1 cached + itself),
//   OpenBLAS sgemm GFLOP/s at the shapes prefill uses.
// Usage: bench_model [--model DIR] [--ctx N] [--repeats R] [--json FILE]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "quantmla/model.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Timing {
  double median, min, max;  // seconds
};

// `repeats` timed runs after one warm-up run.
Timing time_runs(int repeats, const std::function<void()>& run) {
  run();
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    run();
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return {times[times.size() / 2], times.front(), times.back()};
}

double sgemm_gflops(int64_t m, int64_t n, int64_t k, int repeats) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> a(m * k), b(n * k), c(m * n);
  for (float& v : a) v = uniform(rng);
  for (float& v : b) v = uniform(rng);
  const double seconds = time_runs(repeats, [&] {
                           cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f,
                                       a.data(), k, b.data(), k, 0.0f, c.data(), n);
                         }).median;
  return 2.0 * m * n * k / seconds / 1e9;
}

// FLOPs of one forward over positions [pos0, pos0 + n): 2 per weight of every matrix a token
// passes through (MoE: the routed experts it uses), plus the absorbed attention the engine runs.
double forward_flops(const quantmla::ModelConfig& c, int64_t pos0, int64_t n) {
  const double d = c.hidden_size, heads = c.num_heads, rank = c.kv_lora_rank;
  const double rope = c.qk_rope_head_dim, nope = c.qk_nope_head_dim, v = c.v_head_dim;
  double per_token = 0.0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const double q = c.q_lora_rank > 0 ? d * c.q_lora_rank + c.q_lora_rank * heads * (nope + rope)
                                       : d * heads * (nope + rope);
    const double kv_a = d * (rank + rope);
    const double absorb = heads * (nope + v) * rank;  // W_UK on queries, W_UV on outputs
    const double o = heads * v * d;
    const double mlp = c.is_moe_layer(l) ? 3.0 * d * c.moe_intermediate_size *
                                                   (c.num_experts_per_tok + c.n_shared_experts) +
                                               d * c.n_routed_experts
                                         : 3.0 * d * c.intermediate_size;
    per_token += q + kv_a + absorb + o + mlp;
  }
  per_token += d * c.vocab_size;  // lm_head
  double flops = 2.0 * per_token * n;
  // Attention: position t sees t + 1 keys; per key and head 576 MACs of scores + 512 of values.
  for (int64_t t = pos0; t < pos0 + n; ++t) {
    flops += 2.0 * c.num_layers * heads * (t + 1) * (rank + rope + rank);
  }
  return flops;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = QUANTMLA_SOURCE_DIR "/models/mla-tiny";
  std::string json_path;
  int64_t ctx = 1024;
  int repeats = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--model" && i + 1 < argc)
      model_dir = argv[++i];
    else if (arg == "--ctx" && i + 1 < argc)
      ctx = std::stoll(argv[++i]);
    else if (arg == "--repeats" && i + 1 < argc)
      repeats = std::stoi(argv[++i]);
    else if (arg == "--json" && i + 1 < argc)
      json_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--model DIR] [--ctx N] [--repeats R] [--json FILE]\n",
                   argv[0]);
      return 2;
    }
  }
  try {
    const quantmla::Model model = quantmla::Model::load(model_dir);
    const quantmla::ModelConfig& c = model.config();
    std::mt19937 rng(7);
    std::uniform_int_distribution<int32_t> token(2, static_cast<int32_t>(c.vocab_size - 1));
    std::vector<int32_t> ids(ctx);
    for (int32_t& id : ids) id = token(rng);

    // sgemm at the shape of the largest prefill matmuls (tokens x hidden -> intermediate).
    const double gemm = sgemm_gflops(ctx, c.intermediate_size, c.hidden_size, repeats);

    auto cache = model.make_cache(ctx + 1);
    std::vector<float> all_logits(ctx * c.vocab_size);
    const Timing prefill = time_runs(repeats, [&] {
      cache->set_length(0);
      model.forward(ids, *cache, all_logits);
    });
    const double prefill_s = prefill.median;
    const double prefill_flops = forward_flops(c, 0, ctx);

    // Decode: the cache holds ctx - 1 tokens, each step appends one and then rewinds.
    std::vector<float> last_logits(c.vocab_size);
    cache->set_length(0);
    model.forward(std::span<const int32_t>(ids.data(), ctx - 1), *cache,
                  std::span<float>(all_logits.data(), (ctx - 1) * c.vocab_size));
    constexpr int kDecodeSteps = 32;
    const Timing decode = time_runs(3 * repeats, [&] {
      for (int step = 0; step < kDecodeSteps; ++step) {
        cache->set_length(ctx - 1);
        model.forward(std::span<const int32_t>(&ids[step], 1), *cache, last_logits, false);
      }
    });
    const double decode_s = decode.median / kDecodeSteps;

    const double prefill_gflops = prefill_flops / prefill_s / 1e9;
    std::printf(
        "model %s, ctx %lld, median of %d repeats (decode: 3x, 32 steps each) after warm-up\n",
        model_dir.c_str(), static_cast<long long>(ctx), repeats);
    std::printf("%-34s %12s %12s\n", "measure", "value", "unit");
    std::printf("%-34s %12.1f %12s\n", "sgemm (OpenBLAS)", gemm, "GFLOP/s");
    std::printf("%-34s %12.1f %12s\n", "prefill", ctx / prefill_s, "tokens/s");
    std::printf("%-34s %12.1f %12s\n", "prefill", prefill_gflops, "GFLOP/s");
    std::printf("%-34s %12.1f %12s\n", "prefill / sgemm", 100.0 * prefill_gflops / gemm, "%");
    std::printf("%-34s %12.1f %12s\n", "decode (batch 1)", 1.0 / decode_s, "tokens/s");
    std::printf("%-34s %5.1f .. %5.1f %12s\n", "decode, slowest .. fastest repeat",
                kDecodeSteps / decode.max, kDecodeSteps / decode.min, "tokens/s");
    std::printf("%-34s %12.2f %12s\n", "decode step", decode_s * 1e3, "ms");
    if (!json_path.empty()) {
      const nlohmann::json out = {{"model", model_dir},
                                  {"ctx", ctx},
                                  {"repeats", repeats},
                                  {"sgemm_gflops", gemm},
                                  {"prefill_tokens_per_s", ctx / prefill_s},
                                  {"prefill_gflops", prefill_gflops},
                                  {"prefill_fraction_of_sgemm", prefill_gflops / gemm},
                                  {"decode_tokens_per_s", 1.0 / decode_s},
                                  {"decode_tokens_per_s_min", kDecodeSteps / decode.max},
                                  {"decode_tokens_per_s_max", kDecodeSteps / decode.min}};
      std::ofstream(json_path) << out.dump(2) << "\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
