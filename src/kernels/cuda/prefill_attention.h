// Prefill attention in MLA's expanded form, for long chunks: the sequence's cache rows (dequantized
// by mla_gather) are up-projected once per chunk into per-head keys and values (kv_b_proj), and
// the chunk's queries attend to them with two cuBLAS products per query tile around a causal
// softmax. Per key and head that is 192 + 128 multiply-adds instead of the absorbed form's
// 576 + 512 (the decode kernel's), paid for by the up-projection: 512 x 256 per key and head, so
// it wins for chunks of more than about 200 queries. The scores of one query tile live in the
// workspace (FP32, then the probabilities in BF16), so memory is linear in the context: a tile
// holds as many queries as the workspace allows at that context.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/gemm.h"

namespace quantmla::gpu {

struct PrefillAttentionParams {
  // q: [tokens, heads, nope + rope] BF16 bits (RoPE applied), contiguous; query t sits at
  // position context - tokens + t and sees the keys at positions <= its own.
  const uint16_t* q = nullptr;
  // keys: [context, rank + rope] BF16 bits, the sequence's cache rows [c ; k_pe] (mla_gather),
  // row stride keys_stride.
  const uint16_t* keys = nullptr;
  int64_t keys_stride = 0;
  // kv_b: [heads * (nope + v), rank] BF16 bits, kv_b_proj's weight (per head W_UK rows, then W_UV).
  const uint16_t* kv_b = nullptr;
  // out: [tokens, heads * v] BF16 bits, row stride out_stride.
  uint16_t* out = nullptr;
  int64_t out_stride = 0;
  int64_t tokens = 0;
  int64_t context = 0;
  int heads = 0, nope = 0, rope = 0, v = 0, rank = 0;
  float softmax_scale = 1.0f;
};

// Device memory of the expanded keys and values and the score tiles, for contexts up to
// max_context.
struct PrefillAttentionWorkspace {
  void* device = nullptr;
  size_t bytes = 0;
  static size_t bytes_for(int heads, int nope, int v, int64_t max_context);
  int64_t max_context = 0;
};

// Queries per tile for `tokens` queries over `context` keys: at most 512 (smaller tiles skip more
// of the causal mask's zeros), a multiple of 64 unless all the queries fit, and never more
// score rows (tile x heads x context rounded up to 8) than bytes_for(.., max_context) holds.
// Requires 1 <= tokens <= context <= max_context.
int64_t prefill_query_tile(int heads, int64_t tokens, int64_t context, int64_t max_context);
// Score elements of the workspace (FP32 scores and BF16 probabilities each hold this many).
int64_t prefill_score_elements(int heads, int64_t max_context);

// Runs the attention of one sequence's chunk on `stream` through `gemm`; allocates nothing.
// Throws ShapeError for inconsistent shapes, a context beyond the workspace's max_context or a
// workspace smaller than bytes_for.
void prefill_attention(GemmRunner& gemm, const PrefillAttentionParams& params,
                       const PrefillAttentionWorkspace& workspace, cudaStream_t stream);

// The causal softmax between the two products (exposed for its test). Row rho = r * heads + h
// (query r of the tile, head h) sees keys [0, first_visible + r]:
//   probs[rho, j] = bf16(exp(scale * (scores[rho, j] - m)) / sum) for the visible j (m and sum
//   over them), 0 for the other j < keys; columns from keys on are not touched.
struct CausalSoftmaxParams {
  const float* scores = nullptr;  // [rows * heads, ld] FP32, columns [0, keys) written
  uint16_t* probs = nullptr;      // [rows * heads, ld] BF16 bits
  int64_t ld = 0;
  int64_t rows = 0;           // query rows (each with `heads` score rows)
  int64_t keys = 0;           // columns of each row
  int64_t first_visible = 0;  // query 0 sees keys [0, first_visible]
  int heads = 0;
  float scale = 1.0f;
};
void causal_softmax(const CausalSoftmaxParams& params, cudaStream_t stream);

}  // namespace quantmla::gpu
