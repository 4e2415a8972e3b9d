// The RMSNorm of one FP32 row, shared by the rms_norm kernel and the skinny product's normalizing
// prologue, so that the two agree bit for bit: the squares summed in double in one fixed order
// (256 partial sums, partial j over elements j, j + 256, ... in turn; each 32 partials reduced by
// a warp's xor tree; the 8 totals added in order), whatever the block size that computes it.
#pragma once

#include <cstdint>

namespace quantmla::gpu {

inline constexpr int kNormPartials = 256;
inline constexpr int kNormTotals = kNormPartials / 32;

// Total v (0..7) of the row's squares: the calling warp's lanes hold partials 32 v + lane. Every
// lane gets the total.
__device__ __forceinline__ double row_squares_total(const float* row, int64_t width, int v) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  double sum = 0.0;
#pragma unroll 8
  for (int64_t i = 32 * v + lane; i < width; i += kNormPartials) {
    const double x = row[i];
    sum += x * x;  // exact: a product of two floats fits a double
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

// inv_rms = float(1 / sqrt(mean + eps)) from the row's kNormTotals totals, added in order.
__device__ __forceinline__ float inv_rms_from_totals(const double* totals, int64_t width,
                                                     float eps) {
  double sum = 0.0;
  for (int v = 0; v < kNormTotals; ++v) sum += totals[v];
  return static_cast<float>(1.0 / sqrt(sum / static_cast<double>(width) + eps));
}

// The normalized value rms_norm writes before rounding: weight * (x * inv_rms), both products in
// FP32 without contraction.
__device__ __forceinline__ float normalized(float x, float weight, float inv_rms) {
  return __fmul_rn(weight, __fmul_rn(x, inv_rms));
}

}  // namespace quantmla::gpu
