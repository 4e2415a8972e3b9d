// Rotary embedding in device code, shared by the RoPE kernels of model_ops.cu and the cache
// write that also prepares the queries (write.cu): Rope::apply's arithmetic (src/model/rope.cpp).
#pragma once

#include <cstdint>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/model_ops.h"

namespace quantmla::gpu {

inline constexpr int kQueryDim = 576;      // the decode kernel's query: latent, then RoPE
inline constexpr int kQueryContent = 512;  // its latent columns

// One pair (e, o) rotated by angle = position * inv_freq, as Rope::apply rounds.
__device__ __forceinline__ float2 rotate_pair(float even, float odd, int32_t position,
                                              float inv_freq, float attention_factor) {
  const float angle = __fmul_rn(static_cast<float>(position), inv_freq);
  float sin_value = 0.0f;
  float cos_value = 0.0f;
  sincosf(angle, &sin_value, &cos_value);  // the accurate one: angles reach 1e5 and more
  cos_value = __fmul_rn(cos_value, attention_factor);
  sin_value = __fmul_rn(sin_value, attention_factor);
  return make_float2(__fsub_rn(__fmul_rn(even, cos_value), __fmul_rn(odd, sin_value)),
                     __fadd_rn(__fmul_rn(odd, cos_value), __fmul_rn(even, sin_value)));
}

// rope_queries' work for token t and head h (model_ops.h), by `threads` threads of which this is
// `thread`; heads past p.heads (decode_q's padding) only write zeros.
__device__ __forceinline__ void rope_query_head(const RopeQueriesParams& p, int64_t t, int h,
                                                int thread, int threads) {
  if (h >= p.heads) {
    uint16_t* dec = p.decode_q + (t * p.heads_padded + h) * kQueryDim;
    for (int c = thread; c < kQueryDim; c += threads) dec[c] = 0;
    return;
  }
  const int qk = p.nope + p.rope;
  const float* in = p.q + t * p.q_token_stride + static_cast<int64_t>(h) * qk;
  uint16_t* out = p.q_bf16 + (t * p.heads + h) * qk;
  for (int c = thread; c < p.nope; c += threads) out[c] = to_bf16_bits(in[c]);
  uint16_t* dec = p.decode_q == nullptr
                      ? nullptr
                      : p.decode_q + (t * p.heads_padded + h) * kQueryDim + kQueryContent;
  const int32_t position = p.positions[t];
  for (int i = thread; i < p.rope / 2; i += threads) {
    const float* pair = in + p.nope + 2 * i;
    const float2 r = rotate_pair(pair[0], pair[1], position, p.inv_freq[i], p.attention_factor);
    const uint16_t even = to_bf16_bits(r.x), odd = to_bf16_bits(r.y);
    out[p.nope + 2 * i] = even;
    out[p.nope + 2 * i + 1] = odd;
    if (dec != nullptr) {
      dec[2 * i] = even;
      dec[2 * i + 1] = odd;
    }
  }
}

}  // namespace quantmla::gpu
