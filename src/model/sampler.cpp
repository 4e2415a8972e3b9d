#include "quantmla/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "quantmla/error.h"

namespace quantmla {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

void check_sampler_options(const SamplerOptions& options) {
  if (!(options.temperature >= 0.0f)) {
    throw InvalidArgument("temperature must be >= 0, got " + std::to_string(options.temperature));
  }
  if (!(options.top_p > 0.0f && options.top_p <= 1.0f)) {
    throw InvalidArgument("top_p must be in (0, 1], got " + std::to_string(options.top_p));
  }
}

double counter_uniform(uint64_t seed, uint64_t counter) {
  const uint64_t bits = splitmix64(splitmix64(seed) ^ counter);
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

int32_t sample_token(std::span<const float> logits, const SamplerOptions& options, double uniform) {
  const auto best = std::max_element(logits.begin(), logits.end());
  if (options.temperature == 0.0f) return static_cast<int32_t>(best - logits.begin());

  std::vector<double> probs(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    probs[i] = std::exp((static_cast<double>(logits[i]) - *best) / options.temperature);
    sum += probs[i];
  }
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return probs[a] > probs[b]; });
  // Smallest prefix of the sorted distribution whose mass reaches top_p.
  double kept = 0.0;
  size_t nucleus = 0;
  while (nucleus < order.size() && (nucleus == 0 || kept < options.top_p * sum)) {
    kept += probs[order[nucleus++]];
  }
  double draw = uniform * kept;
  for (size_t i = 0; i < nucleus; ++i) {
    draw -= probs[order[i]];
    if (draw < 0.0) return order[i];
  }
  return order[nucleus - 1];
}

}  // namespace quantmla
