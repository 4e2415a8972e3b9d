// Absorbed attention for a few queries (decode): every key row is loaded once per group of heads
// and serves all of them, for scores and values alike. No BLAS packing of the cache, which for one
// query costs more than the arithmetic.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cpu/attention_kernels.h"
#include "quantmla/error.h"

namespace quantmla::cpu {
namespace {

constexpr int kHeadGroup = 4;

__attribute__((target("avx2,fma"))) inline float horizontal_sum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
}

// Scores of the `count` key rows of a tile for G heads, scaled, into scores[g * kKeyTile + j].
// Each key chunk is loaded once for all G heads; G is a template parameter so that the
// accumulators stay in registers.
template <int G>
__attribute__((target("avx2,fma"))) void tile_scores(const AttentionParams& p,
                                                     const float* const* q, const float* rows,
                                                     int64_t stride, int64_t count, float* scores) {
  const int64_t key_width = p.kv_lora_rank + p.rope_dim;
  for (int64_t j = 0; j < count; ++j) {
    const float* key = rows + j * stride;
    // Two accumulators per head halve the FMA dependency chains.
    __m256 even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < key_width; d += 16) {
      const __m256 k0 = _mm256_loadu_ps(key + d);
      const __m256 k1 = _mm256_loadu_ps(key + d + 8);
      for (int g = 0; g < G; ++g) {
        even[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), k0, even[g]);
        odd[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d + 8), k1, odd[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      scores[g * kKeyTile + j] = horizontal_sum(_mm256_add_ps(even[g], odd[g])) * p.softmax_scale;
    }
  }
}

void tile_scores(const AttentionParams& p, const float* const* q, int group, const float* rows,
                 int64_t stride, int64_t count, float* scores) {
  switch (group) {
    case 1:
      return tile_scores<1>(p, q, rows, stride, count, scores);
    case 2:
      return tile_scores<2>(p, q, rows, stride, count, scores);
    case 3:
      return tile_scores<3>(p, q, rows, stride, count, scores);
    case 4:
      return tile_scores<4>(p, q, rows, stride, count, scores);
    default:
      throw InvalidArgument("attention decode: head group of " + std::to_string(group));
  }
}

// out_g += sum_j weights[g][j] c_j over the tile. Two heads x 32 channels = 8 accumulators in
// registers; the tile's rows are still in L2 from the score pass.
__attribute__((target("avx2,fma"))) void tile_values(const AttentionParams& p, float* const* out,
                                                     int group, const float* rows, int64_t stride,
                                                     int64_t count, const float* weights) {
  for (int g0 = 0; g0 < group; g0 += 2) {
    const int g1 = std::min(g0 + 1, group - 1);  // an odd group pairs its last head with itself
    const float* weights0 = weights + g0 * kKeyTile;
    const float* weights1 = weights + g1 * kKeyTile;
    for (int64_t d = 0; d < p.kv_lora_rank; d += 32) {
      __m256 a0[4], a1[4];
      for (int v = 0; v < 4; ++v) {
        a0[v] = _mm256_loadu_ps(out[g0] + d + 8 * v);
        a1[v] = _mm256_loadu_ps(out[g1] + d + 8 * v);
      }
      for (int64_t j = 0; j < count; ++j) {
        const float* value = rows + j * stride + d;
        const __m256 w0 = _mm256_set1_ps(weights0[j]);
        const __m256 w1 = _mm256_set1_ps(weights1[j]);
        for (int v = 0; v < 4; ++v) {
          const __m256 c = _mm256_loadu_ps(value + 8 * v);
          a0[v] = _mm256_fmadd_ps(w0, c, a0[v]);
          a1[v] = _mm256_fmadd_ps(w1, c, a1[v]);
        }
      }
      for (int v = 0; v < 4; ++v) {  // g1 first: when it aliases g0, g0's store wins
        _mm256_storeu_ps(out[g1] + d + 8 * v, a1[v]);
        _mm256_storeu_ps(out[g0] + d + 8 * v, a0[v]);
      }
    }
  }
}

__attribute__((target("avx2,fma"))) void scale_row(float* row, int64_t width, float factor) {
  const __m256 f = _mm256_set1_ps(factor);
  for (int64_t d = 0; d < width; d += 8) {
    _mm256_storeu_ps(row + d, _mm256_mul_ps(_mm256_loadu_ps(row + d), f));
  }
}

// Heads [head_begin, head_begin + group) of query i in one pass over the keys, tile by tile, with
// an online softmax: each tile's rows are read from memory (or decoded from a compressed cache)
// once for both scores and values.
// kv_lora_rank is a multiple of 32 and rope_dim of 16 (attention_decode_f32_supported).
void attend_head_group(const AttentionParams& p, int64_t i, int64_t head_begin, int group,
                       std::vector<float>& decoded) {
  const int64_t num_keys = p.q_pos0 + i + 1;
  const float* q[kHeadGroup];
  float* out[kHeadGroup];
  float running_max[kHeadGroup], running_sum[kHeadGroup];
  for (int g = 0; g < group; ++g) {
    q[g] = p.q + i * p.q_row_stride + (head_begin + g) * p.q_head_stride;
    out[g] = p.out + i * p.out_row_stride + (head_begin + g) * p.out_head_stride;
    std::fill_n(out[g], p.kv_lora_rank, 0.0f);
    running_max[g] = -std::numeric_limits<float>::infinity();
    running_sum[g] = 0.0f;
  }
  alignas(32) float scores[kHeadGroup * kKeyTile];
  for (int64_t tile = 0; tile < num_keys; tile += kKeyTile) {
    const int64_t tile_end = std::min(num_keys, tile + kKeyTile);
    const int64_t count = tile_end - tile;
    const float* rows = decoded.data();
    int64_t stride = p.kv_lora_rank + p.rope_dim;
    if (p.decode_keys != nullptr) {
      p.decode_keys(p.decode_context, tile, count, decoded.data());
    } else {
      rows = p.kv + tile * p.kv_row_stride;
      stride = p.kv_row_stride;
    }
    tile_scores(p, q, group, rows, stride, count, scores);
    for (int g = 0; g < group; ++g) {
      float* row = scores + g * kKeyTile;
      const float new_max = std::max(running_max[g], *std::max_element(row, row + count));
      const float correction = std::exp(running_max[g] - new_max);  // 0 on the first tile
      float tile_sum = 0.0f;
      for (int64_t j = 0; j < count; ++j) tile_sum += (row[j] = std::exp(row[j] - new_max));
      running_sum[g] = running_sum[g] * correction + tile_sum;
      running_max[g] = new_max;
      if (tile > 0) scale_row(out[g], p.kv_lora_rank, correction);
    }
    tile_values(p, out, group, rows, stride, count, scores);
  }
  for (int g = 0; g < group; ++g) {
    scale_row(out[g], p.kv_lora_rank, 1.0f / running_sum[g]);
    if (p.lse != nullptr) {
      p.lse[i * p.num_heads + head_begin + g] = running_max[g] + std::log(running_sum[g]);
    }
  }
}

}  // namespace

bool attention_decode_f32_supported(const AttentionParams& p) {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         p.kv_lora_rank % 32 == 0 && p.rope_dim % 16 == 0;
}

void attention_decode_f32(const AttentionParams& p) {
  const int64_t groups_per_query = (p.num_heads + kHeadGroup - 1) / kHeadGroup;
  const int64_t tasks = p.n_q * groups_per_query;
#pragma omp parallel
  {
    // A tile of rows decoded from a compressed cache, private to the thread.
    std::vector<float> decoded(p.decode_keys != nullptr
                                   ? static_cast<size_t>(kKeyTile * (p.kv_lora_rank + p.rope_dim))
                                   : 0);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t i = task / groups_per_query;
      const int64_t head_begin = (task % groups_per_query) * kHeadGroup;
      const int group = static_cast<int>(std::min<int64_t>(kHeadGroup, p.num_heads - head_begin));
      attend_head_group(p, i, head_begin, group, decoded);
    }
  }
}

}  // namespace quantmla::cpu
