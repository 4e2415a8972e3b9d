// The mixture-of-experts combine of one output element, shared by moe_combine's kernel and the
// skinny product's combining tail (SkinnyGemmParams::combine), so that the two agree bit for bit.
#pragma once

#include <cstdint>

namespace quantmla::gpu {

// sum = sum over j in [0, k), in j order, of weights[j] * out[slot_of[j] * ld_out] (a fused
// multiply-add each, from 0; slots < 0 skipped), then + out[(i * tokens + t) * ld_out] for each
// shared group i in order (SkinnyGemmParams::static_groups: the shared experts' rows ahead of
// the routed ones). out points at the element's column of row 0; slot_of and weights at token t's
// k entries. The loads bypass L1: other CTAs of the same kernel may have written the rows.
__device__ __forceinline__ float mixture_sum(const float* out, int64_t ld_out,
                                             const int32_t* slot_of, const float* weights, int k,
                                             int shared_groups, int64_t tokens, int64_t t) {
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int32_t slot = slot_of[j];
    if (slot < 0) continue;
    sum = __fmaf_rn(weights[j], __ldcg(out + slot * ld_out), sum);
  }
  for (int i = 0; i < shared_groups; ++i) {
    sum = __fadd_rn(sum, __ldcg(out + (i * tokens + t) * ld_out));
  }
  return sum;
}

}  // namespace quantmla::gpu
