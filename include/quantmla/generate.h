// Autoregressive generation: prefill the prompt into the cache, then decode one token at a time
// through the cache.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "quantmla/model.h"
#include "quantmla/runner.h"
#include "quantmla/sampler.h"

namespace quantmla {

struct GenerateOptions {
  int64_t max_tokens = 64;
  SamplerOptions sampling;
  bool stop_at_eos = true;
  CacheFormat cache = CacheFormat::f32();
};

// Returns the generated ids (EOS excluded). on_token is called for each one as it is produced and
// may return false to stop. Throws InvalidArgument for an empty prompt or one that, with
// max_tokens, exceeds the model's positions.
std::vector<int32_t> generate(const Model& model, std::span<const int32_t> prompt,
                              const GenerateOptions& options,
                              const std::function<bool(int32_t)>& on_token = {});

// The same through a runner (any backend): the prompt prefilled into a one-sequence pool of
// options.cache, then one decode step per token, each token sampled by the runner
// (counter_uniform(seed, position): a seeded run differs from the Sampler stream above).
std::vector<int32_t> generate(Runner& runner, std::span<const int32_t> prompt,
                              const GenerateOptions& options,
                              const std::function<bool(int32_t)>& on_token = {});

}  // namespace quantmla
