// BF16 as its uint16_t bits in device code, with the host's rounding (quantmla::f32_to_bf16).
#pragma once

#include <cstdint>

namespace quantmla::gpu {

// Round to nearest even; a NaN stays NaN by setting a quiet bit (CUDA's __float2bfloat16_rn
// would return its canonical NaN instead).
__device__ __forceinline__ uint16_t to_bf16_bits(float value) {
  uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// bf16(silu(g) * u) with cpu::silu_mul's FP32 arithmetic (g / (1 + expf(-g)) * u, no fused
// multiply-adds): the MLP's activation, shared by silu_mul and expert_gemm's gated epilogue.
__device__ __forceinline__ uint16_t silu_mul_bf16_bits(float g, float u) {
  const float silu = __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
  return to_bf16_bits(__fmul_rn(silu, u));
}

__device__ __forceinline__ float from_bf16_bits(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

}  // namespace quantmla::gpu
