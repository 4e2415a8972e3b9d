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

// Whether rope_queries' rows allow its vector accesses: each head's q values in 16-byte pieces
// (nope and rope multiples of 4, q 16-byte aligned with a token stride a multiple of 4), q_bf16 in
// 8-byte pieces, decode_q rows in 16-byte pieces. The runner's buffers always do.
inline bool rope_queries_vectorizable(const RopeQueriesParams& p) {
  const auto aligned = [](const void* ptr, uintptr_t bytes) {
    return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
  };
  return p.nope % 4 == 0 && p.rope % 4 == 0 && p.q_token_stride % 4 == 0 && aligned(p.q, 16) &&
         aligned(p.q_bf16, 8) && (p.decode_q == nullptr || aligned(p.decode_q, 16));
}

// Two BF16 bits in one word, the first in the low half (memory order).
__device__ __forceinline__ uint32_t bf16_pair(float first, float second) {
  return to_bf16_bits(first) | (uint32_t{to_bf16_bits(second)} << 16);
}

// rope_queries' work for token t and head h (model_ops.h), by `threads` threads of which this is
// `thread`; heads past p.heads (decode_q's padding) only write zeros. vectors
// (rope_queries_vectorizable): four nope values and one RoPE pair a load, the same arithmetic.
__device__ __forceinline__ void rope_query_head(const RopeQueriesParams& p, int64_t t, int h,
                                                int thread, int threads, bool vectors) {
  if (h >= p.heads) {
    uint16_t* dec = p.decode_q + (t * p.heads_padded + h) * kQueryDim;
    if (vectors) {
      for (int c = thread; c < kQueryDim / 8; c += threads)
        reinterpret_cast<uint4*>(dec)[c] = make_uint4(0, 0, 0, 0);
    } else {
      for (int c = thread; c < kQueryDim; c += threads) dec[c] = 0;
    }
    return;
  }
  const int qk = p.nope + p.rope;
  const float* in = p.q + t * p.q_token_stride + static_cast<int64_t>(h) * qk;
  uint16_t* out = p.q_bf16 + (t * p.heads + h) * qk;
  if (vectors) {
    for (int c = thread; c < p.nope / 4; c += threads) {
      const float4 v = reinterpret_cast<const float4*>(in)[c];
      reinterpret_cast<uint2*>(out)[c] = make_uint2(bf16_pair(v.x, v.y), bf16_pair(v.z, v.w));
    }
  } else {
    for (int c = thread; c < p.nope; c += threads) out[c] = to_bf16_bits(in[c]);
  }
  uint16_t* dec = p.decode_q == nullptr
                      ? nullptr
                      : p.decode_q + (t * p.heads_padded + h) * kQueryDim + kQueryContent;
  const int32_t position = p.positions[t];
  for (int i = thread; i < p.rope / 2; i += threads) {
    const float* pair = in + p.nope + 2 * i;
    const float2 v =
        vectors ? *reinterpret_cast<const float2*>(pair) : make_float2(pair[0], pair[1]);
    const float2 r = rotate_pair(v.x, v.y, position, p.inv_freq[i], p.attention_factor);
    const uint32_t bits = bf16_pair(r.x, r.y);
    if (vectors) {
      *reinterpret_cast<uint32_t*>(out + p.nope + 2 * i) = bits;
      if (dec != nullptr) *reinterpret_cast<uint32_t*>(dec + 2 * i) = bits;
    } else {
      out[p.nope + 2 * i] = static_cast<uint16_t>(bits);
      out[p.nope + 2 * i + 1] = static_cast<uint16_t>(bits >> 16);
      if (dec != nullptr) {
        dec[2 * i] = static_cast<uint16_t>(bits);
        dec[2 * i + 1] = static_cast<uint16_t>(bits >> 16);
      }
    }
  }
}

}  // namespace quantmla::gpu
