#include "quantmla/generate.h"

#include <string>

#include "quantmla/error.h"
#include "quantmla/logits_controls.h"

namespace quantmla {

std::vector<int32_t> generate(Runner& runner, std::span<const int32_t> prompt,
                              const GenerateOptions& options,
                              const std::function<bool(int32_t)>& on_token) {
  if (prompt.empty()) throw InvalidArgument("empty prompt: nothing to generate from");
  if (options.max_tokens < 0) {
    throw InvalidArgument("max_tokens must be >= 0, got " + std::to_string(options.max_tokens));
  }
  const ModelConfig& config = runner.config();
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_tokens;
  if (total > config.max_position_embeddings) {
    throw InvalidArgument("prompt of " + std::to_string(prompt.size()) + " tokens + " +
                          std::to_string(options.max_tokens) + " new tokens exceeds the model's " +
                          std::to_string(config.max_position_embeddings) + " positions");
  }
  check_sampler_options(options.sampling);
  check_logits_controls(options.controls, config.vocab_size);
  std::vector<int32_t> generated;
  if (options.max_tokens == 0) return generated;
  auto pool = runner.make_pool(options.cache, PagePool::pages_for_tokens(total));
  const SequenceId seq = pool->add_sequence();
  pool->reserve(seq, total);
  int32_t next = 0;
  StepBatch batch;
  batch.chunks.push_back({seq, prompt, LogitRows::kLast, options.sampling});
  // Controls need the logit row: the token is then drawn here with the runner's own draw.
  std::vector<float> logits, work;
  if (options.controls.active()) logits.resize(static_cast<size_t>(config.vocab_size));
  int64_t length = static_cast<int64_t>(prompt.size());
  while (true) {
    runner.step(batch, *pool, {logits, std::span(&next, 1)});
    if (!logits.empty()) {
      next = draw_with_controls(
          logits, options.sampling, options.controls, prompt, generated, {},
          counter_uniform(options.sampling.seed, static_cast<uint64_t>(length)), work);
    }
    ++length;
    if (options.stop_at_eos && next == config.eos_token_id) break;
    generated.push_back(next);
    if (on_token && !on_token(next)) break;
    if (static_cast<int64_t>(generated.size()) >= options.max_tokens) break;
    batch.chunks[0].tokens = std::span<const int32_t>(&generated.back(), 1);
  }
  return generated;
}

}  // namespace quantmla
