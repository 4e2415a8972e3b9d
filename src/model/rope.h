// Rotary position embedding on interleaved pairs (2i, 2i+1), with YaRN frequency correction and
// attention factor, computed in FP32 the way transformers computes it.
#pragma once

#include <cstdint>
#include <vector>

#include "quantmla/config.h"

namespace quantmla {

class Rope {
 public:
  explicit Rope(const ModelConfig& config);

  // Rotates `count` vectors of `dim` values in place, vector v at `position`; stride in elements.
  void apply(float* x, int64_t count, int64_t stride, int64_t position) const;
  const std::vector<float>& inv_freq() const { return inv_freq_; }
  float attention_factor() const { return attention_factor_; }

 private:
  int64_t dim_;
  std::vector<float> inv_freq_;  // [dim / 2]
  float attention_factor_ = 1.0f;
};

}  // namespace quantmla
