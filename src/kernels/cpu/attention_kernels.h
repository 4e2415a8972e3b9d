// CPU attention kernels behind attention_f32() (internal).
#pragma once

#include "quantmla/attention.h"

namespace quantmla::cpu {

// AVX2 kernel for a few queries; requires attention_decode_f32_supported().
bool attention_decode_f32_supported(const AttentionParams& params);
void attention_decode_f32(const AttentionParams& params);

// GEMM-blocked kernel for many queries (prefill).
void attention_prefill_f32(const AttentionParams& params);

}  // namespace quantmla::cpu
