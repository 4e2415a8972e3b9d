// CPU attention kernels behind attention_f32() (internal).
#pragma once

#include "quantmla/attention.h"

namespace quantmla::cpu {

// AVX2 kernel for a few queries; requires attention_decode_f32_supported().
bool attention_decode_f32_supported(const AttentionParams& params);
void attention_decode_f32(const AttentionParams& params);

// GEMM-blocked kernels for many queries (prefill): over all visible FP32 keys at once, or span by
// span with an online softmax when the keys come from params.decode_keys (each span decoded once).
void attention_prefill_f32(const AttentionParams& params);
void attention_prefill_tiled(const AttentionParams& params);

}  // namespace quantmla::cpu
