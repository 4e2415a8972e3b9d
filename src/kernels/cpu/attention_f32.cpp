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
// Keys decoded at once by the tiled prefill: wide enough that its GEMMs run near BLAS peak, small
// enough (576 KiB at DeepSeek's row width) to stay in cache while every query block uses them.
constexpr int64_t kKeySpan = 4 * kKeyTile;

// The GEMM kernels treat a block of queries as one [n_q * num_heads, width] matrix.
void require_adjacent_heads(const AttentionParams& p) {
  if (p.q_row_stride != p.num_heads * p.q_head_stride ||
      p.out_row_stride != p.num_heads * p.out_head_stride) {
    throw InvalidArgument(
        "attention: queries and outputs must be [n_q, num_heads, width] with heads adjacent (q "
        "strides " +
        std::to_string(p.q_row_stride) + "/" + std::to_string(p.q_head_stride) + ", out strides " +
        std::to_string(p.out_row_stride) + "/" + std::to_string(p.out_head_stride) + ")");
  }
}

}  // namespace

namespace cpu {

void attention_prefill_f32(const AttentionParams& p) {
  const int64_t key_width = p.kv_lora_rank + p.rope_dim;
  require_adjacent_heads(p);
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
          cpu::softmax_row(scores.data() + row * num_keys, visible, num_keys, p.softmax_scale);
      if (p.lse != nullptr) p.lse[query * p.num_heads + row % p.num_heads] = lse;
    }

    float* out_block = p.out + block_begin * p.out_row_stride;
    cpu::matmul_nn(scores.data(), num_keys, p.kv, p.kv_row_stride, out_block, p.out_head_stride,
                   rows, p.kv_lora_rank, num_keys);
  }
}

// Keys from decode_keys: decoded once, span by span, and each span serves every block of queries
// that sees it, as two GEMMs per block. The online softmax state (running max and sum per query
// row and head) lives across spans, and the outputs accumulate in place in p.out, so only one span
// of keys is ever held in FP32.
void attention_prefill_tiled(const AttentionParams& p) {
  require_adjacent_heads(p);
  if (p.n_q == 0) return;
  const int64_t key_width = p.kv_lora_rank + p.rope_dim;
  const int64_t rank = p.kv_lora_rank;
  const int64_t heads = p.num_heads;
  const int64_t all_rows = p.n_q * heads;  // row r: query r / heads, head r % heads
  const int64_t num_keys = p.q_pos0 + p.n_q;
  std::vector<float> span_keys(static_cast<size_t>(kKeySpan * key_width));
  std::vector<float> scores(static_cast<size_t>(std::min(kQueryBlock, p.n_q) * heads * kKeySpan));
  std::vector<float> running_max(static_cast<size_t>(all_rows),
                                 -std::numeric_limits<float>::infinity());
  std::vector<float> running_sum(static_cast<size_t>(all_rows), 0.0f);
  for (int64_t row = 0; row < all_rows; ++row) {
    std::fill_n(p.out + row * p.out_head_stride, rank, 0.0f);
  }

  for (int64_t span = 0; span < num_keys; span += kKeySpan) {
    const int64_t span_count = std::min(kKeySpan, num_keys - span);
    p.decode_keys(p.decode_context, span, span_count, span_keys.data());
    // Query i sees keys [0, q_pos0 + i]: blocks before the one holding query span - q_pos0 see
    // none of this span.
    const int64_t first_block = std::max<int64_t>(0, span - p.q_pos0) / kQueryBlock * kQueryBlock;
    for (int64_t block_begin = first_block; block_begin < p.n_q; block_begin += kQueryBlock) {
      const int64_t block_end = std::min(p.n_q, block_begin + kQueryBlock);
      const int64_t rows = (block_end - block_begin) * heads;
      const int64_t row0 = block_begin * heads;
      // Keys of the span that the block's last query sees: at least one.
      const int64_t count = std::min(span_count, p.q_pos0 + block_end - span);
      float* out_block = p.out + block_begin * p.out_row_stride;
      cpu::matmul_nt(p.q + block_begin * p.q_row_stride, p.q_head_stride, span_keys.data(),
                     key_width, scores.data(), kKeySpan, rows, count, key_width);
#pragma omp parallel for schedule(static)
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t query = block_begin + row / heads;
        const int64_t visible = std::clamp<int64_t>(p.q_pos0 + query + 1 - span, 0, count);
        float* s = scores.data() + row * kKeySpan;
        if (visible == 0) {  // the whole span lies after this query
          std::fill_n(s, count, 0.0f);
          continue;
        }
        float& row_max = running_max[static_cast<size_t>(row0 + row)];
        float& row_sum = running_sum[static_cast<size_t>(row0 + row)];
        float span_max = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < visible; ++j) {
          span_max = std::max(span_max, s[j] *= p.softmax_scale);
        }
        const float new_max = std::max(row_max, span_max);
        const float correction = std::exp(row_max - new_max);  // 0 on the row's first span
        float span_sum = 0.0f;
        for (int64_t j = 0; j < visible; ++j) span_sum += (s[j] = std::exp(s[j] - new_max));
        std::fill(s + visible, s + count, 0.0f);
        row_sum = row_sum * correction + span_sum;
        row_max = new_max;
        if (correction != 1.0f) {
          float* out = out_block + row * p.out_head_stride;
          for (int64_t d = 0; d < rank; ++d) out[d] *= correction;
        }
      }
      cpu::matmul_nn(scores.data(), kKeySpan, span_keys.data(), key_width, out_block,
                     p.out_head_stride, rows, rank, count, /*accumulate=*/true);
    }
  }

#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < all_rows; ++row) {
    float* out = p.out + row * p.out_head_stride;
    const auto r = static_cast<size_t>(row);
    const float inv_sum = 1.0f / running_sum[r];
    for (int64_t d = 0; d < rank; ++d) out[d] *= inv_sum;
    if (p.lse != nullptr) p.lse[row] = running_max[r] + std::log(running_sum[r]);
  }
}

}  // namespace cpu

void attention_f32(const AttentionParams& p) {
  // Below this many queries BLAS packing of the keys costs more than the arithmetic.
  constexpr int64_t kDecodeQueries = 4;
  if (p.n_q <= kDecodeQueries && cpu::attention_decode_f32_supported(p)) {
    cpu::attention_decode_f32(p);
  } else if (p.decode_keys != nullptr) {
    cpu::attention_prefill_tiled(p);
  } else {
    cpu::attention_prefill_f32(p);
  }
}

}  // namespace quantmla
