// The products of a DeepSeek-V2-Lite prefill step of T tokens (default 2048) on cuBLASLt, to see
// what is left in them: each product with the heuristic's first algorithm, the best of its first
// 8 candidates, and the best of those that sum k in one pass (no split-K or stream-K: what
// GemmRunner's tuning chooses among, docs/gpu-kernels.md); the routed experts as the runner runs
// them at prefill (every expert's rows padded to the busiest one's, one strided-batched product).
// FP32 and BF16 outputs, and the activation between them; and expert_gemm (ours) on the exact
// rows, plain and gated (the activation included), for each depth of its operand ring, and gated
// over the padded layout's real rows (the runner's ExpertProducts::kOursGated); and
// cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx) on the exact rows, one group an expert, with
// FP32 and BF16 outputs (a type combination it does not support prints its status). Then how the
// padded products' time follows the rows an expert (every expert given 176 to 256 rows), and
// silu_mul with the padding rows skipped. The "phases" rows: where a block of expert_gemm spends
// its time (ExpertGemmParams::phases: its first stage, its products, its epilogue) and how busy
// the SMs were over the kernel's span.
//
// --only TEXT runs the rows whose name contains TEXT (bench/gpu/profile-prefill-gemms.sh profiles
// one kernel that way).
//
// Timing: CUDA events around one call, the L2 flushed before each repeat (256 MB written and read
// back), median of the repeats after 3 warm-ups. Routing: top-6 of 64 experts per token from
// logits = expert bias (normal, sd --skew) + Gumbel noise, seeded: the busiest expert's rows are
// printed.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/expert_gemm.h"
#include "kernels/cuda/gemm_algorithm.h"
#include "kernels/cuda/model_ops.h"
#include "quantmla/gpu_mla.h"

namespace {

using namespace quantmla;
using gpu::DeviceArray;

void fill(DeviceArray<uint16_t>& a, uint64_t seed) {
  bench::random_bf16<<<bench::fill_blocks(static_cast<int64_t>(a.size())), 256>>>(
      a.data(), static_cast<int64_t>(a.size()), 0.05f, seed);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

// Row-major y[m, n] = x[m, k] W[n, k]^T (+ beta y) as cuBLASLt's column-major
// y^T = W x^T, batch copies `stride` elements apart, with the heuristic's candidate algorithms.
struct LtProduct {
  cublasLtMatmulDesc_t desc{};
  cublasLtMatrixLayout_t a{}, b{}, c{};
  cublasLtMatmulHeuristicResult_t algos[8] = {};
  size_t count = 0;

  LtProduct(cublasLtHandle_t lt, int64_t m, int64_t n, int64_t k, int64_t batch, int64_t stride_x,
            int64_t stride_w, int64_t stride_y, cudaDataType_t out, size_t workspace_bytes) {
    QUANTMLA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    QUANTMLA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    QUANTMLA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt)));
    layout(&a, CUDA_R_16BF, k, n, k, batch, stride_w);
    layout(&b, CUDA_R_16BF, k, m, k, batch, stride_x);
    layout(&c, out, n, m, n, batch, stride_y);
    cublasLtMatmulPreference_t pref{};
    QUANTMLA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = workspace_bytes;
    QUANTMLA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    int returned = 0;
    QUANTMLA_CUBLAS_CHECK(
        cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, c, c, pref, 8, algos, &returned));
    count = static_cast<size_t>(returned);
    cublasLtMatmulPreferenceDestroy(pref);
  }
  ~LtProduct() {
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatmulDescDestroy(desc);
  }
  static void layout(cublasLtMatrixLayout_t* l, cudaDataType_t type, int64_t rows, int64_t cols,
                     int64_t ld, int64_t batch, int64_t stride) {
    QUANTMLA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(l, type, rows, cols, ld));
    if (batch > 1) {
      const int32_t count = static_cast<int32_t>(batch);
      QUANTMLA_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                             &count, sizeof(count)));
      QUANTMLA_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
          *l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    }
  }
  void run(cublasLtHandle_t lt, size_t i, const void* w, const void* x, void* y, float beta,
           void* workspace, size_t workspace_bytes) const {
    const float alpha = 1.0f;
    QUANTMLA_CUBLAS_CHECK(cublasLtMatmul(lt, desc, &alpha, w, a, x, b, &beta, y, c, y, c,
                                         &algos[i].algo, workspace, workspace_bytes, nullptr));
  }
};

struct Result {
  std::string name;
  double flops = 0, first_us = 0, best_us = 0, single_pass_us = 0;
  size_t best = 0, candidates = 0;
};

// Expert counts of T tokens, top-6 of 64 by bias + Gumbel noise.
std::vector<int> route(int tokens, double skew, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, skew);
  std::uniform_real_distribution<double> uniform(1e-12, 1.0);
  std::vector<double> bias(64);
  for (double& b : bias) b = normal(rng);
  std::vector<int> counts(64, 0), order(64);
  std::vector<double> score(64);
  for (int t = 0; t < tokens; ++t) {
    for (int e = 0; e < 64; ++e) score[e] = bias[e] - std::log(-std::log(uniform(rng)));
    for (int e = 0; e < 64; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + 6, order.end(),
                      [&](int a, int b) { return score[a] > score[b]; });
    for (int j = 0; j < 6; ++j) ++counts[order[j]];
  }
  return counts;
}

}  // namespace

int main(int argc, char** argv) {
  int tokens = 2048, repeats = 20;
  double skew = 0.15;
  uint64_t seed = 1;
  std::string json_path, only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tokens" && i + 1 < argc) {
      tokens = std::max(16, std::stoi(argv[++i]));
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::max(1, std::stoi(argv[++i]));
    } else if (a == "--skew" && i + 1 < argc) {
      skew = std::stod(argv[++i]);
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::stoull(argv[++i]);
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: %s [--tokens T] [--repeats N] [--skew SD] [--seed S] [--json FILE] "
                   "[--only TEXT]\n",
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
    std::printf("%s; %d tokens, seed %llu\n", prop.name, tokens,
                static_cast<unsigned long long>(seed));
    DeviceArray<uint8_t> flush(size_t{256} << 20);
    const size_t ws_bytes = size_t{32} << 20;
    DeviceArray<uint8_t> workspace(ws_bytes);
    cublasLtHandle_t lt{};
    QUANTMLA_CUBLAS_CHECK(cublasLtCreate(&lt));
    std::vector<Result> results;
    // --only TEXT: the rows whose name contains TEXT (e.g. to profile one kernel).
    const auto wanted = [&](const std::string& name) {
      return only.empty() || name.find(only) != std::string::npos;
    };
    const auto print = [](const Result& r) {
      std::printf("%-36s %9.1f %6.0f %9.1f %6.0f %5zu/%-2zu %6.1f%% %9.1f %6.1f%%\n",
                  r.name.c_str(), r.first_us, r.flops / r.first_us * 1e-6, r.best_us,
                  r.flops / r.best_us * 1e-6, r.best, r.candidates,
                  100.0 * (r.first_us / r.best_us - 1.0), r.single_pass_us,
                  100.0 * (r.first_us / r.single_pass_us - 1.0));
    };
    std::printf("%-36s %9s %6s %9s %6s %8s %7s %9s %7s\n", "product (TF/s: useful work)",
                "first us", "TF/s", "best us", "TF/s", "best/of", "gain", "1-pass us", "gain");

    // Every candidate algorithm of one product, timed.
    const auto sweep = [&](const std::string& name, const LtProduct& p, const void* w,
                           const void* x, void* y, float beta, double flops) {
      Result r{name, flops};
      r.candidates = p.count;
      r.best_us = r.single_pass_us = 1e30;
      for (size_t i = 0; i < p.count; ++i) {
        const double us = bench::median_us_flushed(
            [&] { p.run(lt, i, w, x, y, beta, workspace.data(), ws_bytes); }, flush, repeats);
        if (i == 0) r.first_us = us;
        if (us < r.best_us) r.best_us = us, r.best = i;
        if ((i == 0 || gpu::sums_in_one_pass(p.algos[i].algo)) && us < r.single_pass_us) {
          r.single_pass_us = us;
        }
      }
      print(r);
      results.push_back(r);
    };

    // Dense products of one step (V2-Lite, hidden 2048).
    struct Dense {
      const char* name;
      int64_t n, k;
      float beta;
      bool bf16;
    };
    const Dense dense[] = {
        {"q+kv_a (3072+576)", 3648, 2048, 0.0f, false},
        {"router (64 experts)", 64, 2048, 0.0f, false},
        {"o_proj (+= x)", 2048, 2048, 1.0f, false},
        {"dense gate+up (2 x 10944)", 21888, 2048, 0.0f, false},
        {"dense gate+up (2 x 10944) bf16 out", 21888, 2048, 0.0f, true},
        {"dense down (+= x)", 2048, 10944, 1.0f, false},
        {"shared gate+up (2 x 2816)", 5632, 2048, 0.0f, false},
        {"shared gate+up (2 x 2816) bf16 out", 5632, 2048, 0.0f, true},
        {"shared down (+= x)", 2048, 2816, 1.0f, false},
    };
    for (const Dense& d : dense) {
      if (!wanted(d.name)) continue;
      DeviceArray<uint16_t> w(static_cast<size_t>(d.n * d.k)), x(static_cast<size_t>(tokens * d.k));
      fill(w, 3), fill(x, 5);
      DeviceArray<float> y(static_cast<size_t>(tokens * d.n));
      y.fill_bytes(0);
      LtProduct p(lt, tokens, d.n, d.k, 1, 0, 0, 0, d.bf16 ? CUDA_R_16BF : CUDA_R_32F, ws_bytes);
      sweep(d.name, p, w.data(), x.data(), y.data(), d.beta, 2.0 * tokens * d.n * d.k);
    }

    // The routed experts: 64 of them, stacked gate+up [2816, 2048] and down [2048, 1408].
    const std::vector<int> counts = route(tokens, skew, seed);
    const int busiest = *std::max_element(counts.begin(), counts.end());
    const int padded = (busiest + 15) / 16 * 16;
    const int64_t real_rows = int64_t{tokens} * 6;
    std::printf("routing: %lld expert rows, mean %.1f, busiest %d (padded to %d: %.1f%% padding)\n",
                static_cast<long long>(real_rows), real_rows / 64.0, busiest, padded,
                100.0 * (64.0 * padded / real_rows - 1.0));
    // The routed experts' two products, each with an FP32 and a BF16 output; every form below
    // (padded, grouped) runs these.
    struct Expert {
      const char* product;
      int64_t n, k;
      bool bf16;
      std::string name(const char* form) const {
        return std::string(product) + " " + form + (bf16 ? " bf16 out" : "");
      }
    };
    const Expert experts[] = {{"experts gate+up", 2816, 2048, false},
                              {"experts gate+up", 2816, 2048, true},
                              {"experts down", 2048, 1408, false},
                              {"experts down", 2048, 1408, true}};
    for (const Expert& ex : experts) {
      if (!wanted(ex.name("padded"))) continue;
      DeviceArray<uint16_t> w(static_cast<size_t>(64 * ex.n * ex.k));
      DeviceArray<uint16_t> x(static_cast<size_t>(64 * padded * ex.k));
      fill(w, 7), fill(x, 9);
      DeviceArray<float> y(static_cast<size_t>(64 * padded * ex.n));
      LtProduct p(lt, padded, ex.n, ex.k, 64, padded * ex.k, ex.n * ex.k, padded * ex.n,
                  ex.bf16 ? CUDA_R_16BF : CUDA_R_32F, ws_bytes);
      // TF/s of the useful rows only.
      sweep(ex.name("padded"), p, w.data(), x.data(), y.data(), 0.0f,
            2.0 * real_rows * ex.n * ex.k);
    }

    // How the padded products' time follows the rows an expert (cuBLAS's tiles): every expert
    // given the same rows, FP32 out, the TF/s of all rows multiplied.
    for (int rows = 176; rows <= 256; rows += 16) {
      for (const Expert& ex : experts) {
        const std::string name = std::string(ex.product) + " uniform " + std::to_string(rows);
        if (ex.bf16 || !wanted(name)) continue;
        DeviceArray<uint16_t> w(static_cast<size_t>(64 * ex.n * ex.k));
        DeviceArray<uint16_t> x(static_cast<size_t>(64 * rows * ex.k));
        fill(w, 7), fill(x, 9);
        DeviceArray<float> y(static_cast<size_t>(64 * rows * ex.n));
        LtProduct p(lt, rows, ex.n, ex.k, 64, rows * ex.k, ex.n * ex.k, rows * ex.n, CUDA_R_32F,
                    ws_bytes);
        sweep(name, p, w.data(), x.data(), y.data(), 0.0f, 2.0 * 64 * rows * ex.n * ex.k);
      }
    }
    cublasLtDestroy(lt);

    // The activation between the padded products (silu_mul over every padded row), to set
    // against expert_gemm's gated form, which includes it.
    // A kernel timed alone: one row, one "candidate".
    const auto time_row = [&](const std::string& name, double flops, const auto& call) {
      if (!wanted(name)) return;
      Result r{name, flops};
      r.first_us = r.best_us = r.single_pass_us = bench::median_us_flushed(call, flush, repeats);
      r.candidates = 1;
      print(r);
      results.push_back(r);
    };
    if (wanted("silu_mul padded") || wanted("silu_mul padding skipped")) {
      DeviceArray<float> gate_up(static_cast<size_t>(64 * padded * 2816));
      DeviceArray<uint16_t> act(static_cast<size_t>(64 * padded * 1408));
      gate_up.fill_bytes(0);
      time_row("silu_mul padded", 0.0, [&] {
        gpu::silu_mul(gate_up.data(), 2816, act.data(), 1408, 64 * padded, 1408, nullptr);
      });
      // The same with the padding rows skipped, as the runner calls it (token_of_row -1).
      std::vector<int32_t> token_of_row(static_cast<size_t>(64 * padded), -1);
      for (int e = 0; e < 64; ++e)
        for (int i = 0; i < counts[e]; ++i) token_of_row[e * padded + i] = 0;
      DeviceArray<int32_t> dtoken_of_row(token_of_row);
      time_row("silu_mul padding skipped", 0.0, [&] {
        gpu::silu_mul(gate_up.data(), 2816, act.data(), 1408, 64 * padded, 1408, nullptr,
                      dtoken_of_row.data());
      });
    }

    // Where a block of expert_gemm spends its time (ExpertGemmParams::phases), one call after
    // the timed ones and an L2 flush: rows "phases NAME", in microseconds of the SMs' clock.
    const auto phase_row = [&](const std::string& name, gpu::ExpertGemmParams p) {
      if (!wanted("phases " + name)) return;
      DeviceArray<gpu::ExpertGemmPhases> phases(static_cast<size_t>(gpu::expert_gemm_blocks(p)));
      phases.fill_bytes(0);
      p.phases = phases.data();
      bench::median_us_flushed([&] { gpu::expert_gemm(p, nullptr); }, flush, 1);
      QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<gpu::ExpertGemmPhases> all = phases.download(), blocks;
      for (const auto& b : all)
        if (b.valid) blocks.push_back(b);
      double cycles = 0, ns = 0;
      uint64_t first = UINT64_MAX, last = 0;
      std::vector<double> busy_ns(static_cast<size_t>(prop.multiProcessorCount), 0.0);
      for (const auto& b : blocks) {
        cycles += double(b.end - b.start), ns += double(b.global_end - b.global_start);
        first = std::min(first, b.global_start), last = std::max(last, b.global_end);
        busy_ns.at(b.sm) += double(b.global_end - b.global_start);
      }
      const double cycles_per_us = ns > 0 ? 1e3 * cycles / ns : 0.0;
      const auto median_us = [&](auto part) {
        std::vector<double> v;
        for (const auto& b : blocks) v.push_back(double(part(b)) / cycles_per_us);
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        return v.empty() ? 0.0 : v[v.size() / 2];
      };
      int sms = 0;
      for (const double b : busy_ns) sms += b > 0;
      const double span_us = (last - first) * 1e-3;
      double busy = 0;
      for (const double b : busy_ns) busy += b;
      std::printf(
          "phases %-28s blocks %zu on %d SMs (%.2f a SM), span %.1f us, SMs busy %.1f%%; a block "
          "(median, us at %.0f MHz): first stage %.2f, products %.2f, epilogue %.2f, all %.2f\n",
          name.c_str(), blocks.size(), sms, double(blocks.size()) / std::max(sms, 1), span_us,
          100.0 * busy * 1e-3 / (std::max(sms, 1) * span_us), cycles_per_us,
          median_us([](const auto& b) { return b.first_data - b.start; }),
          median_us([](const auto& b) { return b.products_done - b.first_data; }),
          median_us([](const auto& b) { return b.end - b.products_done; }),
          median_us([](const auto& b) { return b.end - b.start; }));
    };
    // expert_gemm: each expert's exact rows, FP32 or BF16 out (plain; BF16 the runner's down
    // product) or the activation (gated: gate and up stacked as one [2816, 2048] operand an
    // expert), for each depth of its operand ring.
    std::vector<int32_t> offsets(65, 0);
    for (int e = 0; e < 64; ++e) offsets[e + 1] = offsets[e] + counts[e];
    DeviceArray<int32_t> doffsets(offsets);
    struct Exact {
      const char* name;
      int64_t n, k;
      bool gated, bf16_out;
    };
    const Exact exact[] = {{"experts gate+up expert_gemm", 2816, 2048, false, false},
                           {"experts gate+up+silu expert_gemm", 1408, 2048, true, false},
                           {"experts down expert_gemm", 2048, 1408, false, false},
                           {"experts down bf16 out expert_gemm", 2048, 1408, false, true}};
    const auto exact_row = [](const Exact& ex, int stages) {
      return std::string(ex.name) + " s" + std::to_string(stages);
    };
    for (const Exact& ex : exact) {
      if (!wanted(exact_row(ex, 3)) && !wanted(exact_row(ex, 4))) continue;
      const int64_t weight_rows = ex.gated ? 2 * ex.n : ex.n;
      DeviceArray<uint16_t> w(static_cast<size_t>(64 * weight_rows * ex.k));
      DeviceArray<uint16_t> x(static_cast<size_t>(real_rows * ex.k));
      fill(w, 7), fill(x, 9);
      const bool bf16 = ex.gated || ex.bf16_out;  // the outputs' type
      DeviceArray<float> y(bf16 ? 0 : static_cast<size_t>(real_rows * ex.n));
      DeviceArray<uint16_t> act(bf16 ? static_cast<size_t>(real_rows * ex.n) : 0);
      gpu::ExpertGemmParams p;
      p.x = x.data(), p.ldx = ex.k, p.x_rows = real_rows;
      p.w = w.data(), p.w_stride = weight_rows * ex.k;
      p.offsets = doffsets.data(), p.num_experts = 64, p.n = ex.n, p.k = ex.k;
      if (ex.gated) {
        p.act = act.data(), p.ld_act = ex.n;
      } else if (ex.bf16_out) {
        p.y_bf16 = act.data(), p.ldy = ex.n;
      } else {
        p.y = y.data(), p.ldy = ex.n;
      }
      p.max_rows = busiest;
      for (int stages = 3; stages <= 4; ++stages) {
        p.stages = stages;
        time_row(exact_row(ex, stages), 2.0 * real_rows * weight_rows * ex.k,
                 [&] { gpu::expert_gemm(p, nullptr); });
      }
      phase_row(exact_row(ex, 4), p);
    }
    // The gated form over the padded layout's real rows, as the runner's ExpertProducts::
    // kOursGated calls it before cuBLAS's padded down product.
    if (wanted("experts gate+up+silu expert_gemm padded s4")) {
      DeviceArray<uint16_t> w(static_cast<size_t>(64 * 2816 * 2048));
      DeviceArray<uint16_t> x(static_cast<size_t>(64 * padded * 2048));
      fill(w, 7), fill(x, 9);
      DeviceArray<uint16_t> act(static_cast<size_t>(64 * padded * 1408));
      gpu::ExpertGemmParams p;
      p.x = x.data(), p.ldx = 2048, p.x_rows = 64 * padded;
      p.w = w.data(), p.w_stride = 2816 * 2048;
      p.offsets = doffsets.data(), p.num_experts = 64, p.n = 1408, p.k = 2048;
      p.act = act.data(), p.ld_act = 1408;
      p.max_rows = busiest, p.rows_per_expert = padded;
      time_row("experts gate+up+silu expert_gemm padded s4", 2.0 * real_rows * 2816 * 2048,
               [&] { gpu::expert_gemm(p, nullptr); });
      phase_row("experts gate+up+silu expert_gemm padded s4", p);
    }

    // cuBLAS's grouped GEMM on the exact rows: expert e's rows [offsets[e], offsets[e + 1]) of x
    // times its weights, one group of one product an expert (every expert's row count differs).
    {
      cublasHandle_t handle{};
      QUANTMLA_CUBLAS_CHECK(cublasCreate(&handle));
      QUANTMLA_CUBLAS_CHECK(cublasSetWorkspace(handle, workspace.data(), ws_bytes));
      for (const Expert& g : experts) {
        const std::string name = g.name("grouped");
        if (!wanted(name)) continue;
        DeviceArray<uint16_t> w(static_cast<size_t>(64) * g.n * g.k);
        DeviceArray<uint16_t> x(static_cast<size_t>(real_rows * g.k));
        fill(w, 7), fill(x, 9);
        DeviceArray<float> y(static_cast<size_t>(real_rows * g.n));  // BF16 uses half of it
        std::vector<const void*> a(64), b(64);
        std::vector<void*> c(64);
        for (int e = 0; e < 64; ++e) {
          a[e] = w.data() + static_cast<int64_t>(e) * g.n * g.k;
          b[e] = x.data() + static_cast<int64_t>(offsets[e]) * g.k;
          c[e] = g.bf16 ? static_cast<void*>(reinterpret_cast<uint16_t*>(y.data()) +
                                             static_cast<int64_t>(offsets[e]) * g.n)
                        : static_cast<void*>(y.data() + static_cast<int64_t>(offsets[e]) * g.n);
        }
        const auto pointers = [](const auto& host) {
          std::vector<uintptr_t> bits(host.size());
          for (size_t i = 0; i < host.size(); ++i) bits[i] = reinterpret_cast<uintptr_t>(host[i]);
          return DeviceArray<uintptr_t>(bits);
        };
        DeviceArray<uintptr_t> da = pointers(a), db = pointers(b), dc = pointers(c);
        // Column-major view, as LtProduct: C^T [n, rows] = W [n, k] x^T, W transposed.
        const std::vector<cublasOperation_t> ta(64, CUBLAS_OP_T), tb(64, CUBLAS_OP_N);
        const int gn = static_cast<int>(g.n), gk = static_cast<int>(g.k);
        std::vector<int> m(64, gn), n(64), k(64, gk), lda(64, gk), ldb(64, gk), ldc(64, gn);
        for (int e = 0; e < 64; ++e) n[e] = counts[e];
        const std::vector<float> alpha(64, 1.0f), beta(64, 0.0f);
        const std::vector<int> group_size(64, 1);
        const auto run = [&] {
          return cublasGemmGroupedBatchedEx(
              handle, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(),
              reinterpret_cast<const void* const*>(da.data()), CUDA_R_16BF, lda.data(),
              reinterpret_cast<const void* const*>(db.data()), CUDA_R_16BF, ldb.data(), beta.data(),
              reinterpret_cast<void* const*>(dc.data()), g.bf16 ? CUDA_R_16BF : CUDA_R_32F,
              ldc.data(), 64, group_size.data(), CUBLAS_COMPUTE_32F);
        };
        const cublasStatus_t status = run();
        QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize());
        if (status != CUBLAS_STATUS_SUCCESS) {
          std::printf("%-36s %s\n", name.c_str(), cublasGetStatusName(status));
          continue;
        }
        time_row(name, 2.0 * real_rows * g.n * g.k, [&] { QUANTMLA_CUBLAS_CHECK(run()); });
      }
      cublasDestroy(handle);
    }

    if (!json_path.empty()) {
      FILE* f = std::fopen(json_path.c_str(), "w");
      if (f == nullptr) throw std::runtime_error("cannot write " + json_path);
      std::fprintf(f,
                   "{\"device\": \"%s\", \"tokens\": %d, \"busiest_expert_rows\": %d, \"rows\": [",
                   prop.name, tokens, busiest);
      for (size_t i = 0; i < results.size(); ++i) {
        const Result& r = results[i];
        std::fprintf(f,
                     "%s\n {\"product\": \"%s\", \"first_us\": %.2f, \"best_us\": %.2f, "
                     "\"single_pass_us\": %.2f, \"best_index\": %zu, \"candidates\": %zu, "
                     "\"useful_tflops_first\": %.1f}",
                     i ? "," : "", r.name.c_str(), r.first_us, r.best_us, r.single_pass_us, r.best,
                     r.candidates, r.flops / r.first_us * 1e-6);
      }
      std::fprintf(f, "\n]}\n");
      std::fclose(f);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
