#include "kernels/cpu/gemv_bf16.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "quantmla/dtype.h"

namespace quantmla::cpu {
namespace {

// --- scalar ---------------------------------------------------------------------------------

void gemv_rows_scalar(const uint16_t* w, int64_t ldw, const float* x, float* y, int64_t row_begin,
                      int64_t row_end, int64_t k, bool accumulate) {
  for (int64_t row = row_begin; row < row_end; ++row) {
    const uint16_t* w_row = w + row * ldw;
    float sum = 0.0f;
    for (int64_t i = 0; i < k; ++i) sum += bf16_to_f32(w_row[i]) * x[i];
    y[row] = accumulate ? y[row] + sum : sum;
  }
}

void gemv_t_cols_scalar(const uint16_t* w, int64_t ldw, const float* x, float* y, int64_t k,
                        int64_t col_begin, int64_t col_end) {
  for (int64_t i = 0; i < k; ++i) {
    const uint16_t* w_row = w + i * ldw;
    for (int64_t col = col_begin; col < col_end; ++col) y[col] += x[i] * bf16_to_f32(w_row[col]);
  }
}

// --- AVX2 + FMA -------------------------------------------------------------------------------

__attribute__((target("avx2,fma"))) inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

__attribute__((target("avx2,fma"))) inline float horizontal_sum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
}

// Four rows at a time so the loads of x are shared and four FMA chains run in parallel.
__attribute__((target("avx2,fma"))) void gemv_rows_avx2(const uint16_t* w, int64_t ldw,
                                                        const float* x, float* y, int64_t row_begin,
                                                        int64_t row_end, int64_t k,
                                                        bool accumulate) {
  // One row at a time (one sequential stream per thread, which the hardware prefetcher follows
  // best), 32 values per step into four independent accumulators.
  const int64_t k_vec = k & ~int64_t{31};
  int64_t row = row_begin;
  for (; row < row_end; ++row) {
    const uint16_t* r = w + row * ldw;
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < k_vec; i += 32) {
      s0 = _mm256_fmadd_ps(load_bf16x8(r + i), _mm256_loadu_ps(x + i), s0);
      s1 = _mm256_fmadd_ps(load_bf16x8(r + i + 8), _mm256_loadu_ps(x + i + 8), s1);
      s2 = _mm256_fmadd_ps(load_bf16x8(r + i + 16), _mm256_loadu_ps(x + i + 16), s2);
      s3 = _mm256_fmadd_ps(load_bf16x8(r + i + 24), _mm256_loadu_ps(x + i + 24), s3);
    }
    float sum = horizontal_sum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (int64_t i = k_vec; i < k; ++i) sum += bf16_to_f32(r[i]) * x[i];
    y[row] = accumulate ? y[row] + sum : sum;
  }
}

// 32 columns (one cache line of BF16 per row) at a time: four independent accumulators hide the
// FMA latency that a single running sum over the rows would expose.
__attribute__((target("avx2,fma"))) void gemv_t_cols_avx2(const uint16_t* w, int64_t ldw,
                                                          const float* x, float* y, int64_t k,
                                                          int64_t col_begin, int64_t col_end) {
  int64_t col = col_begin;
  for (; col + 32 <= col_end; col += 32) {
    __m256 acc[4];
    for (int v = 0; v < 4; ++v) acc[v] = _mm256_loadu_ps(y + col + 8 * v);
    for (int64_t i = 0; i < k; ++i) {
      const __m256 xi = _mm256_set1_ps(x[i]);
      const uint16_t* w_row = w + i * ldw + col;
      for (int v = 0; v < 4; ++v) acc[v] = _mm256_fmadd_ps(xi, load_bf16x8(w_row + 8 * v), acc[v]);
    }
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + col + 8 * v, acc[v]);
  }
  gemv_t_cols_scalar(w, ldw, x, y, k, col, col_end);
}

bool detect_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// Runs body(begin, end) over contiguous ranges of outputs, one per thread, in multiples of
// `align`: equal shares of the weight stream, and no thread waits at the end for another's extra
// chunk. Small products stay on one thread, where a fork would cost more than it saves.
template <typename Body>
void for_each_output_range(int64_t outputs, int64_t weights_per_output, int64_t align,
                           const Body& body) {
  constexpr int64_t kMinWeightsPerThread = 32 * 1024;
  const int64_t threads = std::max(1, omp_get_max_threads());
  const int64_t useful = std::max<int64_t>(1, outputs * weights_per_output / kMinWeightsPerThread);
  const int64_t parts = std::min(threads, useful);
  const int64_t size = ((outputs + parts - 1) / parts + align - 1) / align * align;
  const int64_t ranges = (outputs + size - 1) / size;
#pragma omp parallel for schedule(static, 1) if (ranges > 1)
  for (int64_t range = 0; range < ranges; ++range) {
    body(range * size, std::min(outputs, (range + 1) * size));
  }
}

}  // namespace

bool gemv_bf16_uses_avx2() {
  static const bool avx2 = detect_avx2();
  return avx2;
}

void gemv_bf16(const uint16_t* w, int64_t ldw, const float* x, float* y, int64_t n, int64_t k,
               bool accumulate) {
  const bool avx2 = gemv_bf16_uses_avx2();
  for_each_output_range(n, k, 4, [&](int64_t begin, int64_t end) {
    if (avx2) {
      gemv_rows_avx2(w, ldw, x, y, begin, end, k, accumulate);
    } else {
      gemv_rows_scalar(w, ldw, x, y, begin, end, k, accumulate);
    }
  });
}

void gemv_t_bf16(const uint16_t* w, int64_t ldw, const float* x, float* y, int64_t k, int64_t n,
                 bool accumulate) {
  if (!accumulate) std::fill(y, y + n, 0.0f);
  const bool avx2 = gemv_bf16_uses_avx2();
  for_each_output_range(n, k, 32, [&](int64_t begin, int64_t end) {
    if (avx2) {
      gemv_t_cols_avx2(w, ldw, x, y, k, begin, end);
    } else {
      gemv_t_cols_scalar(w, ldw, x, y, k, begin, end);
    }
  });
}

void gemv_bf16_reference(const uint16_t* w, int64_t ldw, const float* x, float* y, int64_t n,
                         int64_t k, bool accumulate) {
  for (int64_t row = 0; row < n; ++row) {
    double sum = 0.0;
    for (int64_t i = 0; i < k; ++i)
      sum += static_cast<double>(bf16_to_f32(w[row * ldw + i])) * x[i];
    y[row] = static_cast<float>(accumulate ? y[row] + sum : sum);
  }
}

void gemv_t_bf16_reference(const uint16_t* w, int64_t ldw, const float* x, float* y, int64_t k,
                           int64_t n, bool accumulate) {
  for (int64_t col = 0; col < n; ++col) {
    double sum = accumulate ? y[col] : 0.0;
    for (int64_t i = 0; i < k; ++i)
      sum += static_cast<double>(x[i]) * bf16_to_f32(w[i * ldw + col]);
    y[col] = static_cast<float>(sum);
  }
}

}  // namespace quantmla::cpu
