// The model runner's GPU building blocks against scalar CPU references written here (double
// accumulation): the cuBLASLt GEMMs, the per-token kernels (embed, RMSNorm, RoPE, SiLU gating,
// the queries' RoPE and BF16 conversion, row gathers), MoE routing (route_token's semantics,
// reimplemented below because the kernels-only build has no config library), the expert sort,
// gather, MLPs and combine, and sampling. Tolerances come from the formats' roundings, no fitted
// constants. Fresh random inputs each run (the seed is printed; --seed S repeats a run); every
// output buffer is filled with 0xFF bytes (NaN, or -1 for int32) before its launch, and every
// element the op should write is checked to be written.
// Exit status: 0 all checks passed, 1 a check failed, 77 no CUDA device (ctest: skipped).
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "checks.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/expert_gemm.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/model_ops.h"
#include "kernels/cuda/moe_ops.h"
#include "kernels/cuda/prefill_attention.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/skinny_gemm.h"
#include "quantmla/dtype.h"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"

namespace {

using namespace quantmla;
using gpu::DeviceArray;

using gpu_checks::expect;
using gpu_checks::expect_throws;
using gpu_checks::rng;
const cudaStream_t kStream = nullptr;

constexpr double kF32Unit = 0x1.0p-24;  // unit roundoff of FP32 (half an ulp, relative)
constexpr double kBf16Unit = 0x1.0p-8;  // unit roundoff of BF16
// Tensor cores may truncate the FP32 accumulation instead of rounding it: one ulp per addition.
constexpr double kAccumulateUnit = 0x1.0p-23;

void sync() { QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize()); }

// 0xFF bytes: NaN in FP32 and BF16, -1 in int32; an element left so was never written.
template <class T>
void poison(DeviceArray<T>& a) {
  a.fill_bytes(0xff);
}

std::vector<float> to_float(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_to_f32(bits[i]);
  return out;
}

// BF16 values with N(0, scale^2) magnitudes; `values` gets the exact FP32 of each.
std::vector<uint16_t> random_bf16(size_t count, float scale, std::vector<float>* values = nullptr) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<uint16_t> bits(count);
  for (auto& b : bits) b = f32_to_bf16(normal(rng));
  if (values != nullptr) *values = to_float(bits);
  return bits;
}

std::vector<float> random_f32(size_t count, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(count);
  for (auto& x : v) x = normal(rng);
  return v;
}

// Element-wise |got - ref| <= bound; NaN anywhere fails (an unwritten element keeps its NaN
// poison). Prints one line per case with the largest errors.
void check_close(const std::string& name, const std::vector<float>& got,
                 const std::vector<double>& ref, const std::vector<double>& bound) {
  double max_abs = 0.0, max_rel = 0.0, worst_ratio = 0.0;
  int64_t violations = 0, first_violation = -1;
  std::vector<int64_t> nans;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(ref[i])) {
      nans.push_back(static_cast<int64_t>(i));
      continue;
    }
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    max_abs = std::max(max_abs, err);
    if (ref[i] != 0.0) max_rel = std::max(max_rel, err / std::fabs(ref[i]));
    const double ratio = bound[i] > 0.0 ? err / bound[i] : (err > 0.0 ? INFINITY : 0.0);
    worst_ratio = std::max(worst_ratio, ratio);
    if (err > bound[i]) {
      if (violations++ == 0) first_violation = static_cast<int64_t>(i);
    }
  }
  const bool ok = violations == 0 && nans.empty() && got.size() == ref.size();
  std::printf("%s %-58s max abs %.3g, max rel %.3g, worst %.3g of bound (%zu values)\n",
              ok ? "ok  " : "FAIL", name.c_str(), max_abs, max_rel, worst_ratio, got.size());
  if (violations > 0) {
    const auto i = static_cast<size_t>(first_violation);
    std::fprintf(stderr,
                 "  %lld values over the bound, first at %lld: got %.9g ref %.9g bound %.3g\n",
                 static_cast<long long>(violations), static_cast<long long>(first_violation),
                 got[i], ref[i], bound[i]);
  }
  if (!nans.empty()) {
    std::fprintf(stderr, "  %zu NaN (unwritten or wrong) values, at", nans.size());
    for (size_t j = 0; j < std::min<size_t>(nans.size(), 8); ++j) {
      std::fprintf(stderr, " %lld", static_cast<long long>(nans[j]));
    }
    std::fprintf(stderr, "%s\n", nans.size() > 8 ? " ..." : "");
  }
  expect(ok, name);
}

// Exact equality of raw values (bits for floats), with the first mismatch named.
template <class T>
void check_equal(const std::string& name, const std::vector<T>& got, const std::vector<T>& ref) {
  int64_t mismatches = 0, first = -1;
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    if (std::memcmp(&got[i], &ref[i], sizeof(T)) != 0) {
      if (mismatches++ == 0) first = static_cast<int64_t>(i);
    }
  }
  const bool ok = mismatches == 0 && got.size() == ref.size();
  std::printf("%s %-58s exact (%zu values)\n", ok ? "ok  " : "FAIL", name.c_str(), got.size());
  if (!ok && first >= 0) {
    std::fprintf(stderr, "  %lld mismatches, first at %lld: got %.9g ref %.9g\n",
                 static_cast<long long>(mismatches), static_cast<long long>(first),
                 static_cast<double>(got[first]), static_cast<double>(ref[first]));
  }
  expect(ok, name);
}

// ---------------------------------------------------------------- GEMM

struct LinearCase {
  int64_t m, n, k;
  int64_t pad_x, pad_w, pad_y;  // row stride = width + pad
  DType out_dtype;
  float beta;
};

void run_linear_case(gpu::GemmRunner& gemm, const LinearCase& c) {
  const int64_t ldx = c.k + c.pad_x, ldw = c.k + c.pad_w, ldy = c.n + c.pad_y;
  const bool bf16 = c.out_dtype == DType::kBF16;
  std::vector<float> x, w;
  const auto x_bits = random_bf16(static_cast<size_t>(c.m * ldx), 1.0f, &x);
  const auto w_bits = random_bf16(static_cast<size_t>(c.n * ldw), 1.0f / std::sqrt(float(c.k)), &w);
  const std::vector<float> y0 = random_f32(static_cast<size_t>(c.m * ldy), 1.0f);
  DeviceArray<uint16_t> dx(x_bits), dw(w_bits);
  const size_t y_bytes = static_cast<size_t>(c.m * ldy) * (bf16 ? 2 : 4);
  DeviceArray<uint8_t> dy(y_bytes), dy2(y_bytes);
  std::vector<uint16_t> y0_bits(y0.size());
  for (size_t i = 0; i < y0.size(); ++i) y0_bits[i] = f32_to_bf16(y0[i]);
  const auto fill_y = [&](DeviceArray<uint8_t>& y) {
    y.fill_bytes(0xff);  // padding columns keep the poison; beta = 0 must never read it
    if (c.beta == 0.0f) return;
    if (bf16) {
      QUANTMLA_CUDA_CHECK(cudaMemcpy(y.data(), y0_bits.data(), y_bytes, cudaMemcpyHostToDevice));
    } else {
      QUANTMLA_CUDA_CHECK(cudaMemcpy(y.data(), y0.data(), y_bytes, cudaMemcpyHostToDevice));
    }
  };
  fill_y(dy);
  fill_y(dy2);
  gemm.linear(c.m, c.n, c.k, dx.data(), ldx, dw.data(), ldw, dy.data(), ldy, c.out_dtype, c.beta,
              kStream);
  const size_t plans = gemm.cached_plans();
  gemm.linear(c.m, c.n, c.k, dx.data(), ldx, dw.data(), ldw, dy2.data(), ldy, c.out_dtype, c.beta,
              kStream);
  sync();
  const std::string name = "linear m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " +
                           std::to_string(c.k) + (bf16 ? " BF16" : " F32") +
                           (c.beta != 0.0f ? " beta 1" : "") +
                           (c.pad_x % 8 != 0 ? " odd strides" : "");
  expect(gemm.cached_plans() == plans, name + ": a repeated shape reuses its plan");
  const auto bytes = dy.download();
  expect(bytes == dy2.download(), name + ": two runs agree bit for bit");

  std::vector<float> got;
  std::vector<double> ref, bound;
  bool padding_kept = true;
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t j = 0; j < ldy; ++j) {
      const size_t at = static_cast<size_t>(r * ldy + j);
      float value = 0.0f;
      if (bf16) {
        uint16_t b;
        std::memcpy(&b, bytes.data() + 2 * at, 2);
        value = bf16_to_f32(b);
        if (j >= c.n && c.beta == 0.0f) padding_kept &= b == 0xffff;
      } else {
        uint32_t b;
        std::memcpy(&b, bytes.data() + 4 * at, 4);
        std::memcpy(&value, &b, 4);
        if (j >= c.n && c.beta == 0.0f) padding_kept &= b == 0xffffffffu;
      }
      if (j >= c.n) continue;
      double sum = 0.0, magnitude = 0.0;
      const float* xr = x.data() + r * ldx;
      const float* wr = w.data() + j * ldw;
      for (int64_t i = 0; i < c.k; ++i) {
        const double p = static_cast<double>(xr[i]) * wr[i];
        sum += p;
        magnitude += std::fabs(p);
      }
      if (c.beta != 0.0f) {
        const double old = bf16 ? bf16_to_f32(y0_bits[at]) : y0[at];
        sum += old;
        magnitude += std::fabs(old);
      }
      const double accumulate = static_cast<double>(c.k + 1) * kAccumulateUnit * magnitude;
      got.push_back(value);
      ref.push_back(sum);
      bound.push_back(accumulate + (bf16 ? kBf16Unit : kF32Unit) * (std::fabs(sum) + accumulate));
    }
  }
  check_close(name, got, ref, bound);
  expect(padding_kept, name + ": columns past n untouched");
}

// The MLA absorption products with heads interleaved in rows, both op(W) variants.
void run_batched_cases(gpu::GemmRunner& gemm, int tokens, int heads) {
  const int hp = gpu::padded_heads(heads);
  std::vector<float> q, kv_b, lat;
  // q projection output [tokens, heads, 192] (nope 128 | pe 64), kv_b_proj [heads * 256, 512]
  // (W_UK_h rows h*256.., W_UV_h rows h*256+128..), decode output [tokens, hp, 512].
  const auto q_bits = random_bf16(static_cast<size_t>(tokens) * heads * 192, 1.0f, &q);
  const auto kv_bits = random_bf16(static_cast<size_t>(heads) * 256 * 512, 0.05f, &kv_b);
  const auto lat_bits = random_bf16(static_cast<size_t>(tokens) * hp * 512, 1.0f, &lat);
  DeviceArray<uint16_t> dq(q_bits), dkv(kv_bits), dlat(lat_bits);
  const std::string shape = " tokens " + std::to_string(tokens) + " heads " + std::to_string(heads);

  // q_abs_h[t, 512] = q_nope_h[t, 128] W_UK_h[128, 512]  (op N), FP32 [tokens, heads, 512].
  {
    DeviceArray<float> y(static_cast<size_t>(tokens) * heads * 512);
    poison(y);
    gpu::BatchedGemmParams p;
    p.batch = heads, p.m = tokens, p.n = 512, p.k = 128;
    p.x = dq.data(), p.ldx = heads * 192, p.stride_x = 192;
    p.w = dkv.data(), p.ldw = 512, p.stride_w = 256 * 512, p.op_w = gpu::GemmOp::kN;
    p.y = y.data(), p.ldy = heads * 512, p.stride_y = 512, p.out_dtype = DType::kF32;
    gemm.batched(p, kStream);
    sync();
    const auto got = y.download();
    std::vector<double> ref(got.size()), bound(got.size());
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < heads; ++h) {
        for (int j = 0; j < 512; ++j) {
          double sum = 0.0, magnitude = 0.0;
          for (int i = 0; i < 128; ++i) {
            const double prod = static_cast<double>(q[(t * heads + h) * 192 + i]) *
                                kv_b[(static_cast<size_t>(h) * 256 + i) * 512 + j];
            sum += prod;
            magnitude += std::fabs(prod);
          }
          const size_t at = (static_cast<size_t>(t) * heads + h) * 512 + j;
          ref[at] = sum;
          bound[at] = 128 * kAccumulateUnit * magnitude + kF32Unit * std::fabs(sum);
        }
      }
    }
    check_close("batched op N (W_UK absorption) F32" + shape, got, ref, bound);

    // The same product in BF16 straight into the decode query's content columns.
    DeviceArray<uint16_t> q_dec(static_cast<size_t>(tokens) * hp * 576);
    poison(q_dec);
    p.y = q_dec.data(), p.ldy = hp * 576, p.stride_y = 576, p.out_dtype = DType::kBF16;
    gemm.batched(p, kStream);
    sync();
    const auto dec = q_dec.download();
    std::vector<float> got16;
    std::vector<double> ref16, bound16;
    bool rest_untouched = true;
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < hp; ++h) {
        for (int j = 0; j < 576; ++j) {
          const uint16_t b = dec[(static_cast<size_t>(t) * hp + h) * 576 + j];
          if (h >= heads || j >= 512) {
            rest_untouched &= b == 0xffff;
            continue;
          }
          const size_t at = (static_cast<size_t>(t) * heads + h) * 512 + j;
          got16.push_back(bf16_to_f32(b));
          ref16.push_back(ref[at]);
          bound16.push_back(bound[at] + kBf16Unit * (std::fabs(ref[at]) + bound[at]));
        }
      }
    }
    check_close("batched op N into q_dec BF16 (ldy hp*576)" + shape, got16, ref16, bound16);
    expect(rest_untouched, "batched op N into q_dec: q_pe columns and padding heads untouched");
  }

  // o_h[t, 128] = lat_h[t, 512] W_UV_h[128, 512]^T  (op T), BF16 [tokens, heads * 128], reading
  // the padded decode output with a head stride.
  {
    DeviceArray<uint16_t> y(static_cast<size_t>(tokens) * heads * 128);
    poison(y);
    gpu::BatchedGemmParams p;
    p.batch = heads, p.m = tokens, p.n = 128, p.k = 512;
    p.x = dlat.data(), p.ldx = hp * 512, p.stride_x = 512;
    p.w = dkv.data() + 128 * 512, p.ldw = 512, p.stride_w = 256 * 512, p.op_w = gpu::GemmOp::kT;
    p.y = y.data(), p.ldy = heads * 128, p.stride_y = 128, p.out_dtype = DType::kBF16;
    gemm.batched(p, kStream);
    sync();
    const auto got = to_float(y.download());
    std::vector<double> ref(got.size()), bound(got.size());
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < heads; ++h) {
        for (int j = 0; j < 128; ++j) {
          double sum = 0.0, magnitude = 0.0;
          for (int i = 0; i < 512; ++i) {
            const double prod =
                static_cast<double>(lat[(static_cast<size_t>(t) * hp + h) * 512 + i]) *
                kv_b[(static_cast<size_t>(h) * 256 + 128 + j) * 512 + i];
            sum += prod;
            magnitude += std::fabs(prod);
          }
          const size_t at = (static_cast<size_t>(t) * heads + h) * 128 + j;
          const double acc = 512 * kAccumulateUnit * magnitude;
          ref[at] = sum;
          bound[at] = acc + kBf16Unit * (std::fabs(sum) + acc);
        }
      }
    }
    check_close("batched op T (W_UV) BF16, padded heads read in place" + shape, got, ref, bound);
  }
}

// A tuned product (GemmRunner's tune_min_rows: the first call of a shape times the candidates
// that sum in one pass) equals the heuristic's first choice bit for bit, for beta 0 and 1 and a
// BF16 output, and leaves y as one call would (beta 1: the timed runs go to a scratch buffer).
// Then m_same_bucket rows (the same power of two as m): the same bits again, and the bucket's
// algorithm taken without timing.
void run_tuned_gemm_case(int64_t m, int64_t m_same_bucket, int64_t n, int64_t k) {
  gpu::GemmRunner tuned(gpu::GemmRunner::kDefaultWorkspaceBytes, nullptr, 512);
  gpu::GemmRunner first(gpu::GemmRunner::kDefaultWorkspaceBytes, nullptr, 0);
  DeviceArray<uint16_t> x(random_bf16(static_cast<size_t>(m * k), 1.0f));
  DeviceArray<uint16_t> w(random_bf16(static_cast<size_t>(n * k), 0.05f));
  const std::vector<float> y0 = random_f32(static_cast<size_t>(m * n), 1.0f);
  size_t timed = 0;
  for (const int64_t rows : {m, m_same_bucket}) {
    for (const auto& [dtype, beta] : {std::pair{DType::kF32, 0.0f}, std::pair{DType::kF32, 1.0f},
                                      std::pair{DType::kBF16, 0.0f}}) {
      DeviceArray<float> a(y0), b(y0);  // BF16 outputs use the first half of each
      tuned.linear(rows, n, k, x.data(), k, w.data(), k, a.data(), n, dtype, beta, kStream);
      first.linear(rows, n, k, x.data(), k, w.data(), k, b.data(), n, dtype, beta, kStream);
      sync();
      const std::vector<float> ga = a.download(), gb = b.download();
      const size_t words = dtype == DType::kF32 ? ga.size() : ga.size() / 2;
      expect(std::memcmp(ga.data(), gb.data(), words * sizeof(float)) == 0,
             "tuned linear m " + std::to_string(rows) + " n " + std::to_string(n) + " k " +
                 std::to_string(k) + " " + std::string(dtype_name(dtype)) + " beta " +
                 std::to_string(beta) + ": the same bits as the heuristic's first choice");
    }
    if (rows == m) timed = tuned.tuned_plans();
  }
  std::printf("tuned products: %zu of %zu plans chosen by timing\n", tuned.tuned_plans(),
              tuned.cached_plans());
  expect(tuned.tuned_plans() == timed, "m " + std::to_string(m_same_bucket) +
                                           " takes the algorithms timed at m " + std::to_string(m) +
                                           " (the same power-of-two bucket) without timing again");
  expect(first.tuned_plans() == 0, "tune_min_rows 0 tunes nothing");
}

// The routed experts' batched products are tuned by the rows of the whole batch
// (tune_by_batch_rows): 8 products of m rows, strides following m. Tuned and untuned give the same
// bits; a second m of the same power of two takes the tuned algorithm without timing again.
void run_tuned_batched_case(int64_t m, int64_t m_same_bucket, int64_t n, int64_t k) {
  constexpr int64_t kBatch = 8;
  gpu::GemmRunner tuned(gpu::GemmRunner::kDefaultWorkspaceBytes, nullptr, 512);
  gpu::GemmRunner first(gpu::GemmRunner::kDefaultWorkspaceBytes, nullptr, 0);
  DeviceArray<uint16_t> x(random_bf16(static_cast<size_t>(kBatch * m * k), 1.0f));
  DeviceArray<uint16_t> w(random_bf16(static_cast<size_t>(kBatch * n * k), 0.05f));
  size_t timed = 0;
  for (const int64_t rows : {m, m_same_bucket}) {
    DeviceArray<float> a(static_cast<size_t>(kBatch * rows * n)), b(a.size());
    gpu::BatchedGemmParams p;
    p.batch = kBatch, p.m = rows, p.n = n, p.k = k;
    p.x = x.data(), p.ldx = k, p.stride_x = rows * k;
    p.w = w.data(), p.ldw = k, p.stride_w = n * k, p.op_w = gpu::GemmOp::kT;
    p.ldy = n, p.stride_y = rows * n;
    p.tune_by_batch_rows = true;
    p.y = a.data();
    tuned.batched(p, kStream);
    p.y = b.data();
    first.batched(p, kStream);
    sync();
    expect(a.download() == b.download(), "tuned batched " + std::to_string(kBatch) + " x m " +
                                             std::to_string(rows) + " n " + std::to_string(n) +
                                             " k " + std::to_string(k) +
                                             ": the same bits as the heuristic's first choice");
    if (rows == m) timed = tuned.tuned_plans();
  }
  std::printf("tuned batched products: %zu of %zu plans chosen by timing\n", tuned.tuned_plans(),
              tuned.cached_plans());
  expect(tuned.tuned_plans() == timed, "batched m " + std::to_string(m_same_bucket) +
                                           " takes the algorithm timed at m " + std::to_string(m) +
                                           " without timing again");
}

// A batch-invariant GemmRunner: each row of y is the same bits whatever m is (1 to 1000 rows, the
// decode steps' skinny sizes and the prefill's), for plain products (FP32 and BF16 out, beta 1,
// unaligned strides) and the per-head batched ones of MLA's absorption (x's heads interleaved in
// its rows), with x and y at another row offset too (a group later in the step). The algorithm of
// a shape is fixed at its first call, so every m runs it.
void run_batch_invariant_gemm_cases() {
  gpu::GemmRunner gemm(gpu::GemmRunner::kDefaultWorkspaceBytes, nullptr,
                       gpu::GemmRunner::kDefaultTuneMinRows, /*batch_invariant=*/true);
  constexpr int64_t kRows = 1000;
  const int64_t row_counts[] = {kRows, 1, 2, 7, 16, 17, 64, 255, 256, 300, 513};
  struct Shape {
    int64_t n, k, pad;
    DType out;
    float beta;
  };
  for (const Shape& shape :
       {Shape{576, 2048, 0, DType::kF32, 0.0f}, Shape{2048, 1408, 0, DType::kF32, 1.0f},
        Shape{3072, 2048, 0, DType::kBF16, 0.0f}, Shape{129, 104, 8, DType::kF32, 0.0f}}) {
    const int64_t ldx = shape.k + shape.pad, ldy = shape.n + shape.pad;
    const size_t y_bytes = shape.out == DType::kF32 ? 4 : 2;
    // Two extra rows so that a call may start one row in (another alignment of x and y).
    DeviceArray<uint16_t> x(random_bf16(static_cast<size_t>((kRows + 2) * ldx), 1.0f));
    DeviceArray<uint16_t> w(random_bf16(static_cast<size_t>(shape.n * shape.k), 0.05f));
    const std::vector<float> y0 = random_f32(static_cast<size_t>((kRows + 2) * ldy), 1.0f);
    std::vector<uint8_t> first;  // kRows rows, the reference
    int differing = 0;
    for (const int64_t m : row_counts) {
      for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
        if (m == kRows && offset == 1) continue;
        DeviceArray<float> y(y0);
        uint8_t* y_at = reinterpret_cast<uint8_t*>(y.data()) + offset * ldy * y_bytes;
        gemm.linear(m, shape.n, shape.k, x.data() + offset * ldx, ldx, w.data(), shape.k, y_at, ldy,
                    shape.out, shape.beta, kStream);
        sync();
        const std::vector<float> all = y.download();
        const uint8_t* bytes = reinterpret_cast<const uint8_t*>(all.data());
        // Row r of this call is x's row offset + r; compare it with the reference's same row
        // (beta 1 adds the same y0 row).
        if (first.empty()) first.assign(bytes, bytes + (kRows + 2) * ldy * y_bytes);
        for (int64_t r = 0; r < m; ++r) {
          const size_t at = static_cast<size_t>((offset + r) * ldy) * y_bytes;
          differing += std::memcmp(bytes + at, first.data() + at, shape.n * y_bytes) != 0;
        }
      }
    }
    const std::string name = "batch-invariant linear n " + std::to_string(shape.n) + " k " +
                             std::to_string(shape.k) + " pad " + std::to_string(shape.pad) + " " +
                             std::string(dtype_name(shape.out)) + " beta " +
                             std::to_string(shape.beta);
    std::printf("%s: %d rows differ from the %lld-row product's\n", name.c_str(), differing,
                static_cast<long long>(kRows));
    expect(differing == 0, name + ": every row the same bits at every m");
  }
  // W_UK's product over 16 heads: x [m, 16 heads, 192] (q_nope at the head's start), W [16] x
  // [128 nope rows of 256, 512] read [k 128, n 512], y [m, 16 heads, 576] (the first 512 columns).
  constexpr int64_t kHeads = 16, kQk = 192, kNope = 128, kRank = 512, kOutStride = 576;
  DeviceArray<uint16_t> x(random_bf16(static_cast<size_t>(kRows * kHeads * kQk), 1.0f));
  DeviceArray<uint16_t> w(random_bf16(static_cast<size_t>(kHeads * 256 * kRank), 0.05f));
  std::vector<uint16_t> reference;
  int differing = 0;
  for (const int64_t m : row_counts) {
    DeviceArray<uint16_t> y(static_cast<size_t>(kRows * kHeads * kOutStride));
    gpu::BatchedGemmParams p;
    p.batch = kHeads, p.m = m, p.n = kRank, p.k = kNope;
    p.x = x.data(), p.ldx = kHeads * kQk, p.stride_x = kQk;
    p.w = w.data(), p.ldw = kRank, p.stride_w = 256 * kRank, p.op_w = gpu::GemmOp::kN;
    p.y = y.data(), p.ldy = kHeads * kOutStride, p.stride_y = kOutStride;
    p.out_dtype = DType::kBF16;
    gemm.batched(p, kStream);
    sync();
    const std::vector<uint16_t> got = y.download();
    if (reference.empty()) reference = got;
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t h = 0; h < kHeads; ++h) {
        const size_t at = static_cast<size_t>((r * kHeads + h) * kOutStride);
        differing +=
            !std::equal(got.begin() + at, got.begin() + at + kRank, reference.begin() + at);
      }
    }
  }
  std::printf("batch-invariant batched (W_UK over 16 heads): %d head rows differ\n", differing);
  expect(differing == 0, "batch-invariant batched: every head row the same bits at every m");
}

void run_gemm_errors(gpu::GemmRunner& gemm) {
  DeviceArray<uint16_t> a(64 * 64);
  DeviceArray<float> y(64 * 64);
  expect_throws<InvalidArgument>("GemmRunner tune_min_rows -1", [] {
    gpu::GemmRunner runner(gpu::GemmRunner::kDefaultWorkspaceBytes, nullptr, -1);
  });
  expect_throws<ShapeError>("linear ldx < k", [&] {
    gemm.linear(4, 4, 64, a.data(), 32, a.data(), 64, y.data(), 4, DType::kF32, 0.0f, kStream);
  });
  expect_throws<InvalidArgument>("linear out dtype F16", [&] {
    gemm.linear(4, 4, 64, a.data(), 64, a.data(), 64, y.data(), 4, DType::kF16, 0.0f, kStream);
  });
  expect_throws<InvalidArgument>("linear BF16 output with beta 1", [&] {
    gemm.linear(4, 4, 64, a.data(), 64, a.data(), 64, y.data(), 4, DType::kBF16, 1.0f, kStream);
  });
  expect_throws<InvalidArgument>("linear null x", [&] {
    gemm.linear(4, 4, 64, nullptr, 64, a.data(), 64, y.data(), 4, DType::kF32, 0.0f, kStream);
  });
  // m = 0: nothing happens (an expert without tokens).
  y.fill_bytes(0x11);
  gemm.linear(0, 4, 64, a.data(), 64, a.data(), 64, y.data(), 4, DType::kF32, 0.0f, kStream);
  sync();
  const auto after = y.download();
  bool untouched = true;
  for (const float v : after) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    untouched &= b == 0x11111111u;
  }
  expect(untouched, "linear m = 0 writes nothing");
}

// ---------------------------------------------------------------- skinny GEMM

struct SkinnyCase {
  std::string name;
  std::vector<int32_t> group_rows;  // rows of each group; empty: dense (offsets null)
  int64_t rows;                     // dense: the rows; grouped: rows past offsets[groups]
  int64_t n, k;
  int64_t pad_x, pad_y;   // row stride = width + pad
  int64_t gather_tokens;  // > 0: x has that many rows, read through row_index
  gpu::SkinnyEpilogue epilogue;
  DType out_dtype;
  float beta;
  gpu::SkinnyTiling tiling{};        // tile_n 0: skinny_gemm's own choice
  bool dense_pointer_array = false;  // dense: the weight through w[0] instead of `weight`
  bool null_weight_group = false;    // grouped: the first group with rows has no weight (NaN rows)
  bool graph = false;  // captured in a CUDA graph before the offsets are uploaded, then replayed
  bool routing_ready = false;  // grouped: the tiles located before waiting for the last kernel
};

// Sums inside the kernel besides the k products: up to 8 warps' partial sums, and y for beta 1.
constexpr int64_t kSkinnyExtraSums = 8 + 1;

void run_skinny_case(const SkinnyCase& c) {
  const bool grouped = !c.group_rows.empty();
  const bool silu = c.epilogue == gpu::SkinnyEpilogue::kSiluMul;
  const bool bf16 = c.out_dtype == DType::kBF16;
  const int groups = grouped ? static_cast<int>(c.group_rows.size()) : 1;
  std::vector<int32_t> offsets(static_cast<size_t>(groups) + 1, 0);
  for (int g = 0; g < groups; ++g) {
    offsets[g + 1] = offsets[g] + (grouped ? c.group_rows[g] : static_cast<int32_t>(c.rows));
  }
  const int64_t used = offsets[groups];
  const int64_t max_rows = grouped ? used + c.rows : c.rows;
  const int64_t x_rows = c.gather_tokens > 0 ? c.gather_tokens : max_rows;
  const int64_t ldx = c.k + c.pad_x, ldy = c.n + c.pad_y;

  std::vector<float> x;
  DeviceArray<uint16_t> dx(random_bf16(static_cast<size_t>(x_rows * ldx), 1.0f, &x));
  std::vector<int32_t> row_index;
  if (c.gather_tokens > 0) {
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(x_rows) - 1);
    row_index.resize(static_cast<size_t>(max_rows));
    for (auto& t : row_index) t = token(rng);
    // Outside [0, x_rows): zeros (moe_sort marks the slots past offsets[E] with -1).
    if (used > 0) row_index[0] = static_cast<int32_t>(x_rows);
    if (used > 2) row_index[used / 2] = -1;
  }
  DeviceArray<int32_t> drow_index(row_index);

  // One allocation per kind holds the matrices of the groups with rows; the others get null.
  const auto matrix = static_cast<size_t>(c.n * c.k);
  std::vector<int> slot(static_cast<size_t>(groups), -1);
  int with_weights = 0, nan_group = -1;
  for (int g = 0; g < groups; ++g) {
    if (offsets[g + 1] == offsets[g]) continue;
    if (c.null_weight_group && nan_group < 0) {
      nan_group = g;
      continue;
    }
    slot[g] = with_weights++;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.k));
  std::vector<float> wg, wu;
  DeviceArray<uint16_t> dwg(random_bf16(matrix * with_weights, scale, &wg));
  DeviceArray<uint16_t> dwu(silu ? random_bf16(matrix * with_weights, scale, &wu)
                                 : std::vector<uint16_t>{});
  std::vector<const uint16_t*> pg(static_cast<size_t>(groups), nullptr), pu = pg;
  for (int g = 0; g < groups; ++g) {
    if (slot[g] < 0) continue;
    pg[g] = dwg.data() + slot[g] * matrix;
    if (silu) pu[g] = dwu.data() + slot[g] * matrix;
  }
  DeviceArray<const uint16_t*> dpg(pg), dpu(pu);
  DeviceArray<int32_t> doffsets(static_cast<size_t>(groups) + 1);
  doffsets.fill_bytes(0);  // a graph case uploads the real offsets only after the capture
  if (!c.graph) doffsets.upload(offsets);

  const size_t esize = bf16 ? 2 : 4;
  const size_t y_bytes = static_cast<size_t>(max_rows * ldy) * esize;
  const std::vector<float> y0 = random_f32(static_cast<size_t>(max_rows * ldy), 1.0f);
  DeviceArray<uint8_t> dy(y_bytes), dy2(y_bytes);
  const auto fill_y = [&](DeviceArray<uint8_t>& y) {
    y.fill_bytes(0xff);  // beta 0: what is not written stays NaN
    if (c.beta != 0.0f) {
      QUANTMLA_CUDA_CHECK(cudaMemcpy(y.data(), y0.data(), y_bytes, cudaMemcpyHostToDevice));
    }
  };
  fill_y(dy);
  fill_y(dy2);

  gpu::SkinnyGemmParams p;
  p.x = dx.data(), p.ldx = ldx, p.x_rows = x_rows;
  p.row_index = c.gather_tokens > 0 ? drow_index.data() : nullptr;
  p.offsets = grouped ? doffsets.data() : nullptr;
  p.groups = groups, p.max_rows = max_rows;
  if (grouped || c.dense_pointer_array) {
    p.w = dpg.data();
    p.w2 = silu ? dpu.data() : nullptr;
  } else {
    p.weight = pg[0];
    p.weight2 = silu ? pu[0] : nullptr;
  }
  p.n = c.n, p.k = c.k, p.ldy = ldy, p.out_dtype = c.out_dtype, p.beta = c.beta;
  p.epilogue = c.epilogue;
  p.routing_ready = c.routing_ready;
  const gpu::SkinnyTiling tiling = c.tiling.tile_n != 0 ? c.tiling : gpu::skinny_gemm_tiling(p);
  const auto launch = [&](DeviceArray<uint8_t>& y, cudaStream_t stream) {
    p.y = y.data();
    gpu::skinny_gemm(p, tiling, stream);
  };
  if (c.graph) {
    cudaStream_t stream;
    QUANTMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    QUANTMLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    launch(dy, stream);
    QUANTMLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    QUANTMLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    doffsets.upload(offsets);  // the routing of this step, after the capture
    sync();                    // the fills above ran on the legacy stream
    QUANTMLA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    QUANTMLA_CUDA_CHECK(cudaStreamSynchronize(stream));
    QUANTMLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
    QUANTMLA_CUDA_CHECK(cudaGraphDestroy(graph));
    QUANTMLA_CUDA_CHECK(cudaStreamDestroy(stream));
  } else {
    launch(dy, kStream);
  }
  launch(dy2, kStream);
  sync();
  const std::string name = c.name + " (tile_n " + std::to_string(tiling.tile_n) + ", " +
                           std::to_string(tiling.warps) + " warps)";
  const auto bytes = dy.download();
  expect(bytes == dy2.download(), name + ": two runs agree bit for bit");

  std::vector<float> got;
  std::vector<double> ref, bound;
  bool rest_untouched = true, nan_rows = true;
  std::vector<double> gate(static_cast<size_t>(c.n)), up(gate), mg(gate), mu(gate);
  for (int64_t r = 0; r < max_rows; ++r) {
    const int g =
        static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), r) - offsets.begin()) - 1;
    const bool written = r < used;
    const int64_t source = c.gather_tokens > 0 ? row_index[r] : r;
    const float* xr = source >= 0 && source < x_rows ? x.data() + source * ldx : nullptr;
    if (written && g != nan_group) {
      const float* wgr = wg.data() + slot[g] * matrix;
      const float* wur = silu ? wu.data() + slot[g] * matrix : nullptr;
      for (int64_t j = 0; j < c.n; ++j) {
        double sg = 0, su = 0, ag = 0, au = 0;
        for (int64_t i = 0; xr != nullptr && i < c.k; ++i) {
          const double pg_ = static_cast<double>(xr[i]) * wgr[j * c.k + i];
          sg += pg_, ag += std::fabs(pg_);
          if (silu) {
            const double pu_ = static_cast<double>(xr[i]) * wur[j * c.k + i];
            su += pu_, au += std::fabs(pu_);
          }
        }
        gate[j] = sg, up[j] = su, mg[j] = ag, mu[j] = au;
      }
    }
    for (int64_t j = 0; j < ldy; ++j) {
      const size_t at = static_cast<size_t>(r * ldy + j);
      uint32_t b = 0;
      std::memcpy(&b, bytes.data() + esize * at, esize);
      const float value = bf16 ? bf16_to_f32(static_cast<uint16_t>(b)) : std::bit_cast<float>(b);
      if (!written || j >= c.n) {
        uint32_t initial = bf16 ? 0xffffu : 0xffffffffu;
        if (c.beta != 0.0f) std::memcpy(&initial, &y0[at], 4);
        rest_untouched &= b == initial;
        continue;
      }
      if (g == nan_group) {
        nan_rows &= std::isnan(value);
        continue;
      }
      const double acc_g = static_cast<double>(c.k + kSkinnyExtraSums) * kAccumulateUnit * mg[j];
      double exact = gate[j], err = acc_g;
      if (silu) {
        const double acc_u = static_cast<double>(c.k + kSkinnyExtraSums) * kAccumulateUnit * mu[j];
        const double dg = acc_g + kF32Unit * std::fabs(gate[j]);
        const double du = acc_u + kF32Unit * std::fabs(up[j]);
        const double s = gate[j] / (1.0 + std::exp(-gate[j]));
        exact = s * up[j];
        // |silu'| <= 1.1; expf, the sum, the quotient and the product in FP32 (6 units); where
        // expf(-g) overflows (g < -88) FP32 gives -0 for a true value below 1e-36.
        err = 1.1 * dg * (std::fabs(up[j]) + du) + (std::fabs(s) + 1.1 * dg) * du +
              6 * kF32Unit * std::fabs(exact) + (gate[j] < -88.0 ? std::fabs(exact) : 0.0);
      } else if (c.beta != 0.0f) {
        exact += y0[at];
        err += kAccumulateUnit * std::fabs(y0[at]);
      }
      got.push_back(value);
      ref.push_back(exact);
      bound.push_back(err + (bf16 ? kBf16Unit : kF32Unit) * (std::fabs(exact) + err));
    }
  }
  check_close(name, got, ref, bound);
  expect(rest_untouched, name + ": rows past offsets[groups] and columns past n untouched");
  if (nan_group >= 0) expect(nan_rows, name + ": the group without a weight gets NaN rows");
}

// Skewed routing: most groups get a few rows, some none, one gets 40.
std::vector<int32_t> skewed_group_rows(int groups) {
  std::vector<int32_t> rows(static_cast<size_t>(groups));
  std::geometric_distribution<int32_t> few(0.3);
  for (auto& r : rows) r = std::min(few(rng), 20);
  rows[3] = 0, rows[4] = 0, rows[groups - 1] = 0;
  rows[groups / 2] = 40;
  return rows;
}

// A serving batch: `rows` rows over the groups, uniformly at random (some get twice the mean).
std::vector<int32_t> busy_group_rows(int groups, int rows) {
  std::vector<int32_t> counts(static_cast<size_t>(groups), 0);
  std::uniform_int_distribution<int> pick(0, groups - 1);
  for (int i = 0; i < rows; ++i) ++counts[static_cast<size_t>(pick(rng))];
  return counts;
}

// The batch-1 decode: 6 of the groups get one row each.
std::vector<int32_t> one_row_in(int groups, int chosen) {
  std::vector<int32_t> order(static_cast<size_t>(groups));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> rows(static_cast<size_t>(groups), 0);
  for (int i = 0; i < chosen; ++i) rows[order[i]] = 1;
  return rows;
}

void run_skinny_cases() {
  using gpu::SkinnyEpilogue;
  const auto store = SkinnyEpilogue::kStore;
  const auto silu = SkinnyEpilogue::kSiluMul;
  const std::vector<int32_t> dense;  // no groups: offsets null
  const gpu::SkinnyTiling chosen{};  // skinny_gemm's own tiling
  const std::vector<SkinnyCase> cases = {
      {"skinny dense m 1 n 2048 k 2048 F32", dense, 1, 2048, 2048, 0, 0, 0, store, DType::kF32, 0},
      {"skinny dense m 3 n 1003 k 1408 F32 beta 1, padded", dense, 3, 1003, 1408, 8, 5, 0, store,
       DType::kF32, 1},
      {"skinny dense m 16 n 576 k 2048 BF16", dense, 16, 576, 2048, 0, 0, 0, store, DType::kBF16,
       0},
      {"skinny dense m 17 n 200 k 8 F32 (w[0])", dense, 17, 200, 8, 0, 3, 0, store, DType::kF32, 0,
       chosen, true},
      {"skinny dense m 64 n 1001 k 1408 silu", dense, 64, 1001, 1408, 16, 1, 0, silu, DType::kBF16,
       0},
      {"skinny dense m 5 n 77 k 2048 BF16, odd ldy", dense, 5, 77, 2048, 0, 3, 0, store,
       DType::kBF16, 0},
      {"skinny dense m 4 n 3000 k 64 gathered (one out of range)", dense, 4, 3000, 64, 0, 0, 9,
       store, DType::kF32, 0},
      {"skinny 64 groups skewed n 520 k 1408 silu, gathered", skewed_group_rows(64), 7, 520, 1408,
       0, 0, 50, silu, DType::kBF16, 0},
      {"skinny 64 groups skewed n 1000 k 256 F32 beta 1, routing ready", skewed_group_rows(64), 5,
       1000, 256, 0, 4, 0, store, DType::kF32, 1, chosen, false, false, false, true},
      {"skinny 64 groups, 6 with 1 row, n 1408 k 2048 silu", one_row_in(64, 6), 0, 1408, 2048, 0, 0,
       1, silu, DType::kBF16, 0},
      {"skinny 64 groups, 6 with 1 row, n 1408 k 2048 silu, routing ready", one_row_in(64, 6), 0,
       1408, 2048, 0, 0, 1, silu, DType::kBF16, 0, chosen, false, false, false, true},
      {"skinny 64 groups, 6 with 1 row, n 2048 k 1408 BF16 + 6 rows", one_row_in(64, 6), 6, 2048,
       1408, 0, 0, 0, store, DType::kBF16, 0},
      {"skinny 64 groups, 6 with 1 row, n 2048 k 1408 F32 graph", one_row_in(64, 6), 2, 2048, 1408,
       0, 0, 3, store, DType::kF32, 0, chosen, false, false, true},
      {"skinny 5 groups, one without weight, n 96 k 136", std::vector<int32_t>{3, 0, 20, 1, 2}, 3,
       96, 136, 0, 0, 0, store, DType::kF32, 0, chosen, false, true},
      // 32-row tiles chosen: more than 16 dense rows, more than 12 rows a group on average.
      {"skinny dense m 30 n 2048 k 2048 BF16", dense, 30, 2048, 2048, 0, 0, 0, store, DType::kBF16,
       0},
      {"skinny 64 groups, 24 rows each on average, n 1408 k 2048 silu, gathered, graph",
       busy_group_rows(64, 256 * 6), 0, 1408, 2048, 0, 0, 256, silu, DType::kBF16, 0, chosen, false,
       false, true, true},
      {"skinny 64 groups, 24 rows each on average, n 2048 k 1408 F32 beta 1",
       busy_group_rows(64, 256 * 6), 3, 2048, 1408, 0, 0, 0, store, DType::kF32, 1},
  };
  for (const SkinnyCase& c : cases) run_skinny_case(c);
  // Every kernel variant, at its fewest and most warps and one between.
  for (const int m_tiles : {1, 2}) {
    for (const int tile_n : {8, 16, 32, 64}) {
      for (const int warps : {1, 3, 8}) {
        for (const bool gated : {false, true}) {
          // Wide tiles hold fewer warps (227 KB of shared memory, 4 stages of 128-byte rows of x
          // and W per warp): 16-row tiles 5 for 64 weight rows, 3 for 128; 32-row tiles 7 for
          // 32, 4 for 64, 2 for 128.
          const int weight_rows = tile_n * (gated ? 2 : 1);
          const int most = m_tiles == 1 ? (weight_rows == 128  ? 3
                                           : weight_rows == 64 ? 5
                                                               : 8)
                                        : (weight_rows == 128  ? 2
                                           : weight_rows == 64 ? 4
                                           : weight_rows == 32 ? 7
                                                               : 8);
          const int w = std::min(warps, most);
          const std::string variant =
              " tile " + std::to_string(tile_n) + " rows " + std::to_string(16 * m_tiles);
          const gpu::SkinnyTiling tiling{tile_n, w, m_tiles};
          if (gated) {
            const std::vector<int32_t> groups = {17, 0, 5, 33};
            run_skinny_case({"skinny 4 groups n 136 k 1408 silu" + variant, groups, 2, 136, 1408, 0,
                             0, 0, silu, DType::kBF16, 0, tiling});
          } else {
            run_skinny_case({"skinny dense m 37 n 300 k 1408 F32" + variant, dense, 37, 300, 1408,
                             0, 1, 0, store, DType::kF32, 0, tiling});
          }
        }
      }
    }
  }

  DeviceArray<uint16_t> a(64 * 64 + 8);
  DeviceArray<float> y(64 * 64);
  gpu::SkinnyGemmParams p;
  p.x = a.data(), p.ldx = 64, p.x_rows = 4, p.max_rows = 4, p.weight = a.data(), p.n = 64;
  p.k = 64, p.y = y.data(), p.ldy = 64;
  const auto with = [&](auto change) {
    gpu::SkinnyGemmParams q = p;
    change(q);
    return [q] { gpu::skinny_gemm(q, kStream); };
  };
  expect_throws<ShapeError>("skinny_gemm k 12", with([](auto& q) { q.k = 12, q.ldx = 16; }));
  expect_throws<ShapeError>("skinny_gemm ldx < k", with([](auto& q) { q.ldx = 32; }));
  expect_throws<ShapeError>("skinny_gemm x_rows < max_rows", with([](auto& q) { q.x_rows = 3; }));
  expect_throws<InvalidArgument>("skinny_gemm null weight",
                                 with([](auto& q) { q.weight = nullptr; }));
  expect_throws<InvalidArgument>("skinny_gemm misaligned x",
                                 with([&](auto& q) { q.x = a.data() + 1; }));
  expect_throws<InvalidArgument>("skinny_gemm misaligned weight",
                                 with([&](auto& q) { q.weight = a.data() + 4; }));
  expect_throws<InvalidArgument>("skinny_gemm BF16 with beta 1",
                                 with([](auto& q) { q.out_dtype = DType::kBF16, q.beta = 1; }));
  expect_throws<InvalidArgument>("skinny_gemm silu into F32", with([&](auto& q) {
                                   q.epilogue = gpu::SkinnyEpilogue::kSiluMul;
                                   q.weight2 = a.data();
                                 }));
  expect_throws<InvalidArgument>("skinny_gemm groups 2 without offsets",
                                 with([](auto& q) { q.groups = 2; }));
  expect_throws<InvalidArgument>("skinny_gemm tile_n 24", [&] {
    gpu::skinny_gemm(p, gpu::SkinnyTiling{24, 4}, kStream);
  });
  expect_throws<InvalidArgument>("skinny_gemm m_tiles 3", [&] {
    gpu::skinny_gemm(p, gpu::SkinnyTiling{16, 4, 3}, kStream);
  });
  expect_throws<InvalidArgument>("skinny_gemm tile 64 gated, 32 rows, with 3 warps", [&] {
    gpu::SkinnyGemmParams q = p;
    q.epilogue = gpu::SkinnyEpilogue::kSiluMul, q.weight2 = a.data(), q.out_dtype = DType::kBF16;
    gpu::skinny_gemm(q, gpu::SkinnyTiling{64, 3, 2}, kStream);  // 2 fit the shared memory
  });
  expect_throws<InvalidArgument>("skinny_gemm tile 64 gated with 8 warps", [&] {
    gpu::SkinnyGemmParams q = p;
    q.epilogue = gpu::SkinnyEpilogue::kSiluMul, q.weight2 = a.data(), q.out_dtype = DType::kBF16;
    gpu::skinny_gemm(q, gpu::SkinnyTiling{64, 8}, kStream);
  });
  // max_rows = 0: nothing happens.
  y.fill_bytes(0x11);
  gpu::SkinnyGemmParams none = p;
  none.max_rows = 0;
  gpu::skinny_gemm(none, kStream);
  sync();
  bool untouched = true;
  for (const float v : y.download()) untouched &= std::bit_cast<uint32_t>(v) == 0x11111111u;
  expect(untouched, "skinny_gemm max_rows = 0 writes nothing");
}

// ---------------------------------------------------------------- model ops

void run_embed_case() {
  const int64_t vocab = 1000, d = 320;
  std::vector<float> table;
  const auto table_bits = random_bf16(static_cast<size_t>(vocab * d), 1.0f, &table);
  std::vector<int32_t> ids = {0, 999, 17, -1, 1000, 3, 3, 512, INT32_MIN, INT32_MAX};
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  for (int i = 0; i < 30; ++i) ids.push_back(pick(rng));
  const auto n = static_cast<int64_t>(ids.size());
  DeviceArray<uint16_t> dtable(table_bits);
  DeviceArray<int32_t> dids(ids);
  DeviceArray<float> x(static_cast<size_t>(n * d));
  poison(x);
  gpu::embed(dids.data(), dtable.data(), x.data(), n, d, vocab, kStream);
  sync();
  const auto got = x.download();
  std::vector<uint32_t> got_bits(got.size()), ref_bits(got.size());
  for (int64_t t = 0; t < n; ++t) {
    const bool valid = ids[t] >= 0 && ids[t] < vocab;
    for (int64_t i = 0; i < d; ++i) {
      const float ref = valid ? table[ids[t] * d + i] : std::bit_cast<float>(0x7fc00000u);
      ref_bits[t * d + i] = std::bit_cast<uint32_t>(ref);
      got_bits[t * d + i] = std::bit_cast<uint32_t>(got[t * d + i]);
    }
  }
  check_equal("embed (ids out of range -> NaN rows 0x7fc00000)", got_bits, ref_bits);
}

void run_rms_norm_case(int64_t n, int64_t width, int64_t pad_x, int64_t pad_o, DType dtype,
                       bool in_place) {
  const int64_t ldx = width + pad_x, ldo = in_place ? ldx : width + pad_o;
  const bool bf16 = dtype == DType::kBF16;
  std::vector<float> x = random_f32(static_cast<size_t>(n * ldx), 1.0f);
  for (size_t i = 0; i < x.size(); i += 97) x[i] *= 30.0f;  // a few large channels
  std::vector<float> weight = random_f32(static_cast<size_t>(width), 0.5f);
  for (auto& w : weight) w += 1.0f;
  const float eps = 1e-6f;
  DeviceArray<float> dx(x), dw(weight);
  DeviceArray<uint8_t> out(static_cast<size_t>(n * ldo) * (bf16 ? 2 : 4));
  out.fill_bytes(0xff);
  void* out_ptr = in_place ? static_cast<void*>(dx.data()) : static_cast<void*>(out.data());
  gpu::rms_norm(dx.data(), ldx, dw.data(), out_ptr, ldo, dtype, n, width, eps, kStream);
  sync();
  std::vector<uint8_t> bytes;
  if (in_place) {
    const auto v = dx.download();
    bytes.resize(v.size() * 4);
    std::memcpy(bytes.data(), v.data(), bytes.size());
  } else {
    bytes = out.download();
  }
  std::vector<float> got;
  std::vector<double> ref, bound;
  for (int64_t r = 0; r < n; ++r) {
    double sum_squares = 0.0;
    for (int64_t i = 0; i < width; ++i)
      sum_squares += static_cast<double>(x[r * ldx + i]) * x[r * ldx + i];
    const double inv_rms = 1.0 / std::sqrt(sum_squares / static_cast<double>(width) + eps);
    for (int64_t i = 0; i < width; ++i) {
      const size_t at = static_cast<size_t>(r * ldo + i);
      float v;
      if (bf16) {
        uint16_t b;
        std::memcpy(&b, bytes.data() + 2 * at, 2);
        v = bf16_to_f32(b);
      } else {
        std::memcpy(&v, bytes.data() + 4 * at, 4);
      }
      const double exact = static_cast<double>(weight[i]) * x[r * ldx + i] * inv_rms;
      // inv_rms rounded to FP32, two FP32 products (the sum in double is exact enough).
      const double f32 = 4 * kF32Unit * std::fabs(exact);
      got.push_back(v);
      ref.push_back(exact);
      bound.push_back(bf16 ? f32 + kBf16Unit * (std::fabs(exact) + f32) : f32);
    }
  }
  check_close("rms_norm n " + std::to_string(n) + " width " + std::to_string(width) +
                  (bf16 ? " BF16" : " F32") + (in_place ? " in place" : " strided"),
              got, ref, bound);
}

// inv_freq as Rope computes it for plain RoPE (base 10000), and with a YaRN-like ramp.
std::vector<float> rope_inv_freq(int dim, bool yarn) {
  std::vector<float> f(static_cast<size_t>(dim / 2));
  for (int i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    f[i] = 1.0f / std::pow(10000.0f, exponent);
    if (yarn && i > 8) f[i] /= 40.0f;
  }
  return f;
}

// x: FP32 buffer, vector v of token t at offset + t * ld_token + v * ld_vec.
void run_rope_case(const std::string& name, int64_t n, int64_t count, int dim, int64_t offset,
                   int64_t ld_token, int64_t ld_vec, int64_t total, bool yarn) {
  std::vector<float> x = random_f32(static_cast<size_t>(total), 2.0f);
  std::vector<int32_t> positions(static_cast<size_t>(n));
  std::uniform_int_distribution<int32_t> pos(0, 200000);
  for (auto& p : positions) p = pos(rng);
  positions[0] = 0;
  if (n > 3) positions[1] = 131071, positions[2] = 200000, positions[3] = 1;
  const std::vector<float> inv_freq = rope_inv_freq(dim, yarn);
  const float attention_factor = yarn ? 1.2079f : 1.0f;
  DeviceArray<float> dx(x), dfreq(inv_freq);
  DeviceArray<int32_t> dpos(positions);
  gpu::rope(dx.data() + offset, ld_token, ld_vec, dpos.data(), dfreq.data(), attention_factor, n,
            count, dim, kStream);
  sync();
  const auto after = dx.download();
  std::vector<bool> rotated(x.size(), false);
  std::vector<float> got;
  std::vector<double> ref, bound;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t v = 0; v < count; ++v) {
      for (int i = 0; i < dim / 2; ++i) {
        const size_t at = static_cast<size_t>(offset + t * ld_token + v * ld_vec + 2 * i);
        const float angle = static_cast<float>(positions[t]) * inv_freq[i];  // FP32, as the CPU
        const double c = std::cos(static_cast<double>(angle)) * attention_factor;
        const double s = std::sin(static_cast<double>(angle)) * attention_factor;
        const double e = x[at], o = x[at + 1];
        // cosf/sinf within 2 ulp (2^-23 absolute for |value| <= 1), the factor's product, the
        // two products and the difference: 2 + 1 + 1 + 1 units of 2^-24 on |e| + |o|.
        const double b = (std::fabs(e) + std::fabs(o)) * attention_factor * 6 * kF32Unit;
        got.push_back(after[at]), ref.push_back(e * c - o * s), bound.push_back(b);
        got.push_back(after[at + 1]), ref.push_back(o * c + e * s), bound.push_back(b);
        rotated[at] = rotated[at + 1] = true;
      }
    }
  }
  check_close(name, got, ref, bound);
  bool others_kept = true;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!rotated[i])
      others_kept &= std::bit_cast<uint32_t>(after[i]) == std::bit_cast<uint32_t>(x[i]);
  }
  expect(others_kept, name + ": values outside the rotated vectors unchanged");
}

// Padding of 3 and 5: the scalar kernel; 0 and 4 (with inner % 4 == 0): the 4-wide one.
// skip_rows: every third row marked as padding (token_of_row -1), to be left untouched.
void run_silu_mul_case(int64_t n, int64_t inner, int64_t ld_padding, int64_t ldo_padding,
                       bool skip_rows = false) {
  const int64_t ld = 2 * inner + ld_padding, ldo = inner + ldo_padding;
  std::vector<float> gate_up = random_f32(static_cast<size_t>(n * ld), 3.0f);
  gate_up[0] = -100.0f;  // exp(100) overflows in FP32: silu is -0
  gate_up[1] = 90.0f;
  DeviceArray<float> dgu(gate_up);
  DeviceArray<uint16_t> out(static_cast<size_t>(n * ldo));
  poison(out);
  std::vector<int32_t> token_of_row(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    token_of_row[r] = skip_rows && r % 3 == 1 ? -1 : static_cast<int32_t>(r);
  }
  DeviceArray<int32_t> dtoken_of_row(token_of_row);
  gpu::silu_mul(dgu.data(), ld, out.data(), ldo, n, inner, kStream,
                skip_rows ? dtoken_of_row.data() : nullptr);
  sync();
  const auto bits = out.download();
  std::vector<float> got;
  std::vector<double> ref, bound;
  bool padding_kept = true;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < ldo; ++i) {
      const uint16_t b = bits[r * ldo + i];
      if (i >= inner || token_of_row[r] < 0) {
        padding_kept &= b == 0xffff;
        continue;
      }
      const double g = gate_up[r * ld + i], u = gate_up[r * ld + inner + i];
      const double exact = g / (1.0 + std::exp(-g)) * u;
      // expf (2 ulp), the sum, the quotient and the product in FP32, then BF16. Where expf(-g)
      // overflows (g < -88.7) FP32 gives g / inf = -0 for a true value below 1e-36.
      const double f32 = 6 * kF32Unit * std::fabs(exact) + (g < -88.0 ? std::fabs(exact) : 0.0);
      got.push_back(bf16_to_f32(b));
      ref.push_back(exact);
      bound.push_back(f32 + kBf16Unit * (std::fabs(exact) + f32));
    }
  }
  check_close("silu_mul n " + std::to_string(n) + " inner " + std::to_string(inner) + " ld " +
                  std::to_string(ld) + " ldo " + std::to_string(ldo) +
                  (skip_rows ? " padding rows" : ""),
              got, ref, bound);
  expect(padding_kept, "silu_mul: columns past inner and padding rows untouched");
}

// rope_queries against rope() (tested above against double) and quantmla::f32_to_bf16: equal
// bits. q rows have the fused projection's stride (q, then 576 cache-row columns); with nope and
// heads * (nope + 64) multiples of 4 the kernel takes its vector path, else its scalar one.
void run_rope_queries_case(int tokens, int heads, int nope, bool decode_q) {
  const int rope = 64, qk = nope + rope, hp = gpu::padded_heads(heads);
  const int64_t stride = static_cast<int64_t>(heads) * qk + 576;
  const std::vector<float> q = random_f32(static_cast<size_t>(tokens * stride), 3.0f);
  std::vector<int32_t> positions(static_cast<size_t>(tokens));
  std::uniform_int_distribution<int32_t> pos(0, 200000);
  for (auto& p : positions) p = pos(rng);
  const std::vector<float> inv_freq = rope_inv_freq(rope, true);
  const float attention_factor = 1.2079f;
  DeviceArray<float> dq(q), rotated(q), dfreq(inv_freq);
  DeviceArray<int32_t> dpos(positions);
  gpu::rope(rotated.data() + nope, stride, qk, dpos.data(), dfreq.data(), attention_factor, tokens,
            heads, rope, kStream);
  sync();
  const std::vector<float> ref_f32 = rotated.download();
  const size_t dec_size = static_cast<size_t>(tokens) * hp * 576;
  DeviceArray<uint16_t> q_bf16(static_cast<size_t>(tokens) * heads * qk), dec(dec_size);
  poison(q_bf16);
  dec.upload(std::vector<uint16_t>(dec_size, 0x1234));
  gpu::RopeQueriesParams p;
  p.q = dq.data(), p.q_token_stride = stride, p.q_bf16 = q_bf16.data();
  p.decode_q = decode_q ? dec.data() : nullptr, p.heads_padded = hp;
  p.positions = dpos.data(), p.inv_freq = dfreq.data(), p.attention_factor = attention_factor;
  p.tokens = tokens, p.heads = heads, p.nope = nope, p.rope = rope;
  gpu::rope_queries(p, kStream);
  sync();
  std::vector<uint16_t> ref(static_cast<size_t>(tokens) * heads * qk), ref_dec(dec_size, 0x1234);
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < hp; ++h) {
      for (int c = 0; c < qk && h < heads; ++c) {
        const uint16_t v = f32_to_bf16(ref_f32[static_cast<size_t>(t * stride + h * qk + c)]);
        ref[(static_cast<size_t>(t) * heads + h) * qk + c] = v;
        if (c >= nope) ref_dec[(static_cast<size_t>(t) * hp + h) * 576 + 512 + c - nope] = v;
      }
      for (int c = 0; c < 576 && h >= heads; ++c) {
        ref_dec[(static_cast<size_t>(t) * hp + h) * 576 + c] = 0;
      }
    }
  }
  const std::string shape = " tokens " + std::to_string(tokens) + " heads " +
                            std::to_string(heads) + " nope " + std::to_string(nope);
  check_equal("rope_queries q_bf16" + shape + " (= rope() then f32_to_bf16)", q_bf16.download(),
              ref);
  if (decode_q) {
    check_equal("rope_queries decode_q" + shape +
                    " (RoPE columns, padding heads zero, content "
                    "columns untouched)",
                dec.download(), ref_dec);
  }
}

void run_gather_rows_case(DType dtype) {
  const int64_t src_rows = 50, width = 300, ld_src = 310, ld_dst = 305;
  const std::vector<float> src = random_f32(static_cast<size_t>(src_rows * ld_src), 1.0f);
  const std::vector<int32_t> rows = {3, 0, 49, 7, -1, 50, 3, 12};
  const auto m = static_cast<int64_t>(rows.size());
  const bool bf16 = dtype == DType::kBF16;
  DeviceArray<float> dsrc(src);
  DeviceArray<int32_t> drows(rows);
  DeviceArray<uint8_t> dst(static_cast<size_t>(m * ld_dst) * (bf16 ? 2 : 4));
  dst.fill_bytes(0xff);
  gpu::gather_rows(dsrc.data(), ld_src, src_rows, drows.data(), m, dst.data(), ld_dst, dtype, width,
                   kStream);
  sync();
  const auto bytes = dst.download();
  std::vector<uint32_t> got, ref;
  for (int64_t i = 0; i < m; ++i) {
    const bool valid = rows[i] >= 0 && rows[i] < src_rows;
    for (int64_t c = 0; c < ld_dst; ++c) {
      const size_t at = static_cast<size_t>(i * ld_dst + c);
      const float value = valid ? src[rows[i] * ld_src + c] : std::bit_cast<float>(0x7fc00000u);
      if (bf16) {
        uint16_t b;
        std::memcpy(&b, bytes.data() + 2 * at, 2);
        got.push_back(b);
        ref.push_back(c < width ? f32_to_bf16(value) : 0xffffu);
      } else {
        uint32_t b;
        std::memcpy(&b, bytes.data() + 4 * at, 4);
        got.push_back(b);
        ref.push_back(c < width ? std::bit_cast<uint32_t>(value) : 0xffffffffu);
      }
    }
  }
  check_equal(std::string("gather_rows ") + (bf16 ? "BF16" : "F32") +
                  " (bad rows -> NaN, padding untouched)",
              got, ref);
}

void run_model_op_errors() {
  DeviceArray<float> a(4096);
  DeviceArray<int32_t> ids(16);
  expect_throws<ShapeError>("rope odd dim", [&] {
    gpu::rope(a.data(), 64, 64, ids.data(), a.data(), 1.0f, 1, 1, 63, kStream);
  });
  expect_throws<ShapeError>("rms_norm ldx < width", [&] {
    gpu::rms_norm(a.data(), 10, a.data(), a.data() + 2048, 20, DType::kF32, 2, 20, 1e-6f, kStream);
  });
  expect_throws<InvalidArgument>("rms_norm BF16 in place", [&] {
    gpu::rms_norm(a.data(), 20, a.data(), a.data(), 20, DType::kBF16, 2, 20, 1e-6f, kStream);
  });
  expect_throws<ShapeError>("rope_queries decode_q heads_padded not a multiple of 16", [&] {
    gpu::RopeQueriesParams p;
    p.q = a.data(), p.q_token_stride = 20 * 192, p.q_bf16 = reinterpret_cast<uint16_t*>(a.data());
    p.decode_q = p.q_bf16, p.positions = ids.data(), p.inv_freq = a.data();
    p.tokens = 1, p.heads = 20, p.heads_padded = 24, p.nope = 128, p.rope = 64;
    gpu::rope_queries(p, kStream);
  });
  expect_throws<ShapeError>("rope_queries q_token_stride too small", [&] {
    gpu::RopeQueriesParams p;
    p.q = a.data(), p.q_token_stride = 100, p.q_bf16 = reinterpret_cast<uint16_t*>(a.data());
    p.positions = ids.data(), p.inv_freq = a.data();
    p.tokens = 2, p.heads = 1, p.nope = 128, p.rope = 64;
    gpu::rope_queries(p, kStream);
  });
}

// ---------------------------------------------------------------- MoE routing

// route_token (src/model/moe_router.cpp), operation by operation, plus a near-tie flag: two
// compared scores within 1e-6, where FP32 differences between libms may flip the choice.
struct RouteResult {
  std::vector<int32_t> experts;
  std::vector<float> weights;
  bool near_tie = false;
};

std::vector<int32_t> top_k(const std::vector<float>& values, int64_t k) {
  std::vector<int32_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return values[a] > values[b]; });
  order.resize(static_cast<size_t>(k));
  return order;
}

bool near_tie_at_cut(std::vector<float> values, int64_t k) {
  std::sort(values.begin(), values.end(), std::greater<>());
  for (int64_t i = 0; i < k && i + 1 < static_cast<int64_t>(values.size()); ++i) {
    if (std::fabs(values[i] - values[i + 1]) <= 1e-6f) return true;
  }
  return false;
}

RouteResult route_reference(const gpu::MoeRouteParams& c, const float* logits,
                            const std::vector<float>& bias) {
  const int64_t n = c.num_experts;
  std::vector<float> scores(logits, logits + n);
  if (c.scoring == gpu::MoeScoring::kSigmoid) {
    for (float& s : scores) s = 1.0f / (1.0f + std::exp(-s));
  } else {
    const float max_logit = *std::max_element(scores.begin(), scores.end());
    float sum = 0.0f;
    for (float& s : scores) sum += (s = std::exp(s - max_logit));
    for (float& s : scores) s /= sum;
  }
  RouteResult result;
  std::vector<float> choice = scores;
  const bool v3 = c.method == gpu::MoeTopkMethod::kNoauxTc;
  if (v3 && !bias.empty()) {
    for (int64_t e = 0; e < n; ++e) choice[e] += bias[e];
  }
  if (c.method != gpu::MoeTopkMethod::kGreedy) {
    const int64_t group_size = n / c.n_group;
    std::vector<float> group_scores(static_cast<size_t>(c.n_group));
    for (int64_t g = 0; g < c.n_group; ++g) {
      std::vector<float> members(choice.begin() + g * group_size,
                                 choice.begin() + (g + 1) * group_size);
      std::sort(members.begin(), members.end(), std::greater<>());
      group_scores[g] = v3 && group_size >= 2 ? members[0] + members[1] : members[0];
    }
    result.near_tie |= near_tie_at_cut(group_scores, c.topk_group);
    std::vector<bool> keep(static_cast<size_t>(c.n_group), false);
    for (int32_t g : top_k(group_scores, c.topk_group)) keep[g] = true;
    for (int64_t e = 0; e < n; ++e) {
      if (!keep[e / group_size]) choice[e] = 0.0f;
    }
  }
  result.near_tie |= near_tie_at_cut(choice, c.top_k);
  result.experts = top_k(choice, c.top_k);
  for (int32_t e : result.experts) result.weights.push_back(scores[e]);
  if (c.norm_topk_prob && (v3 || c.top_k > 1)) {
    const float denominator =
        std::accumulate(result.weights.begin(), result.weights.end(), 0.0f) + 1e-20f;
    for (float& w : result.weights) w /= denominator;
  }
  if (v3 || !c.norm_topk_prob) {
    for (float& w : result.weights) w *= c.routed_scaling_factor;
  }
  return result;
}

void run_route_case(const std::string& name, const gpu::MoeRouteParams& c, int64_t n, bool bias_on,
                    float logit_scale) {
  const int64_t ld = c.num_experts + 3;
  const std::vector<float> logits = random_f32(static_cast<size_t>(n * ld), logit_scale);
  std::vector<float> bias;
  if (bias_on) bias = random_f32(static_cast<size_t>(c.num_experts), 0.05f);
  DeviceArray<float> dlogits(logits), dbias(bias);
  DeviceArray<int32_t> experts(static_cast<size_t>(n * c.top_k));
  poison(experts);
  DeviceArray<float> weights(static_cast<size_t>(n * c.top_k));
  poison(weights);
  gpu::moe_route(dlogits.data(), ld, bias_on ? dbias.data() : nullptr, experts.data(),
                 weights.data(), n, c, kStream);
  sync();
  const auto got_e = experts.download();
  const auto got_w = weights.download();
  int64_t skipped = 0, mismatched = 0, first_mismatch = -1;
  std::vector<float> got;
  std::vector<double> ref, bound;
  for (int64_t t = 0; t < n; ++t) {
    const RouteResult r = route_reference(c, logits.data() + t * ld, bias);
    if (r.near_tie) {
      ++skipped;
      continue;
    }
    bool same = true;
    for (int j = 0; j < c.top_k; ++j) same &= got_e[t * c.top_k + j] == r.experts[j];
    if (!same) {
      if (mismatched++ == 0) first_mismatch = t;
      continue;
    }
    for (int j = 0; j < c.top_k; ++j) {
      got.push_back(got_w[t * c.top_k + j]);
      ref.push_back(r.weights[j]);
      // Both sides in FP32 from libms within 2 ulp: exp, the softmax sum and the normalization.
      bound.push_back(32 * kF32Unit * std::fabs(r.weights[j]));
    }
  }
  std::printf("     %s: %lld of %lld tokens skipped (scores within 1e-6)\n", name.c_str(),
              static_cast<long long>(skipped), static_cast<long long>(n));
  if (mismatched > 0) {
    const RouteResult r = route_reference(c, logits.data() + first_mismatch * ld, bias);
    std::fprintf(stderr, "  %s: %lld tokens route differently, first token %lld: got", name.c_str(),
                 static_cast<long long>(mismatched), static_cast<long long>(first_mismatch));
    for (int j = 0; j < c.top_k; ++j)
      std::fprintf(stderr, " %d", got_e[first_mismatch * c.top_k + j]);
    std::fprintf(stderr, ", reference");
    for (int j = 0; j < c.top_k; ++j) std::fprintf(stderr, " %d", r.experts[j]);
    std::fprintf(stderr, "\n");
  }
  expect(mismatched == 0, name + ": experts match route_token");
  expect(skipped < n / 10, name + ": fewer than 10% of tokens skipped as near-ties");
  check_close(name + ": weights", got, ref, bound);
}

// moe_route_sort against moe_route then moe_sort on the same logits: every output bit for bit,
// for the fused one-block kernel (n * top_k <= 256) and the two-launch path above it.
void run_route_sort_case(const std::string& name, const gpu::MoeRouteParams& c, int64_t n,
                         bool bias_on) {
  const int64_t ld = c.num_experts + 3, entries = n * c.top_k;
  DeviceArray<float> dlogits(random_f32(static_cast<size_t>(n * ld), 1.5f));
  DeviceArray<float> dbias(random_f32(static_cast<size_t>(c.num_experts), 0.05f));
  const float* bias = bias_on ? dbias.data() : nullptr;
  struct Outputs {
    Outputs(int64_t n, int64_t entries, int k, int num_experts)
        : experts(static_cast<size_t>(entries)),
          counts(static_cast<size_t>(num_experts)),
          offsets(static_cast<size_t>(num_experts) + 1),
          slot_of(static_cast<size_t>(entries)),
          token_of_slot(static_cast<size_t>(entries)),
          weights(static_cast<size_t>(entries)),
          workspace(std::max<size_t>(gpu::moe_sort_workspace_bytes(n, k, num_experts), 4)) {
      poison(experts), poison(counts), poison(offsets), poison(slot_of);
      poison(token_of_slot), poison(weights);
    }
    DeviceArray<int32_t> experts, counts, offsets, slot_of, token_of_slot;
    DeviceArray<float> weights;
    DeviceArray<uint8_t> workspace;
    gpu::MoeSortBuffers buffers() {
      return {counts.data(), offsets.data(), slot_of.data(), token_of_slot.data(),
              workspace.data()};
    }
  };
  Outputs fused(n, entries, c.top_k, c.num_experts), separate(n, entries, c.top_k, c.num_experts);
  gpu::moe_route_sort(dlogits.data(), ld, bias, fused.experts.data(), fused.weights.data(), n, c,
                      fused.buffers(), kStream);
  gpu::moe_route(dlogits.data(), ld, bias, separate.experts.data(), separate.weights.data(), n, c,
                 kStream);
  gpu::moe_sort(separate.experts.data(), n, c.top_k, c.num_experts, separate.buffers(), kStream);
  sync();
  check_equal(name + ": experts", fused.experts.download(), separate.experts.download());
  check_equal(name + ": weights", fused.weights.download(), separate.weights.download());
  check_equal(name + ": counts", fused.counts.download(), separate.counts.download());
  check_equal(name + ": offsets", fused.offsets.download(), separate.offsets.download());
  check_equal(name + ": slot_of", fused.slot_of.download(), separate.slot_of.download());
  check_equal(name + ": token_of_slot", fused.token_of_slot.download(),
              separate.token_of_slot.download());
}

void run_route_cases() {
  // DeepSeek-V2-Lite: softmax, greedy, 64 experts, 6 per token, no renormalization.
  gpu::MoeRouteParams v2;
  v2.num_experts = 64, v2.top_k = 6, v2.scoring = gpu::MoeScoring::kSoftmax;
  v2.method = gpu::MoeTopkMethod::kGreedy, v2.norm_topk_prob = false;
  v2.routed_scaling_factor = 1.0f;
  run_route_case("moe_route V2 greedy softmax E=64 k=6", v2, 1000, false, 1.0f);
  v2.norm_topk_prob = true;  // no scaling then (the V2 rule)
  v2.routed_scaling_factor = 16.0f;
  run_route_case("moe_route V2 greedy softmax E=64 k=6 norm_topk_prob", v2, 500, false, 1.0f);

  gpu::MoeRouteParams v2g;
  v2g.num_experts = 16, v2g.top_k = 3, v2g.scoring = gpu::MoeScoring::kSoftmax;
  v2g.method = gpu::MoeTopkMethod::kGroupLimitedGreedy, v2g.n_group = 4, v2g.topk_group = 2;
  v2g.routed_scaling_factor = 2.0f;
  run_route_case("moe_route V2 group_limited_greedy E=16 groups 4 top 2", v2g, 1000, false, 1.0f);

  // DeepSeek-V3 through moe_route_params (a config as ModelConfig holds it).
  ModelConfig config;
  config.n_routed_experts = 256, config.num_experts_per_tok = 8, config.n_group = 8;
  config.topk_group = 4, config.norm_topk_prob = true, config.routed_scaling_factor = 2.5;
  config.scoring_func = "sigmoid", config.topk_method = "noaux_tc";
  const gpu::MoeRouteParams v3 = gpu::moe_route_params(config);
  run_route_case("moe_route V3 sigmoid noaux_tc E=256 k=8 groups 8 top 4", v3, 1000, true, 2.0f);
  for (const int64_t n : {1, 16, 32, 300}) {  // 300: past one block, the two-launch path
    const std::string tokens = " n " + std::to_string(n);
    run_route_sort_case("moe_route_sort V2 greedy" + tokens, v2, n, false);
    run_route_sort_case("moe_route_sort V2 group_limited_greedy" + tokens, v2g, n, false);
    run_route_sort_case("moe_route_sort V3 noaux_tc" + tokens, v3, n, true);
  }

  config.topk_method = "top_p";
  expect_throws<InvalidArgument>("moe_route_params unknown topk_method",
                                 [&] { gpu::moe_route_params(config); });
  DeviceArray<float> a(1024);
  DeviceArray<int32_t> e(64);
  gpu::MoeRouteParams bad = v3;
  bad.num_experts = 300;
  expect_throws<InvalidArgument>("moe_route 300 experts", [&] {
    gpu::moe_route(a.data(), 300, nullptr, e.data(), a.data(), 1, bad, kStream);
  });
  bad = v3, bad.top_k = 9;
  expect_throws<InvalidArgument>("moe_route top_k 9", [&] {
    gpu::moe_route(a.data(), 256, nullptr, e.data(), a.data(), 1, bad, kStream);
  });
  bad = v3, bad.n_group = 3;
  expect_throws<InvalidArgument>("moe_route n_group 3 of 256", [&] {
    gpu::moe_route(a.data(), 256, nullptr, e.data(), a.data(), 1, bad, kStream);
  });
}

// ---------------------------------------------------------------- MoE sort, gather, combine

struct HostSort {
  std::vector<int32_t> counts, offsets, slot_of, token_of_slot;
};

HostSort sort_reference(const std::vector<int32_t>& experts, int64_t n, int k, int num_experts) {
  HostSort s;
  s.counts.assign(static_cast<size_t>(num_experts), 0);
  for (const int32_t e : experts) {
    if (e >= 0 && e < num_experts) ++s.counts[e];
  }
  s.offsets.assign(static_cast<size_t>(num_experts) + 1, 0);
  for (int e = 0; e < num_experts; ++e) s.offsets[e + 1] = s.offsets[e] + s.counts[e];
  std::vector<int32_t> next(s.offsets.begin(), s.offsets.end() - 1);
  s.slot_of.assign(experts.size(), -1);
  s.token_of_slot.assign(experts.size(), -1);
  for (int64_t i = 0; i < n * k; ++i) {  // (t, j) order: stable
    const int32_t e = experts[i];
    if (e < 0 || e >= num_experts) continue;
    s.slot_of[i] = next[e]++;
    s.token_of_slot[s.slot_of[i]] = static_cast<int32_t>(i / k);
  }
  return s;
}

// Distinct random experts per token (as routing gives), optionally skewed towards expert 5.
std::vector<int32_t> random_choices(int64_t n, int k, int num_experts, bool skewed) {
  std::vector<int32_t> experts(static_cast<size_t>(n * k));
  std::vector<int32_t> all(static_cast<size_t>(num_experts));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < n; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    if (skewed) {
      const auto five = std::find(all.begin(), all.end(), 5);
      std::iter_swap(all.begin(), five);
    }
    std::copy_n(all.begin(), k, experts.begin() + t * k);
  }
  return experts;
}

void run_sort_case(const std::string& name, std::vector<int32_t> experts, int64_t n, int k,
                   int num_experts) {
  const HostSort ref = sort_reference(experts, n, k, num_experts);
  const auto entries = static_cast<size_t>(n * k);
  DeviceArray<int32_t> dexperts(experts);
  DeviceArray<int32_t> counts(static_cast<size_t>(num_experts));
  poison(counts);
  DeviceArray<int32_t> offsets(static_cast<size_t>(num_experts) + 1);
  poison(offsets);
  DeviceArray<int32_t> slot_of(entries);
  poison(slot_of);
  DeviceArray<int32_t> token_of_slot(entries);
  poison(token_of_slot);
  DeviceArray<uint8_t> workspace(gpu::moe_sort_workspace_bytes(n, k, num_experts));
  workspace.fill_bytes(0xff);
  gpu::MoeSortBuffers buffers{counts.data(), offsets.data(), slot_of.data(), token_of_slot.data(),
                              workspace.data()};
  gpu::moe_sort(dexperts.data(), n, k, num_experts, buffers, kStream);
  sync();
  check_equal(name + ": counts", counts.download(), ref.counts);
  check_equal(name + ": offsets", offsets.download(), ref.offsets);
  check_equal(name + ": slot_of", slot_of.download(), ref.slot_of);
  check_equal(name + ": token_of_slot", token_of_slot.download(), ref.token_of_slot);
}

void run_gather_combine_case(int64_t n, int k, int num_experts, int64_t d) {
  const std::vector<int32_t> experts = random_choices(n, k, num_experts, false);
  const HostSort ref = sort_reference(experts, n, k, num_experts);
  const int64_t slots = n * k, ld_h = d + 8, ld_sorted = d;
  const auto h_bits = random_bf16(static_cast<size_t>(n * ld_h), 1.0f);
  DeviceArray<uint16_t> dh(h_bits);
  DeviceArray<int32_t> dtoken(ref.token_of_slot), dslot(ref.slot_of);
  DeviceArray<uint16_t> sorted(static_cast<size_t>(slots * ld_sorted));
  poison(sorted);
  gpu::moe_gather(dh.data(), ld_h, n, dtoken.data(), slots, sorted.data(), ld_sorted, d, kStream);
  sync();
  std::vector<uint16_t> sorted_ref(static_cast<size_t>(slots * ld_sorted));
  for (int64_t s = 0; s < slots; ++s) {
    std::copy_n(h_bits.begin() + ref.token_of_slot[s] * ld_h, d,
                sorted_ref.begin() + s * ld_sorted);
  }
  check_equal("moe_gather n " + std::to_string(n) + " k " + std::to_string(k) + " d " +
                  std::to_string(d) + " (16-byte path)",
              sorted.download(), sorted_ref);
  // An odd width takes the scalar path.
  DeviceArray<uint16_t> sorted_odd(static_cast<size_t>(slots * (d - 1)));
  poison(sorted_odd);
  gpu::moe_gather(dh.data(), ld_h, n, dtoken.data(), slots, sorted_odd.data(), d - 1, d - 1,
                  kStream);
  sync();
  std::vector<uint16_t> odd_ref(static_cast<size_t>(slots * (d - 1)));
  for (int64_t s = 0; s < slots; ++s) {
    std::copy_n(h_bits.begin() + ref.token_of_slot[s] * ld_h, d - 1, odd_ref.begin() + s * (d - 1));
  }
  check_equal("moe_gather odd width (scalar path)", sorted_odd.download(), odd_ref);
  // Padding rows (token -1) and tokens past n give zeros, on both paths.
  std::vector<int32_t> padded_tokens = ref.token_of_slot;
  for (size_t s = 0; s < padded_tokens.size(); s += 3) padded_tokens[s] = s % 2 ? -1 : int32_t(n);
  DeviceArray<int32_t> dpadded(padded_tokens);
  for (const int64_t width : {d, d - 1}) {
    DeviceArray<uint16_t> out(static_cast<size_t>(slots * width));
    poison(out);
    gpu::moe_gather(dh.data(), ld_h, n, dpadded.data(), slots, out.data(), width, width, kStream);
    sync();
    std::vector<uint16_t> want(static_cast<size_t>(slots * width), 0);
    for (int64_t s = 0; s < slots; ++s) {
      if (padded_tokens[s] < 0 || padded_tokens[s] >= n) continue;
      std::copy_n(h_bits.begin() + padded_tokens[s] * ld_h, width, want.begin() + s * width);
    }
    check_equal("moe_gather padding rows and tokens past n, width " + std::to_string(width),
                out.download(), want);
  }

  // ld_x = d + 2: the scalar kernel; d + 4: the 4-wide one.
  for (const int64_t x_padding : {2, 4}) {
    const int64_t ld_out = d + 4, ld_x = d + x_padding;
    const std::vector<float> expert_out = random_f32(static_cast<size_t>(slots * ld_out), 1.0f);
    const std::vector<float> weights = random_f32(static_cast<size_t>(n * k), 0.3f);
    const std::vector<float> x0 = random_f32(static_cast<size_t>(n * ld_x), 1.0f);
    DeviceArray<float> dout(expert_out), dweights(weights), dx(x0);
    // x0 plus the fma chain in j order over `values` (the outputs as the kernel reads them).
    const auto combined = [&](const std::vector<float>& values) {
      std::vector<float> x_ref = x0;
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t c = 0; c < d; ++c) {
          float sum = 0.0f;
          for (int j = 0; j < k; ++j) {
            sum = std::fma(weights[t * k + j], values[ref.slot_of[t * k + j] * ld_out + c], sum);
          }
          x_ref[t * ld_x + c] = x0[t * ld_x + c] + sum;
        }
      }
      return x_ref;
    };
    gpu::moe_combine(dout.data(), ld_out, dslot.data(), dweights.data(), dx.data(), ld_x, n, k, d,
                     kStream);
    sync();
    check_equal(
        "moe_combine ld_x " + std::to_string(ld_x) + " (fma chain in j order, padding untouched)",
        dx.download(), combined(expert_out));
    // The same with BF16 expert outputs (the runner's batched experts): their values in the
    // same chain, bit for bit.
    std::vector<float> out_values;
    DeviceArray<uint16_t> dout_bf16(
        random_bf16(static_cast<size_t>(slots * ld_out), 1.0f, &out_values));
    dx.upload(x0);
    gpu::moe_combine(dout_bf16.data(), ld_out, dslot.data(), dweights.data(), dx.data(), ld_x, n, k,
                     d, kStream);
    sync();
    check_equal("moe_combine BF16 outputs, ld_x " + std::to_string(ld_x), dx.download(),
                combined(out_values));
  }
}

// moe_pad_layout against pad_expert_layout (the host reference) on the same sort, rows the busiest
// count rounded up to 16 as the runner sizes them; invalid entries (no slot) included.
void run_pad_layout_case(const std::string& name, std::vector<int32_t> experts, int64_t n, int k,
                         int num_experts) {
  const HostSort ref = sort_reference(experts, n, k, num_experts);
  int64_t busiest = 0;
  for (int e = 0; e < num_experts; ++e) busiest = std::max<int64_t>(busiest, ref.counts[e]);
  const int64_t rows = std::max<int64_t>((busiest + 15) / 16 * 16, 1);
  std::vector<int32_t> token_of_row_ref, slot_of_ref = ref.slot_of;
  gpu::pad_expert_layout(ref.offsets.data(), num_experts, ref.token_of_slot.data(), rows,
                         token_of_row_ref, slot_of_ref);
  DeviceArray<int32_t> doffsets(ref.offsets), dtoken(ref.token_of_slot), dexperts(experts),
      dslot(ref.slot_of);
  DeviceArray<int32_t> token_of_row(static_cast<size_t>(num_experts * rows));
  DeviceArray<int32_t> padded_slot_of(experts.size());
  poison(token_of_row);
  poison(padded_slot_of);
  gpu::moe_pad_layout(doffsets.data(), num_experts, dtoken.data(), dexperts.data(), dslot.data(),
                      n * k, rows, token_of_row.data(), padded_slot_of.data(), kStream);
  sync();
  check_equal(name + ": token_of_row", token_of_row.download(), token_of_row_ref);
  check_equal(name + ": padded slot_of", padded_slot_of.download(), slot_of_ref);
}

void run_pad_layout_errors() {
  DeviceArray<int32_t> a(16);
  int32_t* p = a.data();
  expect_throws<ShapeError>("moe_pad_layout rows 0",
                            [&] { gpu::moe_pad_layout(p, 4, p, p, p, 8, 0, p, p, kStream); });
  expect_throws<ShapeError>("moe_pad_layout E * rows past 2^31", [&] {
    gpu::moe_pad_layout(p, 256, p, p, p, 8, int64_t{1} << 24, p, p, kStream);
  });
  expect_throws<InvalidArgument>("moe_pad_layout null experts", [&] {
    gpu::moe_pad_layout(p, 4, p, nullptr, p, 8, 4, p, p, kStream);
  });
}

// expert_gemm (the grouped wgmma product over each expert's exact rows) against double: empty
// experts, one row, a partial token tile, more than two token tiles, the last expert's last tile
// reaching past x's rows (the copies' zero fill); every output row written once and the columns
// past n of a wider output untouched (the output starts as NaN). Plain: y = x W^T in FP32 (or
// BF16: kPlainBf16); gated: act = bf16(silu(x G^T) * (x U^T)), W = [G; U]. rows_per_expert > 0:
// the padded layout, expert e's rows from e rows_per_expert, the padding rows of x random and those
// of the output untouched. timed: with ExpertGemmParams::phases, one ordered record from each block
// with rows, none from the others (blocks numbered token tile fastest, then weight tile, then
// expert).
enum class ExpertForm { kPlainF32, kPlainBf16, kGated };
struct ExpertGemmCase {
  std::vector<int32_t> counts;  // rows of each expert
  int64_t n = 0, k = 0;
  ExpertForm form = ExpertForm::kPlainF32;
  int stages = 4;
  int64_t ld_out = 0;
  int64_t rows_per_expert = 0;  // > 0: the padded layout
  bool timed = false;           // with ExpertGemmParams::phases
};
void run_expert_gemm_case(const ExpertGemmCase& test) {
  const std::vector<int32_t>& counts = test.counts;
  const int64_t n = test.n, k = test.k, ld_out = test.ld_out;
  const int64_t rows_per_expert = test.rows_per_expert;
  const int stages = test.stages;
  const bool timed = test.timed;
  const bool gated = test.form == ExpertForm::kGated;
  const bool bf16_out = test.form == ExpertForm::kPlainBf16;
  const int experts = static_cast<int>(counts.size());
  std::vector<int32_t> offsets(experts + 1, 0);
  for (int e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + counts[e];
  const auto first_row = [&](int e) {
    return rows_per_expert > 0 ? e * rows_per_expert : int64_t{offsets[e]};
  };
  const int64_t rows = rows_per_expert > 0 ? experts * rows_per_expert : offsets[experts];
  const int64_t weight_rows = gated ? 2 * n : n;
  std::vector<float> x, w;
  DeviceArray<uint16_t> dx(random_bf16(static_cast<size_t>(rows * k), 1.0f, &x));
  DeviceArray<uint16_t> dw(random_bf16(static_cast<size_t>(experts * weight_rows * k), 0.05f, &w));
  DeviceArray<int32_t> doffsets(offsets);
  DeviceArray<float> y(gated || bf16_out ? 0 : static_cast<size_t>(rows * ld_out));
  DeviceArray<uint16_t> act(gated || bf16_out ? static_cast<size_t>(rows * ld_out) : 0);
  poison(y), poison(act);
  gpu::ExpertGemmParams p;
  p.x = dx.data(), p.ldx = k, p.x_rows = rows, p.w = dw.data(), p.w_stride = weight_rows * k;
  p.offsets = doffsets.data(), p.num_experts = experts, p.n = n, p.k = k;
  if (gated) {
    p.act = act.data(), p.ld_act = ld_out;
  } else if (bf16_out) {
    p.y_bf16 = act.data(), p.ldy = ld_out;
  } else {
    p.y = y.data(), p.ldy = ld_out;
  }
  p.max_rows = *std::max_element(counts.begin(), counts.end());
  p.rows_per_expert = rows_per_expert;
  p.stages = stages;
  const int64_t token_tiles = (p.max_rows + 255) / 256, weight_tiles = n / (gated ? 64 : 128);
  expect(gpu::expert_gemm_blocks(p) == token_tiles * weight_tiles * experts,
         "expert_gemm_blocks: token tiles x weight tiles x experts");
  DeviceArray<gpu::ExpertGemmPhases> phases(timed ? static_cast<size_t>(gpu::expert_gemm_blocks(p))
                                                  : 0);
  if (timed) phases.fill_bytes(0), p.phases = phases.data();
  gpu::expert_gemm(p, kStream);
  sync();
  if (timed) {  // a record for each block with rows, its times in order, none for the others
    const std::vector<gpu::ExpertGemmPhases> records = phases.download();
    bool ordered = true;
    for (int e = 0; e < experts; ++e) {
      for (int64_t y = 0; y < weight_tiles; ++y) {
        for (int64_t x = 0; x < token_tiles; ++x) {
          const auto& r = records[static_cast<size_t>(x + token_tiles * (y + weight_tiles * e))];
          const bool has_rows = x * 256 < counts[e];
          ordered &= r.valid == (has_rows ? 1u : 0u) &&
                     (!has_rows || (r.start <= r.first_data && r.first_data <= r.products_done &&
                                    r.products_done <= r.end && r.global_start <= r.global_end));
        }
      }
    }
    expect(ordered, "expert_gemm phases: one ordered record a block with rows");
  }
  const std::vector<float> all = gated || bf16_out ? to_float(act.download()) : y.download();
  // x W_e^T row `c` in double, with the bound of its FP32 accumulation.
  const auto product = [&](int e, int64_t r, int64_t c, double* bound) {
    double sum = 0.0, magnitude = 0.0;
    for (int64_t i = 0; i < k; ++i) {
      const double prod = static_cast<double>(x[r * k + i]) * w[(e * weight_rows + c) * k + i];
      sum += prod;
      magnitude += std::fabs(prod);
    }
    *bound = k * kAccumulateUnit * magnitude + kF32Unit * std::fabs(sum);
    return sum;
  };
  std::vector<float> got;
  std::vector<double> ref, bound;
  bool rest_untouched = true;
  for (int e = 0; e < experts; ++e) {
    const int64_t real_end = first_row(e) + counts[e];
    const int64_t end = rows_per_expert > 0 ? first_row(e) + rows_per_expert : real_end;
    for (int64_t r = first_row(e); r < end; ++r) {
      for (int64_t c = 0; c < ld_out; ++c) {
        const float value = all[static_cast<size_t>(r * ld_out + c)];
        if (c >= n || r >= real_end) {
          rest_untouched &= std::isnan(value);
          continue;
        }
        double dg = 0.0;
        const double g = product(e, r, c, &dg);
        got.push_back(value);
        if (!gated) {  // one BF16 rounding more with bf16_out
          ref.push_back(g);
          bound.push_back(bf16_out ? dg + kBf16Unit * (std::fabs(g) + dg) : dg);
          continue;
        }
        // As the skinny GEMM's silu epilogue: |silu'| <= 1.1, 6 FP32 units for expf, the sum,
        // the quotient and the product, then one BF16 rounding.
        double du = 0.0;
        const double u = product(e, r, n + c, &du);
        const double s = g / (1.0 + std::exp(-g)), exact = s * u;
        const double err = 1.1 * dg * (std::fabs(u) + du) + (std::fabs(s) + 1.1 * dg) * du +
                           6 * kF32Unit * std::fabs(exact) + (g < -88.0 ? std::fabs(exact) : 0.0);
        ref.push_back(exact);
        bound.push_back(err + kBf16Unit * (std::fabs(exact) + err));
      }
    }
  }
  std::string shape = std::string("expert_gemm ") +
                      (gated      ? "gated"
                       : bf16_out ? "plain bf16 out"
                                  : "plain") +
                      " s" + std::to_string(stages) + " n " + std::to_string(n) + " k " +
                      std::to_string(k) + " ld " + std::to_string(ld_out) +
                      (rows_per_expert > 0 ? " padded to " + std::to_string(rows_per_expert) : "") +
                      (timed ? " timed" : "") + " rows";
  for (const int32_t c : counts) shape += " " + std::to_string(c);
  check_close(shape, got, ref, bound);
  expect(rest_untouched, shape + ": columns past n and padding rows untouched");
}

void run_expert_gemm_errors() {
  DeviceArray<uint16_t> a(1024);
  DeviceArray<int32_t> offsets(std::vector<int32_t>{0, 4});
  DeviceArray<float> y(1024);
  gpu::ExpertGemmParams p;
  p.x = a.data(), p.ldx = 64, p.x_rows = 4, p.w = a.data(), p.w_stride = 128 * 64;
  p.offsets = offsets.data(), p.num_experts = 1, p.n = 128, p.k = 64, p.y = y.data(), p.ldy = 128,
  p.max_rows = 4;
  gpu::ExpertGemmParams bad = p;
  bad.n = 100;
  expect_throws<ShapeError>("expert_gemm n 100", [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.k = 96;
  expect_throws<ShapeError>("expert_gemm k 96", [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.w = nullptr;
  expect_throws<InvalidArgument>("expert_gemm null w", [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.x = a.data() + 1;
  expect_throws<InvalidArgument>("expert_gemm x not 16-byte aligned",
                                 [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.w_stride = 100 * 64;
  expect_throws<ShapeError>("expert_gemm w_stride below an expert's weights",
                            [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.x_rows = 0;
  expect_throws<ShapeError>("expert_gemm x_rows 0", [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.w = a.data() + 4;
  expect_throws<InvalidArgument>("expert_gemm w not 16-byte aligned",
                                 [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.ldy = 130;
  expect_throws<ShapeError>("expert_gemm ldy 130", [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.y_bf16 = reinterpret_cast<uint16_t*>(bad.y);
  expect_throws<InvalidArgument>("expert_gemm both y and y_bf16",
                                 [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.y_bf16 = reinterpret_cast<uint16_t*>(bad.y) + 2, bad.y = nullptr;
  expect_throws<InvalidArgument>("expert_gemm y_bf16 not 8-byte aligned",
                                 [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.stages = 7;
  expect_throws<ShapeError>("expert_gemm 7 stages", [&] { gpu::expert_gemm(bad, kStream); });

  // Gated: n counts the activation's columns (64 a block).
  DeviceArray<uint16_t> act(1024);
  bad = p, bad.y = nullptr, bad.act = act.data(), bad.ld_act = 96, bad.n = 96;
  expect_throws<ShapeError>("expert_gemm gated n 96", [&] { gpu::expert_gemm(bad, kStream); });
  bad.n = 64, bad.ld_act = 68;
  expect_throws<ShapeError>("expert_gemm gated ld_act 68", [&] { gpu::expert_gemm(bad, kStream); });
  bad.ld_act = 64, bad.act = act.data() + 4;
  expect_throws<InvalidArgument>("expert_gemm act not 16-byte aligned",
                                 [&] { gpu::expert_gemm(bad, kStream); });
  // The padded layout: an expert's block below the busiest, and x shorter than the blocks.
  bad = p, bad.rows_per_expert = 3;
  expect_throws<ShapeError>("expert_gemm rows_per_expert 3 below max_rows 4",
                            [&] { gpu::expert_gemm(bad, kStream); });
  bad = p, bad.rows_per_expert = 8;
  expect_throws<ShapeError>("expert_gemm rows_per_expert 8 past x_rows 4",
                            [&] { gpu::expert_gemm(bad, kStream); });
}

// The whole expert path: sort, offsets to the host, gather, expert MLPs; against double.
void run_expert_mlp_case(gpu::GemmRunner& gemm) {
  const int num_experts = 8, k = 2;
  const int64_t n = 40, d = 256, inner = 128;
  // Expert 7 gets no tokens and has null weights: the helper must not touch it.
  std::vector<int32_t> experts = random_choices(n, k, num_experts - 1, false);
  const HostSort ref = sort_reference(experts, n, k, num_experts);
  const int64_t slots = n * k;
  std::vector<float> h;
  const auto h_bits = random_bf16(static_cast<size_t>(n * d), 1.0f, &h);
  // Every expert's matrices in one allocation per kind, [E - 1, rows, cols].
  const auto matrix = static_cast<size_t>(inner * d);
  std::vector<float> g_all, u_all, d_all;
  DeviceArray<uint16_t> dwg(random_bf16(matrix * (num_experts - 1), 1.0f / 16, &g_all));
  DeviceArray<uint16_t> dwu(random_bf16(matrix * (num_experts - 1), 1.0f / 16, &u_all));
  DeviceArray<uint16_t> dwd(random_bf16(matrix * (num_experts - 1), 1.0f / 11, &d_all));
  std::vector<const float*> wg(num_experts), wu(num_experts), wd(num_experts);
  std::vector<const uint16_t*> pg(num_experts, nullptr), pu(num_experts, nullptr),
      pd(num_experts, nullptr);
  for (int e = 0; e < num_experts - 1; ++e) {
    wg[e] = g_all.data() + e * matrix, wu[e] = u_all.data() + e * matrix;
    wd[e] = d_all.data() + e * matrix;
    pg[e] = dwg.data() + e * matrix, pu[e] = dwu.data() + e * matrix;
    pd[e] = dwd.data() + e * matrix;
  }
  DeviceArray<uint16_t> dh(h_bits);
  DeviceArray<int32_t> dexperts(experts), counts(num_experts), offsets(num_experts + 1),
      slot_of(static_cast<size_t>(slots)), token_of_slot(static_cast<size_t>(slots));
  DeviceArray<uint8_t> workspace(gpu::moe_sort_workspace_bytes(n, k, num_experts));
  gpu::moe_sort(
      dexperts.data(), n, k, num_experts,
      {counts.data(), offsets.data(), slot_of.data(), token_of_slot.data(), workspace.data()},
      kStream);
  std::vector<int32_t> host_offsets(num_experts + 1);
  QUANTMLA_CUDA_CHECK(cudaMemcpyAsync(host_offsets.data(), offsets.data(),
                                      host_offsets.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                      kStream));
  QUANTMLA_CUDA_CHECK(cudaStreamSynchronize(kStream));
  DeviceArray<uint16_t> sorted(static_cast<size_t>(slots * d));
  poison(sorted);
  gpu::moe_gather(dh.data(), d, n, token_of_slot.data(), slots, sorted.data(), d, d, kStream);
  DeviceArray<float> gate_up(static_cast<size_t>(slots * 2 * inner));
  poison(gate_up);
  DeviceArray<uint16_t> act(static_cast<size_t>(slots * inner));
  poison(act);
  DeviceArray<float> out(static_cast<size_t>(slots * d));
  poison(out);
  const gpu::MoeExpertWeights weights{pg.data(), pu.data(), pd.data()};
  gpu::moe_expert_mlps(gemm, host_offsets.data(), num_experts, sorted.data(), d, weights, d, inner,
                       gate_up.data(), act.data(), out.data(), d, kStream);
  sync();
  const auto got = out.download();
  std::vector<double> reference(got.size()), bound(got.size());
  for (int64_t s = 0; s < slots; ++s) {
    const int e = static_cast<int>(std::upper_bound(ref.offsets.begin(), ref.offsets.end(), s) -
                                   ref.offsets.begin()) -
                  1;
    const float* x = h.data() + ref.token_of_slot[s] * d;
    std::vector<double> a(static_cast<size_t>(inner)), da(static_cast<size_t>(inner));
    for (int64_t i = 0; i < inner; ++i) {
      double g = 0, u = 0, mg = 0, mu = 0;
      for (int64_t c = 0; c < d; ++c) {
        g += static_cast<double>(x[c]) * wg[e][i * d + c];
        u += static_cast<double>(x[c]) * wu[e][i * d + c];
        mg += std::fabs(static_cast<double>(x[c]) * wg[e][i * d + c]);
        mu += std::fabs(static_cast<double>(x[c]) * wu[e][i * d + c]);
      }
      const double dg = d * kAccumulateUnit * mg + kF32Unit * std::fabs(g);
      const double du = d * kAccumulateUnit * mu + kF32Unit * std::fabs(u);
      const double silu = g / (1.0 + std::exp(-g));
      a[i] = silu * u;
      // |silu'| <= 1.1; silu_mul's own FP32 error (6 units) and the BF16 rounding of act.
      const double f32 = 1.1 * dg * (std::fabs(u) + du) + (std::fabs(silu) + 1.1 * dg) * du +
                         6 * kF32Unit * std::fabs(a[i]);
      da[i] = f32 + kBf16Unit * (std::fabs(a[i]) + f32);
    }
    for (int64_t c = 0; c < d; ++c) {
      double sum = 0, magnitude = 0, propagated = 0;
      for (int64_t i = 0; i < inner; ++i) {
        const double w = wd[e][c * inner + i];
        sum += a[i] * w;
        magnitude += (std::fabs(a[i]) + da[i]) * std::fabs(w);
        propagated += da[i] * std::fabs(w);
      }
      reference[s * d + c] = sum;
      bound[s * d + c] = propagated + inner * kAccumulateUnit * magnitude +
                         kF32Unit * (std::fabs(sum) + propagated);
    }
  }
  check_close("moe_expert_mlps E=8 (one empty, null weights) d 256 inner 128", got, reference,
              bound);
}

// ---------------------------------------------------------------- sampling

// Host nucleus by the documented rule: p = exp((l - max) / T); tau = the smallest p of the shortest
// descending prefix reaching top_p * S; every p >= tau. slack widens it for FP32-vs-double
// differences at the boundary (top_p + slack, tau * (1 - 1e-6)).
std::vector<bool> host_nucleus(const float* logits, int64_t vocab, float temperature, float top_p,
                               double slack, std::vector<double>* probs_out = nullptr) {
  const float max_logit = *std::max_element(logits, logits + vocab);
  std::vector<double> p(static_cast<size_t>(vocab));
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - max_logit) / temperature);
    sum += p[i];
  }
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  const double target = std::min(1.0, static_cast<double>(top_p) + slack) * sum;
  double kept = 0.0;
  size_t count = 0;
  while (count < order.size() && (count == 0 || kept < target * (1.0 - 1e-12))) {
    kept += p[order[count++]];
  }
  const double tau = p[order[count - 1]] * (1.0 - (slack > 0.0 ? 1e-6 : 0.0));
  std::vector<bool> in(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) in[i] = p[i] >= tau;
  if (probs_out != nullptr) *probs_out = p;
  return in;
}

// sample_token (src/model/sampler.cpp) with the draw given: probabilities in double, the shortest
// descending prefix reaching top_p * sum, the draw spent in descending order (a stable sort: equal
// probabilities in index order, as the GPU). `ambiguous`: FP32-vs-double differences (relative
// 1e-5 here, a wide margin over exp2f's) could move the nucleus cut or the draw to a neighbour.
struct HostDraw {
  int32_t token = -1;
  bool ambiguous = false;
};

HostDraw cpu_sample(const float* logits, int64_t vocab, float temperature, float top_p,
                    double uniform) {
  constexpr double kMargin = 1e-5;
  const float best = *std::max_element(logits, logits + vocab);
  std::vector<double> probs(static_cast<size_t>(vocab));
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    probs[i] = std::exp((static_cast<double>(logits[i]) - best) / temperature);
    sum += probs[i];
  }
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return probs[a] > probs[b]; });
  std::vector<double> cum(order.size());
  double kept = 0.0;
  size_t nucleus = 0;
  while (nucleus < order.size() && (nucleus == 0 || kept < top_p * sum)) {
    kept += probs[order[nucleus]];
    cum[nucleus++] = kept;
  }
  HostDraw draw;
  const double u = uniform * kept;
  double left = u;
  size_t at = nucleus - 1;
  for (size_t i = 0; i < nucleus; ++i) {
    left -= probs[order[i]];
    if (left < 0.0) {
      at = i;
      break;
    }
  }
  draw.token = order[at];
  const double p = probs[order[at]];
  if (top_p < 1.0f) {
    const double target = top_p * sum;
    draw.ambiguous |= std::fabs(cum[nucleus - 1] - target) <= kMargin * sum;
    draw.ambiguous |= nucleus >= 2 && std::fabs(cum[nucleus - 2] - target) <= kMargin * sum;
    draw.ambiguous |= nucleus < order.size() &&
                      probs[order[nucleus]] >= probs[order[nucleus - 1]] * (1.0 - kMargin);
  }
  const double lower = at > 0 ? cum[at - 1] : 0.0;
  draw.ambiguous |= u - lower <= kMargin * kept || cum[at] - u <= kMargin * kept;
  draw.ambiguous |= at > 0 && probs[order[at - 1]] <= p * (1.0 + kMargin);
  draw.ambiguous |= at + 1 < nucleus && probs[order[at + 1]] >= p * (1.0 - kMargin);
  return draw;
}

// GPU tokens against cpu_sample with the same draws; ambiguous rows are counted, not compared
// (a nucleus of thousands of tokens makes most rows ambiguous, hence max_skipped).
void check_cpu_agreement(const std::string& name, const std::vector<float>& logits, int64_t rows,
                         int64_t vocab, int64_t ld, const std::vector<gpu::SampleParams>& params,
                         const std::vector<int32_t>& got, int64_t max_skipped) {
  int64_t skipped = 0, mismatched = 0, first = -1;
  for (int64_t r = 0; r < rows; ++r) {
    const HostDraw d =
        cpu_sample(logits.data() + r * ld, vocab, params[r].temperature, params[r].top_p,
                   gpu::sample_uniform(params[r].seed, params[r].step));
    if (d.ambiguous) {
      ++skipped;
      continue;
    }
    if (got[r] != d.token && mismatched++ == 0) first = r;
  }
  const bool ok = mismatched == 0 && skipped <= max_skipped;
  std::printf("%s %-58s %lld rows, %lld ambiguous skipped\n", ok ? "ok  " : "FAIL", name.c_str(),
              static_cast<long long>(rows), static_cast<long long>(skipped));
  if (mismatched > 0) {
    const HostDraw d = cpu_sample(logits.data() + first * ld, vocab, params[first].temperature,
                                  params[first].top_p,
                                  gpu::sample_uniform(params[first].seed, params[first].step));
    std::fprintf(stderr, "  %lld rows differ, first row %lld: GPU %d, CPU %d\n",
                 static_cast<long long>(mismatched), static_cast<long long>(first), got[first],
                 d.token);
  }
  expect(ok, name);
}

std::vector<int32_t> run_sampler(const std::vector<float>& logits, int64_t rows, int64_t vocab,
                                 int64_t ld, const std::vector<gpu::SampleParams>& params) {
  DeviceArray<float> dlogits(logits);
  DeviceArray<uint8_t> dparams(params.size() * sizeof(gpu::SampleParams));
  QUANTMLA_CUDA_CHECK(
      cudaMemcpy(dparams.data(), params.data(), dparams.bytes(), cudaMemcpyHostToDevice));
  DeviceArray<int32_t> out(static_cast<size_t>(rows));
  poison(out);
  gpu::sample_tokens(dlogits.data(), ld, rows, vocab,
                     reinterpret_cast<const gpu::SampleParams*>(dparams.data()), out.data(),
                     kStream);
  sync();
  return out.download();
}

void run_greedy_case() {
  const int64_t vocab = 163840, ld = vocab + 16, rows = 7;
  std::vector<float> logits = random_f32(static_cast<size_t>(rows * ld), 3.0f);
  const auto plant = [&](int64_t r, std::vector<int64_t> at) {
    for (const int64_t i : at) logits[r * ld + i] = 50.0f;
  };
  plant(0, {5, 100000});                                           // a tie: the lower index
  plant(1, {vocab - 1});                                           // the last token
  for (int64_t i = 0; i < vocab; ++i) logits[2 * ld + i] = 0.25f;  // all equal: token 0
  plant(3, {vocab - 2, vocab - 1});
  plant(4, {0});
  logits[5 * ld + 77] = INFINITY;  // +inf wins
  logits[5 * ld + 78] = INFINITY;
  for (int64_t i = vocab; i < ld; ++i) logits[6 * ld + i] = 1e9f;  // padding is not the row
  std::vector<gpu::SampleParams> params(static_cast<size_t>(rows));
  for (auto& p : params) p.temperature = 0.0f, p.top_p = 0.9f, p.seed = 1, p.step = 2;
  params[4].top_p = 0.0f;  // top_p <= 0 also means greedy
  params[4].temperature = 1.0f;
  const auto got = run_sampler(logits, rows, vocab, ld, params);
  std::vector<int32_t> ref(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    ref[r] = static_cast<int32_t>(
        std::max_element(logits.begin() + r * ld, logits.begin() + r * ld + vocab) -
        (logits.begin() + r * ld));
  }
  check_equal("sample_tokens greedy vocab 163840 (planted ties, +inf, equal rows)", got, ref);
}

void run_top_p_case() {
  const int64_t vocab = 163840, ld = vocab, rows = 16;
  std::vector<float> logits = random_f32(static_cast<size_t>(rows * ld), 2.5f);
  const float top_ps[] = {0.5f, 0.9f, 0.95f, 1.0f};
  const float temps[] = {0.7f, 1.0f};
  std::vector<gpu::SampleParams> params(static_cast<size_t>(rows));
  const uint64_t seed = rng();
  for (int64_t r = 0; r < rows; ++r) {
    params[r] = {temps[r % 2], top_ps[(r / 2) % 4], seed + static_cast<uint64_t>(r / 8),
                 static_cast<uint64_t>(r)};
  }
  // Rows 14 and 15 repeat row 6's logits and parameters: the same (seed, step), the same token.
  for (const int64_t copy : {14, 15}) {
    std::copy_n(logits.begin() + 6 * ld, vocab, logits.begin() + copy * ld);
    params[copy] = params[6];
  }
  const auto got = run_sampler(logits, rows, vocab, ld, params);
  const auto again = run_sampler(logits, rows, vocab, ld, params);
  check_equal("sample_tokens top-p: a second run draws the same tokens", again, got);
  bool all_in = true;
  std::string where;
  for (int64_t r = 0; r < rows; ++r) {
    const auto in =
        host_nucleus(logits.data() + r * ld, vocab, params[r].temperature, params[r].top_p, 1e-5);
    const int32_t t = got[r];
    if (t < 0 || t >= vocab || !in[t]) {
      all_in = false;
      where += " row " + std::to_string(r) + " token " + std::to_string(t);
    }
  }
  expect(all_in, "sample_tokens top-p: every token in the host nucleus" + where);
  check_cpu_agreement("sample_tokens top-p vocab 163840 = the CPU's sample_token", logits, rows,
                      vocab, ld, params, got, rows);
  expect(got[14] == got[6] && got[15] == got[6],
         "sample_tokens: the same (seed, step) and logits give the same token in any row");
  std::printf("%s sample_tokens top-p vocab 163840: %lld rows in their nucleus, repeatable\n",
              all_in ? "ok  " : "FAIL", static_cast<long long>(rows));
}

// 4000 draws from one 16-token distribution (steps 0..3999): the frequencies against the
// renormalized nucleus, with ties at the threshold all kept.
void run_chi_square_case(const std::string& name, const std::vector<float>& row, float temperature,
                         float top_p) {
  const int64_t vocab = static_cast<int64_t>(row.size()), draws = 4000;
  std::vector<float> logits;
  for (int64_t d = 0; d < draws; ++d) logits.insert(logits.end(), row.begin(), row.end());
  const uint64_t seed = rng();
  std::vector<gpu::SampleParams> params(static_cast<size_t>(draws));
  for (int64_t d = 0; d < draws; ++d)
    params[d] = {temperature, top_p, seed, static_cast<uint64_t>(d)};
  const auto got = run_sampler(logits, draws, vocab, vocab, params);
  std::vector<double> p;
  const auto in = host_nucleus(row.data(), vocab, temperature, top_p, 0.0, &p);
  double kept = 0.0;
  int cells = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (in[i]) kept += p[i], ++cells;
  }
  std::vector<int64_t> counts(static_cast<size_t>(vocab), 0);
  bool in_range = true;
  for (const int32_t t : got) {
    if (t < 0 || t >= vocab) {
      in_range = false;
      continue;
    }
    ++counts[t];
  }
  // Cells expected to get fewer than 5 draws are pooled into one, as the chi-square
  // approximation needs.
  double chi2 = 0.0, pooled_expected = 0.0;
  int64_t outside = 0, pooled_count = 0;
  int bins = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!in[i]) {
      outside += counts[i];
      continue;
    }
    const double expected = static_cast<double>(draws) * p[i] / kept;
    if (expected < 5.0) {
      pooled_expected += expected, pooled_count += counts[i];
      continue;
    }
    chi2 += (counts[i] - expected) * (counts[i] - expected) / expected;
    ++bins;
  }
  if (pooled_expected > 0.0) {
    chi2 += (pooled_count - pooled_expected) * (pooled_count - pooled_expected) / pooled_expected;
    ++bins;
  }
  // Wilson-Hilferty quantile of chi-square(df) at z = 4.265 (upper tail 1e-5).
  const double df = bins - 1;
  const double z = 4.265;
  const double limit =
      df <= 0 ? 0.0 : df * std::pow(1.0 - 2.0 / (9.0 * df) + z * std::sqrt(2.0 / (9.0 * df)), 3.0);
  const bool ok = in_range && outside == 0 && chi2 <= limit;
  std::printf("%s %-58s nucleus %d tokens, chi2 %.2f (limit %.2f, seed %llu)\n",
              ok ? "ok  " : "FAIL", name.c_str(), cells, chi2, limit,
              static_cast<unsigned long long>(seed));
  if (outside > 0)
    std::fprintf(stderr, "  %lld draws outside the nucleus\n", static_cast<long long>(outside));
  expect(ok, name);
}

// Many rows of a 1000-token vocabulary, mixed temperatures and top_p: the GPU picks the CPU's
// token for the same draw (a scan in index order instead of descending probability would not).
void run_cpu_agreement_case() {
  const int64_t vocab = 1000, ld = vocab + 5, rows = 2000;
  const std::vector<float> logits = random_f32(static_cast<size_t>(rows * ld), 2.0f);
  const float temps[] = {0.6f, 1.0f, 1.5f};
  const float top_ps[] = {0.5f, 0.8f, 0.95f, 1.0f};
  const uint64_t seed = rng();
  std::vector<gpu::SampleParams> params(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    params[r] = {temps[r % 3], top_ps[(r / 3) % 4], seed ^ static_cast<uint64_t>(r % 5),
                 static_cast<uint64_t>(r * 7 + 3)};
  }
  const auto got = run_sampler(logits, rows, vocab, ld, params);
  check_cpu_agreement("sample_tokens 2000 rows of 1000 = the CPU's sample_token", logits, rows,
                      vocab, ld, params, got, rows / 10);
}

void run_sampling_cases() {
  run_greedy_case();
  run_top_p_case();
  run_cpu_agreement_case();
  // Probabilities (T = 1) 1, e^-1 three times (tied at the threshold), then smaller ones; top_p
  // puts the target inside the tied group: all three are kept.
  std::vector<float> row = {2.0f,  1.0f,  1.0f,  1.0f,  0.2f,  -0.5f, -1.0f, -1.5f,
                            -2.0f, -2.5f, -3.0f, -3.5f, -4.0f, -4.5f, -5.0f, -6.0f};
  std::shuffle(row.begin(), row.end(), rng);
  double sum = 0.0;
  for (const float l : row) sum += std::exp(static_cast<double>(l) - 2.0);
  run_chi_square_case("sample_tokens 4000 draws, 16 tokens, tie at the threshold", row, 1.0f,
                      static_cast<float>(1.6 / sum));
  run_chi_square_case("sample_tokens 4000 draws, 16 tokens, top_p 1, T 0.5", row, 0.5f, 1.0f);
  expect_throws<ShapeError>("sample_tokens vocab 0", [&] {
    gpu::sample_tokens(nullptr, 0, 1, 0, nullptr, nullptr, kStream);
  });
}

// ---------------------------------------------------------------- prefill attention

// The expanded prefill attention against a double reference on the same BF16 inputs. Bound per
// output element, with u the BF16 unit roundoff and A = sum_j P_j |v_j| (the weights' mass on the
// values): the keys' and values' rounding to BF16 after the up-projection (u each: a score moves
// by at most u sum_i |q_i k_i|, which changes P_j by a factor within exp(+-2 scale ds)), P's
// rounding (u A), the output's rounding (u |o|), and FP32 accumulation in every product.
void run_prefill_attention_case(gpu::GemmRunner& gemm, int heads, int64_t tokens, int64_t context,
                                int64_t max_context, int head_dim) {
  const int nope = head_dim, rope = 64, v_dim = head_dim, rank = 512;
  const int qk = nope + rope, kv = nope + v_dim, row = rank + rope;
  const float scale = 0.2f;  // scores of about N(0, 192): softmax weights far from uniform
  std::vector<float> q, keys, kv_b;
  const std::vector<uint16_t> q_bits =
      random_bf16(static_cast<size_t>(tokens * heads * qk), 1.0f, &q);
  std::vector<uint16_t> key_bits = random_bf16(static_cast<size_t>(context * row), 1.0f, &keys);
  const std::vector<uint16_t> kv_b_bits =
      random_bf16(static_cast<size_t>(heads * kv * rank), 1.0f / std::sqrt(float(rank)), &kv_b);
  DeviceArray<uint16_t> dq(q_bits), dkeys(key_bits), dkv_b(kv_b_bits);
  DeviceArray<uint16_t> dout(static_cast<size_t>(tokens * heads * v_dim));
  const size_t bytes = gpu::PrefillAttentionWorkspace::bytes_for(heads, nope, v_dim, max_context);
  DeviceArray<uint8_t> workspace(bytes);
  poison(dout);
  workspace.fill_bytes(0xff);
  gpu::PrefillAttentionParams p;
  p.q = dq.data();
  p.keys = dkeys.data();
  p.keys_stride = row;
  p.kv_b = dkv_b.data();
  p.out = dout.data();
  p.out_stride = heads * v_dim;
  p.tokens = tokens;
  p.context = context;
  p.heads = heads;
  p.nope = nope, p.rope = rope, p.v = v_dim, p.rank = rank;
  p.softmax_scale = scale;
  gpu::prefill_attention(gemm, p, {workspace.data(), bytes, max_context}, kStream);
  sync();
  const std::vector<float> got = to_float(dout.download());

  // expanded[j, h, :] in double, and the magnitudes of its sums (for the FP32 accumulation).
  std::vector<double> expanded(static_cast<size_t>(context * heads * kv));
  std::vector<double> expanded_mass(expanded.size());
  for (int64_t j = 0; j < context; ++j) {
    for (int64_t o = 0; o < heads * kv; ++o) {
      double sum = 0.0, mass = 0.0;
      for (int r = 0; r < rank; ++r) {
        const double product = static_cast<double>(keys[j * row + r]) * kv_b[o * rank + r];
        sum += product;
        mass += std::fabs(product);
      }
      expanded[j * heads * kv + o] = sum;
      expanded_mass[j * heads * kv + o] = mass;
    }
  }
  const double u = kBf16Unit, acc = kAccumulateUnit;
  std::vector<double> ref(got.size()), bound(got.size());
  std::vector<double> s, ds, prob;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t visible = context - tokens + t + 1;
    for (int h = 0; h < heads; ++h) {
      const float* qh = q.data() + (t * heads + h) * qk;
      s.assign(static_cast<size_t>(visible), 0.0);
      ds.assign(static_cast<size_t>(visible), 0.0);
      double max_s = -INFINITY, max_ds = 0.0;
      for (int64_t j = 0; j < visible; ++j) {
        const double* k = expanded.data() + (j * heads + h) * kv;
        const double* k_mass = expanded_mass.data() + (j * heads + h) * kv;
        double dot = 0.0, rounding = 0.0, mass = 0.0;
        for (int i = 0; i < nope; ++i) {
          dot += qh[i] * k[i];
          // BF16 rounding of k, plus its FP32 accumulation over the rank.
          rounding += std::fabs(qh[i]) * (u * std::fabs(k[i]) + rank * acc * k_mass[i]);
          mass += std::fabs(qh[i] * k[i]);
        }
        for (int i = 0; i < rope; ++i) {
          const double product = static_cast<double>(qh[nope + i]) * keys[j * row + rank + i];
          dot += product;
          mass += std::fabs(product);
        }
        s[j] = dot;
        ds[j] = rounding + qk * acc * mass;
        max_s = std::max(max_s, dot);
        max_ds = std::max(max_ds, ds[j]);
      }
      prob.assign(static_cast<size_t>(visible), 0.0);
      double sum = 0.0;
      for (int64_t j = 0; j < visible; ++j) sum += prob[j] = std::exp(scale * (s[j] - max_s));
      // The scores' errors, then the kernel's own: the scaled scores rounded to FP32 (relative
      // 2^-24 of the largest, in the log2 domain) and exp2f's two ulps.
      double max_abs_s = 0.0;
      for (int64_t j = 0; j < visible; ++j) max_abs_s = std::max(max_abs_s, std::fabs(s[j]));
      const double drift = std::expm1(2.0 * scale * max_ds) +
                           2.0 * 0x1.0p-24 * scale * 1.4427 * max_abs_s + 4.0 * 0x1.0p-24;
      for (int c = 0; c < v_dim; ++c) {
        double o = 0.0, mass = 0.0, v_rounding = 0.0;
        for (int64_t j = 0; j < visible; ++j) {
          const double vj = expanded[(j * heads + h) * kv + nope + c];
          const double pj = prob[j] / sum;
          o += pj * vj;
          mass += pj * std::fabs(vj);
          v_rounding += pj * rank * acc * expanded_mass[(j * heads + h) * kv + nope + c];
        }
        const size_t at = static_cast<size_t>((t * heads + h) * v_dim + c);
        ref[at] = o;
        const double inner = mass * (2 * u + drift + visible * acc) + v_rounding;
        bound[at] = inner + u * (std::fabs(o) + inner);
      }
    }
  }
  check_close("prefill_attention H " + std::to_string(heads) +
                  " nope = v = " + std::to_string(head_dim) + ", " + std::to_string(tokens) +
                  " queries after " + std::to_string(context - tokens) + " cached",
              got, ref, bound);
}

void run_prefill_attention_errors(gpu::GemmRunner& gemm) {
  gpu::PrefillAttentionParams p;
  p.heads = 16, p.nope = 128, p.rope = 64, p.v = 128, p.rank = 512;
  p.keys_stride = 576, p.out_stride = 16 * 128;
  p.tokens = 10, p.context = 5000;
  expect_throws<ShapeError>("prefill_attention with a context beyond the workspace", [&] {
    gpu::prefill_attention(gemm, p, {nullptr, 1 << 20, 4096}, kStream);
  });
  p.context = 5;
  expect_throws<ShapeError>("prefill_attention with fewer keys than queries", [&] {
    gpu::prefill_attention(gemm, p, {nullptr, 1 << 20, 4096}, kStream);
  });
  p.context = 100;
  p.nope = 96, p.v = 96;
  expect_throws<ShapeError>("prefill_attention with head dimensions not compiled", [&] {
    gpu::prefill_attention(gemm, p, {nullptr, 1 << 20, 4096}, kStream);
  });
  p.nope = 128, p.v = 128, p.keys_stride = 580;
  expect_throws<ShapeError>("prefill_attention with keys rows not in 16-byte pieces", [&] {
    gpu::prefill_attention(gemm, p, {nullptr, 1 << 20, 4096}, kStream);
  });
}

// Query tiles of 128 and key tiles of 128: partial last tiles, prefixes that are and are not tile
// multiples, contexts that are not multiples of the values' 8-key chunks, a single query,
// mla-tiny's heads and head dimensions; then the refusals.
void run_prefill_attention_cases(gpu::GemmRunner& gemm) {
  run_prefill_attention_case(gemm, 16, 520, 700, 1024, 128);
  run_prefill_attention_case(gemm, 4, 300, 428, 512, 128);
  run_prefill_attention_case(gemm, 16, 256, 320, 320, 128);
  run_prefill_attention_case(gemm, 8, 130, 130, 16384, 128);
  run_prefill_attention_case(gemm, 2, 1, 77, 100, 128);
  run_prefill_attention_case(gemm, 8, 200, 263, 300, 64);
  run_prefill_attention_case(gemm, 8, 64, 64, 64, 64);
  run_prefill_attention_errors(gemm);
}

// expert_gemm's cases: its errors, both forms, both rings, both layouts, the diagnostic records.
void run_expert_gemm_cases() {
  run_expert_gemm_errors();
  const std::vector<int32_t> tiles = {0, 1, 130, 257, 64, 0, 200, 70, 513};
  const std::vector<int32_t> padded = {0, 1, 130, 257, 64, 0, 200, 70};
  const std::vector<int32_t> v2_lite = {190, 210, 175, 240, 0, 3, 128, 129};
  for (const ExpertForm form : {ExpertForm::kPlainF32, ExpertForm::kGated}) {
    const int64_t v2_n = form == ExpertForm::kGated ? 192 : 384;
    for (int stages = 3; stages <= 4; ++stages) {
      run_expert_gemm_case({.counts = tiles,
                            .n = 256,
                            .k = 128,
                            .form = form,
                            .stages = stages,
                            .ld_out = stages == 4 ? 264 : 256});
      // The padded layout (the runner's batched experts): blocks of 272 rows.
      run_expert_gemm_case({.counts = padded,
                            .n = 128,
                            .k = 128,
                            .form = form,
                            .stages = stages,
                            .ld_out = 128,
                            .rows_per_expert = 272});
    }
    run_expert_gemm_case({.counts = v2_lite, .n = v2_n, .k = 1408, .form = form, .ld_out = v2_n});
    run_expert_gemm_case({.counts = v2_lite,
                          .n = v2_n,
                          .k = 1408,
                          .form = form,
                          .ld_out = v2_n,
                          .rows_per_expert = 240});
    // With the diagnostic records (ExpertGemmParams::phases, bench_prefill_gemms' "phases"
    // rows): the same products.
    run_expert_gemm_case(
        {.counts = tiles, .n = 256, .k = 128, .form = form, .ld_out = 264, .timed = true});
  }
  // The plain form's BF16 outputs (the runner's down product): both layouts, V2-Lite's shape.
  const ExpertForm bf16 = ExpertForm::kPlainBf16;
  run_expert_gemm_case({.counts = tiles, .n = 256, .k = 128, .form = bf16, .ld_out = 264});
  run_expert_gemm_case({.counts = padded,
                        .n = 128,
                        .k = 128,
                        .form = bf16,
                        .stages = 3,
                        .ld_out = 128,
                        .rows_per_expert = 272});
  run_expert_gemm_case({.counts = v2_lite, .n = 384, .k = 1408, .form = bf16, .ld_out = 384});
}

}  // namespace

int main(int argc, char** argv) {
  // --prefill-attention: those cases alone (compute-sanitizer runs them in seconds);
  // --expert-gemm: expert_gemm's alone (a kernel change's check in seconds).
  bool prefill_attention_only = false, expert_gemm_only = false;
  return gpu_checks::run(
      argc, argv,
      [&] {
        gpu::GemmRunner gemm;
        if (prefill_attention_only) {
          run_prefill_attention_cases(gemm);
          return;
        }
        if (expert_gemm_only) return run_expert_gemm_cases();
        const LinearCase linear_cases[] = {
            {1, 576, 2048, 0, 0, 0, DType::kF32, 0.0f},
            {7, 576, 2048, 8, 0, 4, DType::kF32, 0.0f},
            {300, 576, 2048, 0, 0, 0, DType::kF32, 0.0f},
            {300, 576, 2048, 0, 8, 8, DType::kBF16, 0.0f},
            {1, 7168, 512, 0, 0, 0, DType::kF32, 1.0f},
            {300, 1000, 512, 0, 0, 0, DType::kF32, 1.0f},
            {33, 1536, 7168, 0, 0, 0, DType::kBF16, 0.0f},
            {7, 2048, 1536, 0, 0, 0, DType::kF32, 1.0f},
            {5, 129, 100, 1, 3, 1, DType::kF32, 0.0f},
            {64, 72, 40, 1, 1, 1, DType::kBF16, 0.0f},
        };
        for (const LinearCase& c : linear_cases) run_linear_case(gemm, c);
        run_batched_cases(gemm, 5, 16);
        run_batched_cases(gemm, 64, 20);
        run_gemm_errors(gemm);
        run_tuned_gemm_case(2048, 1500, 2048, 2048);
        run_tuned_gemm_case(1000, 600, 3648, 2048);
        run_tuned_batched_case(224, 176, 2816, 2048);
        run_batch_invariant_gemm_cases();
        run_skinny_cases();

        run_embed_case();
        run_rms_norm_case(9, 7168, 4, 0, DType::kF32, false);
        run_rms_norm_case(33, 512, 64, 3, DType::kBF16, false);
        run_rms_norm_case(5, 1536, 0, 0, DType::kF32, true);
        // Fewer elements than threads, a 2K prefill's rows, a width past 8192.
        run_rms_norm_case(4, 100, 0, 0, DType::kBF16, false);
        run_rms_norm_case(2048, 2048, 0, 0, DType::kBF16, false);
        run_rms_norm_case(3, 2048, 8, 0, DType::kF32, true);
        run_rms_norm_case(3, 9000, 0, 4, DType::kF32, false);
        run_rope_case("rope q_pe [50, 20 heads, 192] at 128, positions to 200000", 50, 20, 64, 128,
                      20 * 192, 192, 50 * 20 * 192, false);
        run_rope_case("rope k_pe [70, 576] at 512, YaRN-like, factor 1.2", 70, 1, 64, 512, 576, 64,
                      70 * 576, true);
        run_silu_mul_case(37, 1408, 3, 5);
        run_silu_mul_case(37, 1408, 0, 4);
        run_silu_mul_case(37, 1408, 0, 4, true);
        run_silu_mul_case(5, 2052, 0, 0);   // 513 vectors: two blocks along x, an odd last pair
        run_silu_mul_case(5, 10944, 0, 0);  // the dense MLP's width
        run_silu_mul_case(6, 7, 3, 5, true);
        run_rope_queries_case(6, 20, 128, true);
        run_rope_queries_case(3, 128, 128, true);
        run_rope_queries_case(5, 8, 64, false);
        run_rope_queries_case(7, 3, 30, true);  // nope 30: rows not in 16-byte pieces (scalar path)
        run_gather_rows_case(DType::kF32);
        run_gather_rows_case(DType::kBF16);
        run_model_op_errors();

        run_route_cases();
        run_sort_case("moe_sort n 300 k 8 E 64", random_choices(300, 8, 64, false), 300, 8, 64);
        run_sort_case("moe_sort skewed n 1000 k 6 E 256", random_choices(1000, 6, 256, true), 1000,
                      6, 256);
        {
          std::vector<int32_t> experts = random_choices(50, 2, 16, false);
          experts[3] = -1, experts[40] = 16;  // not from moe_route: no slot
          run_sort_case("moe_sort with invalid entries", experts, 50, 2, 16);
        }
        run_sort_case("moe_sort n 1 k 1 E 4", {2}, 1, 1, 4);
        // The scan's split of each expert's chunks into runs: a 2K prefill (48 chunks, 16 runs of
        // 3), more chunks than runs, runs past the last chunk (E 100: 10 runs of 3 over 24
        // chunks), and more experts than the block's threads (one run each).
        run_sort_case("moe_sort n 2048 k 6 E 64", random_choices(2048, 6, 64, false), 2048, 6, 64);
        run_sort_case("moe_sort skewed n 8192 k 6 E 64", random_choices(8192, 6, 64, true), 8192, 6,
                      64);
        run_sort_case("moe_sort n 1000 k 6 E 100", random_choices(1000, 6, 100, false), 1000, 6,
                      100);
        run_sort_case("moe_sort n 2048 k 1 E 4096", random_choices(2048, 1, 4096, true), 2048, 1,
                      4096);
        // One chunk of entries (decode steps): the single-block kernel.
        run_sort_case("moe_sort one chunk n 42 k 6 E 64", random_choices(42, 6, 64, false), 42, 6,
                      64);
        run_sort_case("moe_sort one chunk n 256 k 1 E 4096", random_choices(256, 1, 4096, true),
                      256, 1, 4096);
        run_gather_combine_case(300, 8, 64, 512);
        run_gather_combine_case(7, 3, 5, 64);  // 21 slots: a block's last rows past them
        run_pad_layout_case("moe_pad_layout n 2048 k 6 E 64", random_choices(2048, 6, 64, false),
                            2048, 6, 64);
        run_pad_layout_case("moe_pad_layout skewed n 500 k 8 E 256",
                            random_choices(500, 8, 256, true), 500, 8, 256);
        {
          std::vector<int32_t> experts = random_choices(50, 2, 16, false);
          experts[3] = -1, experts[40] = 16;  // not from moe_route: no slot
          run_pad_layout_case("moe_pad_layout with invalid entries", experts, 50, 2, 16);
        }
        run_pad_layout_errors();
        run_expert_mlp_case(gemm);

        run_sampling_cases();

        run_prefill_attention_cases(gemm);

        run_expert_gemm_cases();
      },
      {{"--prefill-attention", &prefill_attention_only}, {"--expert-gemm", &expert_gemm_only}});
}
