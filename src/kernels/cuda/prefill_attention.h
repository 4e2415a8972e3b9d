// Prefill attention in MLA's expanded form, for long chunks: the sequence's cache rows (dequantized
// by mla_gather) are up-projected once per chunk into per-head keys and transposed values
// (kv_b_proj, two strided-batched cuBLAS products), and the chunk's queries attend to them in one
// flash-style kernel on the warpgroup tensor-core instructions (tiles of 128 queries of one head
// against tiles of 128 keys, the causal softmax online in registers, nothing quadratic in
// memory). Per key and head that is 192 + 128 multiply-adds instead of the absorbed
// form's 576 + 512 (the decode kernel's), paid for by the up-projection: 512 x 256 per key and
// head, so it wins for chunks of more than about 200 queries.
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

// Head dimensions the attention kernel is compiled for: rope 64 with nope = v = 128 (DeepSeek-V2,
// V3, Kimi K2, Moonlight) or nope = v = 64 (the trained mla-tiny fixtures).
bool prefill_attention_supports(int nope, int rope, int v);

// Device memory of the expanded keys and values, for contexts up to max_context.
struct PrefillAttentionWorkspace {
  void* device = nullptr;
  size_t bytes = 0;
  static size_t bytes_for(int heads, int nope, int v, int64_t max_context);
  int64_t max_context = 0;
};

// Runs the attention of one sequence's chunk on `stream` (the up-projection through `gemm`);
// allocates nothing. Throws ShapeError for inconsistent shapes, head dimensions outside
// prefill_attention_supports, rows the copy engine cannot read (rank and keys_stride multiples of
// 8, keys and q 16-byte aligned) or the kernel store in pairs (out_stride even), a context beyond
// the workspace's max_context or a workspace smaller than bytes_for.
void prefill_attention(GemmRunner& gemm, const PrefillAttentionParams& params,
                       const PrefillAttentionWorkspace& workspace, cudaStream_t stream);

// The up-projection alone (the first part of prefill_attention; benchmarks time the two parts).
void prefill_attention_projection(GemmRunner& gemm, const PrefillAttentionParams& params,
                                  const PrefillAttentionWorkspace& workspace, cudaStream_t stream);

}  // namespace quantmla::gpu
