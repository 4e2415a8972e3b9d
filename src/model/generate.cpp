#include "quantmla/generate.h"

#include <string>

#include "quantmla/error.h"

namespace quantmla {

std::vector<int32_t> generate(const Model& model, std::span<const int32_t> prompt,
                              const GenerateOptions& options,
                              const std::function<bool(int32_t)>& on_token) {
  if (prompt.empty()) throw InvalidArgument("empty prompt: nothing to generate from");
  if (options.max_tokens < 0) {
    throw InvalidArgument("max_tokens must be >= 0, got " + std::to_string(options.max_tokens));
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_tokens;
  if (total > model.max_positions()) {
    throw InvalidArgument("prompt of " + std::to_string(prompt.size()) + " tokens + " +
                          std::to_string(options.max_tokens) + " new tokens exceeds the model's " +
                          std::to_string(model.max_positions()) + " positions");
  }
  Sampler sampler(options.sampling);
  const int64_t vocab = model.config().vocab_size;
  auto cache = model.make_cache(total, options.cache);
  std::vector<float> logits(static_cast<size_t>(vocab));
  std::vector<int32_t> generated;
  if (options.max_tokens == 0) return generated;

  model.forward(prompt, *cache, logits, /*all_logits=*/false);
  while (true) {
    const int32_t next = sampler.sample(logits);
    if (options.stop_at_eos && next == model.config().eos_token_id) break;
    generated.push_back(next);
    if (on_token && !on_token(next)) break;
    if (static_cast<int64_t>(generated.size()) >= options.max_tokens) break;
    model.forward(std::span<const int32_t>(&next, 1), *cache, logits, /*all_logits=*/false);
  }
  return generated;
}

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
  std::vector<int32_t> generated;
  if (options.max_tokens == 0) return generated;
  auto pool = runner.make_pool(options.cache, PagePool::pages_for_tokens(total));
  const SequenceId seq = pool->add_sequence();
  pool->reserve(seq, total);
  int32_t next = 0;
  StepBatch batch;
  batch.chunks.push_back({seq, prompt, LogitRows::kLast, options.sampling});
  while (true) {
    runner.step(batch, *pool, {{}, std::span(&next, 1)});
    if (options.stop_at_eos && next == config.eos_token_id) break;
    generated.push_back(next);
    if (on_token && !on_token(next)) break;
    if (static_cast<int64_t>(generated.size()) >= options.max_tokens) break;
    batch.chunks[0].tokens = std::span<const int32_t>(&generated.back(), 1);
  }
  return generated;
}

}  // namespace quantmla
