// Blocked absorbed attention on FP32 rows: for a block of queries, the scores of all heads against
// the keys the block can see are one GEMM, the weighted value sum another. Keys past the block's
// last position are never touched; inside the block the causal mask is applied row by row.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/attention_kernels.h"
#include "kernels/cpu/ops.h"
#include "quantmla/attention.h"
#include "quantmla/error.h"

namespace quantmla {
namespace {

constexpr int64_t kQueryBlock = 64;

// Scaled, masked softmax of one row in place; returns the log-sum-exp.
float softmax_row(float* row, int64_t visible, int64_t total, float scale) {
  float max_logit = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < visible; ++j) {
    row[j] *= scale;
    max_logit = std::max(max_logit, row[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < visible; ++j) {
    row[j] = std::exp(row[j] - max_logit);
    sum += row[j];
  }
  const float inv_sum = 1.0f / sum;
  for (int64_t j = 0; j < visible; ++j) row[j] *= inv_sum;
  std::fill(row + visible, row + total, 0.0f);
  return max_logit + std::log(sum);
}

}  // namespace

namespace cpu {

void attention_prefill_f32(const AttentionParams& p) {
  const int64_t key_width = p.kv_lora_rank + p.rope_dim;
  if (p.q_row_stride != p.num_heads * p.q_head_stride ||
      p.out_row_stride != p.num_heads * p.out_head_stride) {
    throw InvalidArgument(
        "attention_prefill_f32: queries and outputs must be [n_q, num_heads, width] "
        "with heads adjacent (q strides " +
        std::to_string(p.q_row_stride) + "/" + std::to_string(p.q_head_stride) + ", out strides " +
        std::to_string(p.out_row_stride) + "/" + std::to_string(p.out_head_stride) + ")");
  }
  std::vector<float> scores;
  for (int64_t block_begin = 0; block_begin < p.n_q; block_begin += kQueryBlock) {
    const int64_t block_end = std::min(p.n_q, block_begin + kQueryBlock);
    const int64_t rows = (block_end - block_begin) * p.num_heads;
    const int64_t num_keys = p.q_pos0 + block_end;  // keys the last query of the block sees
    scores.resize(static_cast<size_t>(rows * num_keys));

    const float* q_block = p.q + block_begin * p.q_row_stride;
    cpu::matmul_nt(q_block, p.q_head_stride, p.kv, p.kv_row_stride, scores.data(), num_keys, rows,
                   num_keys, key_width);

#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t query = block_begin + row / p.num_heads;
      const int64_t visible = p.q_pos0 + query + 1;
      const float lse =
          softmax_row(scores.data() + row * num_keys, visible, num_keys, p.softmax_scale);
      if (p.lse != nullptr) p.lse[query * p.num_heads + row % p.num_heads] = lse;
    }

    float* out_block = p.out + block_begin * p.out_row_stride;
    cpu::matmul_nn(scores.data(), num_keys, p.kv, p.kv_row_stride, out_block, p.out_head_stride,
                   rows, p.kv_lora_rank, num_keys);
  }
}

}  // namespace cpu

void attention_f32(const AttentionParams& p) {
  // Below this many queries BLAS packing of the keys costs more than the arithmetic.
  constexpr int64_t kDecodeQueries = 4;
  if (p.n_q <= kDecodeQueries && cpu::attention_decode_f32_supported(p)) {
    cpu::attention_decode_f32(p);
  } else {
    cpu::attention_prefill_f32(p);
  }
}

}  // namespace quantmla
