// Dense FP32 building blocks of the forward pass (BLAS-backed where it pays).
#pragma once

#include <cstdint>

namespace quantmla::cpu {

// c[m, n] = a[m, k] * b[n, k]^T  (+ c when accumulate). Row-major with leading dimensions.
void matmul_nt(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
               int64_t m, int64_t n, int64_t k, bool accumulate = false);
// c[m, n] = a[m, k] * b[k, n]  (+ c when accumulate).
void matmul_nn(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
               int64_t m, int64_t n, int64_t k, bool accumulate = false);

// c[m, n] = a[k, m]^T * b[k, n]  (+ c when accumulate).
void matmul_tn(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
               int64_t m, int64_t n, int64_t k, bool accumulate = false);

// y = weight * x / sqrt(mean(x^2) + eps), per row of `width` values; y may alias x.
void rms_norm(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t width,
              float eps, float* y, int64_t y_stride);

// Scaled, causally masked softmax of one score row in place: entries [0, visible) become
// softmax(scale * row), entries [visible, total) zero. Returns the log-sum-exp of the scaled row.
float softmax_row(float* row, int64_t visible, int64_t total, float scale);

// gate = silu(gate) * up, elementwise.
void silu_mul(float* gate, const float* up, int64_t count);

}  // namespace quantmla::cpu
