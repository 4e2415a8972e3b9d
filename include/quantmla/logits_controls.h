// Per-request changes to a logits row before its token is drawn: the sampling parameters of
// vLLM's and OpenAI's APIs beyond temperature and top-p. The runners sample with temperature and
// top-p alone (on the GPU for the CUDA runner); a request that sets any of these has its rows
// returned as logits and drawn on the host by the scheduler, with the runners' draw
// (counter_uniform(seed, position)), so that the result depends on neither the backend, the batch
// nor a preemption.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "quantmla/sampler.h"

namespace quantmla {

struct LogitsControls {
  int32_t top_k = 0;   // keep the k most likely tokens (ties at the k-th kept); 0: all
  float min_p = 0.0f;  // drop tokens less likely than min_p x the most likely one; 0: none
  float presence_penalty = 0.0f;    // subtracted from each token generated so far, once
  float frequency_penalty = 0.0f;   // subtracted from each token generated so far, per time
  float repetition_penalty = 1.0f;  // tokens of the prompt or generated: logit / p if > 0, x p else
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token, added to its logit)

  // Whether any control differs from its neutral value (the runner's sampling is then not enough).
  bool active() const;
};

// Throws InvalidArgument, naming the field and its value, for top_k < 0, min_p outside [0, 1],
// presence or frequency penalty outside [-2, 2], a repetition penalty not in (0, 100], a bias
// outside [-100, 100] or on a token outside [0, vocab_size).
void check_logits_controls(const LogitsControls& controls, int64_t vocab_size);

// The row a request's token is drawn from, changed in place in vLLM's order: the biases added,
// the tokens in `banned` (min_tokens' EOS and stop tokens) set to -inf, then the repetition
// penalty over `prompt` and `generated`, the frequency and presence penalties over `generated`.
void apply_logits_controls(std::span<float> logits, const LogitsControls& controls,
                           std::span<const int32_t> prompt, std::span<const int32_t> generated,
                           std::span<const int32_t> banned);

// The token drawn from a row changed by apply_logits_controls: greedy at temperature 0; else the
// tokens below min_p x the most likely one's probability (at the temperature) and those outside
// the top_k removed, and sample_token's top-p draw over what is left.
int32_t sample_controlled(std::span<float> logits, const SamplerOptions& options,
                          const LogitsControls& controls, double uniform);

// The next token of a sequence from its raw logit row: the row copied into `work` (reused from
// call to call), apply_logits_controls, then sample_controlled with the draw `uniform`.
int32_t draw_with_controls(std::span<const float> logits, const SamplerOptions& options,
                           const LogitsControls& controls, std::span<const int32_t> prompt,
                           std::span<const int32_t> generated, std::span<const int32_t> banned,
                           double uniform, std::vector<float>& work);

}  // namespace quantmla
