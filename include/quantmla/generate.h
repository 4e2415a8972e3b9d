// Autoregressive generation: prefill the prompt into the cache, then decode one token at a time
// through the cache.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "quantmla/logits_controls.h"
#include "quantmla/runner.h"
#include "quantmla/sampler.h"

namespace quantmla {

struct GenerateOptions {
  int64_t max_tokens = 64;
  SamplerOptions sampling;
  // top-k, min-p, penalties, biases: when any is set, each token is drawn on the host from the
  // step's logit row (the scheduler's way, logits_controls.h)
  LogitsControls controls;
  bool stop_at_eos = true;
  CacheFormat cache = CacheFormat::f32();
};

// Through a runner (any backend): the prompt prefilled into a one-sequence pool of options.cache,
// then one decode step per token, each token drawn with counter_uniform(seed, position), by the
// runner or, with controls, here. Returns the generated ids (EOS excluded). on_token is called for
// each one as it is produced and may return false to stop. Throws InvalidArgument for an empty
// prompt, one that with max_tokens exceeds the model's positions, or bad sampling options or
// controls.
std::vector<int32_t> generate(Runner& runner, std::span<const int32_t> prompt,
                              const GenerateOptions& options,
                              const std::function<bool(int32_t)>& on_token = {});

}  // namespace quantmla
