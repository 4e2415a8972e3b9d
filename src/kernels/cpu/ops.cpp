#include "kernels/cpu/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace quantmla::cpu {

void matmul_nt(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
               int64_t m, int64_t n, int64_t k, bool accumulate) {
  if (m == 0 || n == 0) return;
  if (m == 1) {  // one row (decode): a matrix-vector product, which sgemm does not special-case
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(n), static_cast<blasint>(k), 1.0f,
                b, static_cast<blasint>(ldb), a, 1, accumulate ? 1.0f : 0.0f, c, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a, static_cast<blasint>(lda),
              b, static_cast<blasint>(ldb), accumulate ? 1.0f : 0.0f, c, static_cast<blasint>(ldc));
}

void matmul_nn(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
               int64_t m, int64_t n, int64_t k, bool accumulate) {
  if (m == 0 || n == 0) return;
  if (m == 1) {
    cblas_sgemv(CblasRowMajor, CblasTrans, static_cast<blasint>(k), static_cast<blasint>(n), 1.0f,
                b, static_cast<blasint>(ldb), a, 1, accumulate ? 1.0f : 0.0f, c, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a, static_cast<blasint>(lda),
              b, static_cast<blasint>(ldb), accumulate ? 1.0f : 0.0f, c, static_cast<blasint>(ldc));
}

void matmul_tn(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
               int64_t m, int64_t n, int64_t k, bool accumulate) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a, static_cast<blasint>(lda),
              b, static_cast<blasint>(ldb), accumulate ? 1.0f : 0.0f, c, static_cast<blasint>(ldc));
}

void rms_norm(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t width,
              float eps, float* y, int64_t y_stride) {
  for (int64_t row = 0; row < rows; ++row) {
    const float* in = x + row * x_stride;
    float* out = y + row * y_stride;
    double sum_squares = 0.0;
    for (int64_t i = 0; i < width; ++i) sum_squares += static_cast<double>(in[i]) * in[i];
    const float inv_rms =
        static_cast<float>(1.0 / std::sqrt(sum_squares / static_cast<double>(width) + eps));
    for (int64_t i = 0; i < width; ++i) out[i] = weight[i] * (in[i] * inv_rms);
  }
}

void silu_mul(float* gate, const float* up, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

float softmax_row(float* row, int64_t visible, int64_t total, float scale) {
  float max_logit = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < visible; ++j) {
    row[j] *= scale;
    max_logit = std::max(max_logit, row[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < visible; ++j) {
    row[j] = std::exp(row[j] - max_logit);
    sum += row[j];
  }
  const float inv_sum = 1.0f / sum;
  for (int64_t j = 0; j < visible; ++j) row[j] *= inv_sum;
  std::fill(row + visible, row + total, 0.0f);
  return max_logit + std::log(sum);
}

}  // namespace quantmla::cpu
