// Next-token choice: greedy at temperature 0, else temperature + nucleus (top-p) sampling.
#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace quantmla {

struct SamplerOptions {
  float temperature = 0.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
};

class Sampler {
 public:
  // Throws InvalidArgument for temperature < 0 or top_p outside (0, 1].
  explicit Sampler(const SamplerOptions& options);
  int32_t sample(std::span<const float> logits);

 private:
  SamplerOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace quantmla
