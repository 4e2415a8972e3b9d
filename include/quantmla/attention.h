// Absorbed MLA attention over cache rows: every head attends over one shared key [c ; k_pe]
// (kv_lora_rank + rope_dim wide) and one shared value c (kv_lora_rank wide), as in DESIGN §2.
#pragma once

#include <cstdint>

namespace quantmla {

// Plain kernel boundary. Strides are in elements.
struct AttentionParams {
  // q: [n_q, num_heads, kv_lora_rank + rope_dim]: absorbed query W_UK_h^T q_nope_h, then q_pe_h.
  const float* q = nullptr;
  int64_t q_row_stride = 0;   // between consecutive queries
  int64_t q_head_stride = 0;  // between heads of one query
  // kv: [num_keys, kv_lora_rank + rope_dim]: content latent c, then RoPE key k_pe.
  const float* kv = nullptr;
  int64_t kv_row_stride = 0;
  // Keys held in a compressed format instead: when decode_keys is set, kv is not read and the
  // kernels obtain FP32 rows one tile at a time, inside their key loop:
  // decode_keys(decode_context, first, count, rows) writes keys [first, first + count) as
  // [count, kv_lora_rank + rope_dim] into rows. The decode kernel asks for tiles of up to kKeyTile
  // keys, the tiled prefill for spans of several tiles (both starting at multiples of kKeyTile),
  // the reference for one key at any position: the callback takes any first and count.
  void (*decode_keys)(const void* context, int64_t first, int64_t count, float* rows) = nullptr;
  const void* decode_context = nullptr;
  // out: [n_q, num_heads, kv_lora_rank]: sum_j p_h(t, j) c_j.
  float* out = nullptr;
  int64_t out_row_stride = 0;
  int64_t out_head_stride = 0;
  // lse: [n_q, num_heads] log-sum-exp of the scaled logits; may be null.
  float* lse = nullptr;

  int64_t n_q = 0;
  int64_t num_heads = 0;
  int64_t kv_lora_rank = 0;
  int64_t rope_dim = 0;
  // Query i sits at absolute position q_pos0 + i and attends to keys [0, q_pos0 + i] (causal).
  int64_t q_pos0 = 0;
  float softmax_scale = 1.0f;
};

// Keys per tile of the attention kernels (and the cache page size they are aligned to).
inline constexpr int64_t kKeyTile = 64;

// Scalar reference: one query, one head, one key at a time, double accumulation. The oracle that
// every fast path is tested against.
void attention_reference(const AttentionParams& params);

// Fast path: up to 4 queries take an AVX2 kernel that reads each key once per group of heads;
// more queries take blocks of BLAS GEMMs (over all visible FP32 keys at once, or, when the keys
// come from decode_keys, span by span with an online softmax, each span decoded once for all
// queries).
void attention_f32(const AttentionParams& params);

}  // namespace quantmla
