// Absorbed attention for a few queries (decode): every key row is loaded once per group of heads
// and serves all of them, for scores and values alike. No BLAS packing of the cache, which for one
// query costs more than the arithmetic.
#include <immintrin.h>
#include <omp.h>

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

// Query i over keys [key_begin, key_end), every head, in one pass tile by tile with an online
// softmax: each tile's rows are read from memory (or decoded from a compressed cache) once, and
// serve every group of heads for scores and values while they sit in L2. Writes the range's
// normalized output out[h * rank + d] and its log-sum-exp lse[h].
// kv_lora_rank is a multiple of 32 and rope_dim of 16 (attention_decode_f32_supported).
void attend_key_range(const AttentionParams& p, int64_t i, int64_t key_begin, int64_t key_end,
                      float* out, float* lse, std::vector<float>& decoded,
                      std::vector<float>& running_max, std::vector<float>& running_sum) {
  const int64_t heads = p.num_heads;
  const int64_t rank = p.kv_lora_rank;
  running_max.assign(static_cast<size_t>(heads), -std::numeric_limits<float>::infinity());
  running_sum.assign(static_cast<size_t>(heads), 0.0f);
  std::fill_n(out, heads * rank, 0.0f);
  alignas(32) float scores[kHeadGroup * kKeyTile];
  for (int64_t tile = key_begin; tile < key_end; tile += kKeyTile) {
    const int64_t count = std::min(key_end, tile + kKeyTile) - tile;
    const float* rows = decoded.data();
    int64_t stride = p.kv_lora_rank + p.rope_dim;
    if (p.decode_keys != nullptr) {
      p.decode_keys(p.decode_context, tile, count, decoded.data());
    } else {
      rows = p.kv + tile * p.kv_row_stride;
      stride = p.kv_row_stride;
    }
    for (int64_t head_begin = 0; head_begin < heads; head_begin += kHeadGroup) {
      const int group = static_cast<int>(std::min<int64_t>(kHeadGroup, heads - head_begin));
      const float* q[kHeadGroup];
      float* group_out[kHeadGroup];
      for (int g = 0; g < group; ++g) {
        q[g] = p.q + i * p.q_row_stride + (head_begin + g) * p.q_head_stride;
        group_out[g] = out + (head_begin + g) * rank;
      }
      tile_scores(p, q, group, rows, stride, count, scores);
      for (int g = 0; g < group; ++g) {
        const int64_t h = head_begin + g;
        float* row = scores + g * kKeyTile;
        const float new_max = std::max(running_max[h], *std::max_element(row, row + count));
        const float correction = std::exp(running_max[h] - new_max);  // 0 on the first tile
        float tile_sum = 0.0f;
        for (int64_t j = 0; j < count; ++j) tile_sum += (row[j] = std::exp(row[j] - new_max));
        running_sum[h] = running_sum[h] * correction + tile_sum;
        running_max[h] = new_max;
        if (tile > key_begin) scale_row(group_out[g], rank, correction);
      }
      tile_values(p, group_out, group, rows, stride, count, scores);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    scale_row(out + h * rank, rank, 1.0f / running_sum[h]);
    lse[h] = running_max[h] + std::log(running_sum[h]);
  }
}

// Keys per split of the sequence: enough tiles that a split's work outweighs the combine.
constexpr int64_t kMinKeysPerSplit = 4 * kKeyTile;

}  // namespace

bool attention_decode_f32_supported(const AttentionParams& p) {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         p.kv_lora_rank % 32 == 0 && p.rope_dim % 16 == 0;
}

// The keys of each query are split across threads (rather than the heads, which would make every
// thread stream the whole cache), and the splits are merged by their log-sum-exp.
void attention_decode_f32(const AttentionParams& p) {
  const int64_t heads = p.num_heads;
  const int64_t rank = p.kv_lora_rank;
  const int64_t max_keys = p.q_pos0 + p.n_q;
  const int64_t threads = std::max(1, omp_get_max_threads());
  const int64_t splits =
      std::clamp<int64_t>(max_keys / kMinKeysPerSplit, 1, std::max<int64_t>(1, threads / p.n_q));
  // Per (query, split): the split's normalized output [heads, rank] and log-sum-exp [heads].
  std::vector<float> partial_out(static_cast<size_t>(p.n_q * splits * heads * rank));
  std::vector<float> partial_lse(static_cast<size_t>(p.n_q * splits * heads));
#pragma omp parallel
  {
    std::vector<float> decoded(p.decode_keys != nullptr
                                   ? static_cast<size_t>(kKeyTile * (p.kv_lora_rank + p.rope_dim))
                                   : 0);
    std::vector<float> running_max, running_sum;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < p.n_q * splits; ++task) {
      const int64_t i = task / splits, split = task % splits;
      const int64_t num_keys = p.q_pos0 + i + 1;
      // Split boundaries on tile boundaries, so tiles stay aligned with cache pages.
      const int64_t tiles = (num_keys + kKeyTile - 1) / kKeyTile;
      const int64_t key_begin = std::min(num_keys, tiles * split / splits * kKeyTile);
      const int64_t key_end = std::min(num_keys, tiles * (split + 1) / splits * kKeyTile);
      float* out = partial_out.data() + task * heads * rank;
      float* lse = partial_lse.data() + task * heads;
      if (key_begin == key_end) {
        std::fill_n(lse, heads, -std::numeric_limits<float>::infinity());
        std::fill_n(out, heads * rank, 0.0f);
        continue;
      }
      attend_key_range(p, i, key_begin, key_end, out, lse, decoded, running_max, running_sum);
    }
  }
  for (int64_t i = 0; i < p.n_q; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      float max_lse = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) {
        max_lse = std::max(max_lse, partial_lse[(i * splits + s) * heads + h]);
      }
      float total = 0.0f;
      for (int64_t s = 0; s < splits; ++s) {
        total += std::exp(partial_lse[(i * splits + s) * heads + h] - max_lse);
      }
      const float lse = max_lse + std::log(total);
      float* out = p.out + i * p.out_row_stride + h * p.out_head_stride;
      std::fill_n(out, rank, 0.0f);
      for (int64_t s = 0; s < splits; ++s) {
        const float weight = std::exp(partial_lse[(i * splits + s) * heads + h] - lse);
        const float* part = partial_out.data() + ((i * splits + s) * heads + h) * rank;
        if (weight > 0.0f) {
          for (int64_t d = 0; d < rank; ++d) out[d] += weight * part[d];
        }
      }
      if (p.lse != nullptr) p.lse[i * heads + h] = lse;
    }
  }
}

}  // namespace quantmla::cpu
