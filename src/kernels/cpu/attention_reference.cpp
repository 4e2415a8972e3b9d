// The scalar oracle: nothing clever, double accumulation, one (query, head, key) at a time.
#include <cmath>
#include <limits>
#include <vector>

#include "quantmla/attention.h"

namespace quantmla {

void attention_reference(const AttentionParams& p) {
  const int64_t key_width = p.kv_lora_rank + p.rope_dim;
  std::vector<double> logits;
  std::vector<double> accumulator(static_cast<size_t>(p.kv_lora_rank));
  std::vector<float> decoded(static_cast<size_t>(key_width));
  const auto key_row = [&](int64_t j) -> const float* {
    if (p.decode_keys == nullptr) return p.kv + j * p.kv_row_stride;
    p.decode_keys(p.decode_context, j, 1, decoded.data());
    return decoded.data();
  };
  for (int64_t i = 0; i < p.n_q; ++i) {
    const int64_t num_keys = p.q_pos0 + i + 1;
    logits.assign(static_cast<size_t>(num_keys), 0.0);
    for (int64_t h = 0; h < p.num_heads; ++h) {
      const float* q = p.q + i * p.q_row_stride + h * p.q_head_stride;
      double max_logit = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < num_keys; ++j) {
        const float* key = key_row(j);
        double dot = 0.0;
        for (int64_t d = 0; d < key_width; ++d) dot += static_cast<double>(q[d]) * key[d];
        logits[j] = dot * p.softmax_scale;
        max_logit = std::max(max_logit, logits[j]);
      }
      double sum = 0.0;
      for (double& logit : logits) {
        logit = std::exp(logit - max_logit);
        sum += logit;
      }
      std::fill(accumulator.begin(), accumulator.end(), 0.0);
      for (int64_t j = 0; j < num_keys; ++j) {
        const float* value = key_row(j);
        const double weight = logits[j] / sum;
        for (int64_t d = 0; d < p.kv_lora_rank; ++d) accumulator[d] += weight * value[d];
      }
      float* out = p.out + i * p.out_row_stride + h * p.out_head_stride;
      for (int64_t d = 0; d < p.kv_lora_rank; ++d) out[d] = static_cast<float>(accumulator[d]);
      if (p.lse != nullptr) {
        p.lse[i * p.num_heads + h] = static_cast<float>(max_logit + std::log(sum));
      }
    }
  }
}

}  // namespace quantmla
