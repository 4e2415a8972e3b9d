#include "quantmla/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "quantmla/error.h"

namespace quantmla {

Sampler::Sampler(const SamplerOptions& options) : options_(options), rng_(options.seed) {
  if (!(options.temperature >= 0.0f)) {
    throw InvalidArgument("temperature must be >= 0, got " + std::to_string(options.temperature));
  }
  if (!(options.top_p > 0.0f && options.top_p <= 1.0f)) {
    throw InvalidArgument("top_p must be in (0, 1], got " + std::to_string(options.top_p));
  }
}

int32_t Sampler::sample(std::span<const float> logits) {
  const auto best = std::max_element(logits.begin(), logits.end());
  if (options_.temperature == 0.0f) return static_cast<int32_t>(best - logits.begin());

  std::vector<double> probs(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    probs[i] = std::exp((static_cast<double>(logits[i]) - *best) / options_.temperature);
    sum += probs[i];
  }
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return probs[a] > probs[b]; });
  // Smallest prefix of the sorted distribution whose mass reaches top_p.
  double kept = 0.0;
  size_t nucleus = 0;
  while (nucleus < order.size() && (nucleus == 0 || kept < options_.top_p * sum)) {
    kept += probs[order[nucleus++]];
  }
  std::uniform_real_distribution<double> uniform(0.0, kept);
  double draw = uniform(rng_);
  for (size_t i = 0; i < nucleus; ++i) {
    draw -= probs[order[i]];
    if (draw <= 0.0) return order[i];
  }
  return order[nucleus - 1];
}

}  // namespace quantmla
