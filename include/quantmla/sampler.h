// Next-token choice: greedy at temperature 0, else temperature + nucleus (top-p) sampling.
#pragma once

#include <cstdint>
#include <span>

namespace quantmla {

struct SamplerOptions {
  float temperature = 0.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
};

// Throws InvalidArgument for temperature < 0 or top_p outside (0, 1].
void check_sampler_options(const SamplerOptions& options);

// The token `logits` give for a draw `uniform` in [0, 1): greedy (lowest id on ties) at
// temperature 0, else the smallest set of most probable tokens whose mass reaches top_p, and in
// it the token where the draw falls.
int32_t sample_token(std::span<const float> logits, const SamplerOptions& options, double uniform);

// A uniform draw in [0, 1) from (seed, counter) alone (splitmix64): the runners draw the token at
// position p with counter p, so a draw depends neither on the batch nor on the step it ran in.
double counter_uniform(uint64_t seed, uint64_t counter);

}  // namespace quantmla
