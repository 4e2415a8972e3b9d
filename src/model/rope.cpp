#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace quantmla {
namespace {

double yarn_mscale(double factor, double mscale) {
  return factor <= 1.0 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

// Dimension index at which a frequency completes `rotations` turns over the original context.
double correction_dim(double rotations, int64_t dim, double base, double max_positions) {
  return dim * std::log(max_positions / (rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(base));
}

}  // namespace

Rope::Rope(const ModelConfig& config) : dim_(config.qk_rope_head_dim) {
  const double base = config.rope.theta;
  const int64_t half = dim_ / 2;
  std::vector<float> extrapolation(half);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim_);
    extrapolation[i] = 1.0f / std::pow(static_cast<float>(base), exponent);
  }
  if (!config.rope.yarn) {
    inv_freq_ = extrapolation;
    return;
  }

  const RopeConfig& yarn = config.rope;
  const double original = static_cast<double>(yarn.original_max_position_embeddings);
  const double factor = yarn.factor;
  double low = correction_dim(yarn.beta_fast, dim_, base, original);
  double high = correction_dim(yarn.beta_slow, dim_, base, original);
  if (yarn.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim_ - 1));
  if (low == high) high += 0.001;

  inv_freq_.resize(half);
  for (int64_t i = 0; i < half; ++i) {
    const float ramp =
        std::clamp(static_cast<float>((static_cast<double>(i) - low) / (high - low)), 0.0f, 1.0f);
    const float extrapolation_weight = 1.0f - ramp;
    const float interpolation = extrapolation[i] / static_cast<float>(factor);
    inv_freq_[i] =
        interpolation * (1.0f - extrapolation_weight) + extrapolation[i] * extrapolation_weight;
  }

  if (yarn.attention_factor > 0.0) {
    attention_factor_ = static_cast<float>(yarn.attention_factor);
  } else if (yarn.mscale != 0.0 && yarn.mscale_all_dim != 0.0) {
    attention_factor_ = static_cast<float>(yarn_mscale(factor, yarn.mscale) /
                                           yarn_mscale(factor, yarn.mscale_all_dim));
  } else {
    attention_factor_ = static_cast<float>(yarn_mscale(factor, 1.0));
  }
}

void Rope::apply(float* x, int64_t count, int64_t stride, int64_t position) const {
  const int64_t half = dim_ / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(position) * inv_freq_[i];
    const float cos_value = std::cos(angle) * attention_factor_;
    const float sin_value = std::sin(angle) * attention_factor_;
    for (int64_t v = 0; v < count; ++v) {
      float* pair = x + v * stride + 2 * i;
      const float even = pair[0];
      const float odd = pair[1];
      pair[0] = even * cos_value - odd * sin_value;
      pair[1] = odd * cos_value + even * sin_value;
    }
  }
}

}  // namespace quantmla
