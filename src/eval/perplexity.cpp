#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "eval/windows.h"
#include "quantmla/error.h"
#include "quantmla/eval.h"

namespace quantmla {

int64_t count_windows(const Model& model, size_t tokens, int64_t ctx, int64_t max_windows) {
  return count_windows(model.config(), tokens, ctx, max_windows);
}

int64_t count_windows(const ModelConfig& config, size_t tokens, int64_t ctx, int64_t max_windows) {
  if (ctx < 2) throw InvalidArgument("ctx must be at least 2, got " + std::to_string(ctx));
  if (ctx > config.max_position_embeddings) {
    throw InvalidArgument("ctx " + std::to_string(ctx) + " exceeds the model's " +
                          std::to_string(config.max_position_embeddings) + " positions");
  }
  const int64_t windows = static_cast<int64_t>(tokens) / (ctx - 1);
  if (windows == 0) {
    throw InvalidArgument("text has " + std::to_string(tokens) +
                          " tokens, fewer than one window of " + std::to_string(ctx - 1));
  }
  return max_windows > 0 ? std::min(windows, max_windows) : windows;
}

void fill_window(const Model& model, std::span<const int32_t> ids, int64_t ctx, int64_t index,
                 std::vector<int32_t>& window) {
  fill_window(model.config(), ids, ctx, index, window);
}

void fill_window(const ModelConfig& config, std::span<const int32_t> ids, int64_t ctx,
                 int64_t index, std::vector<int32_t>& window) {
  window.resize(static_cast<size_t>(ctx));
  window[0] = static_cast<int32_t>(config.bos_token_id);
  std::copy_n(ids.begin() + index * (ctx - 1), ctx - 1, window.begin() + 1);
}

double token_nll(std::span<const float> logits, int32_t target) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(static_cast<double>(logit) - max_logit);
  return std::log(sum) + max_logit - static_cast<double>(logits[target]);
}

PerplexityResult evaluate_perplexity(const Model& model, std::span<const int32_t> ids,
                                     const PerplexityOptions& options) {
  const auto runner = make_cpu_runner(model);
  PerplexityOptions cpu = options;
  cpu.windows_per_step = 1;  // one window fills the cores
  return evaluate_perplexity(*runner, ids, cpu);
}

PerplexityResult evaluate_perplexity(Runner& runner, std::span<const int32_t> ids,
                                     const PerplexityOptions& options) {
  const ModelConfig& config = runner.config();
  const int64_t ctx = options.ctx;
  const int64_t windows = count_windows(config, ids.size(), ctx, options.max_windows);
  if (options.chunk_tokens < 0 || options.max_sequences < 1) {
    throw InvalidArgument("perplexity: chunk_tokens " + std::to_string(options.chunk_tokens) +
                          " and max_sequences " + std::to_string(options.max_sequences) +
                          ", expected >= 0 and >= 1");
  }
  const int64_t chunk = options.chunk_tokens > 0 ? std::min(options.chunk_tokens, ctx) : ctx;
  const int64_t segment = ctx - 1;
  const int64_t vocab = config.vocab_size;
  const int64_t per_step =
      std::clamp<int64_t>(options.windows_per_step > 0
                              ? options.windows_per_step
                              : std::min(options.max_batch_tokens / chunk, options.max_sequences),
                          1, windows);
  auto pool = runner.make_pool(options.cache, per_step * PagePool::pages_for_tokens(ctx));
  std::vector<std::vector<int32_t>> batch_windows(static_cast<size_t>(per_step));
  std::vector<SequenceId> sequences(static_cast<size_t>(per_step));
  std::vector<float> logits(static_cast<size_t>(per_step * chunk * vocab));
  PerplexityResult result;
  for (int64_t first = 0; first < windows; first += per_step) {
    const int64_t count = std::min(per_step, windows - first);
    for (int64_t b = 0; b < count; ++b) {
      fill_window(config, ids, ctx, first + b, batch_windows[b]);
      sequences[b] = pool->add_sequence();
      pool->reserve(sequences[b], ctx);
    }
    // Each window's tokens [begin, begin + len) a step; position i's logits score token i + 1.
    for (int64_t begin = 0; begin < ctx; begin += chunk) {
      const int64_t len = std::min(chunk, ctx - begin);
      StepBatch batch;
      for (int64_t b = 0; b < count; ++b) {
        batch.chunks.push_back({sequences[b],
                                std::span<const int32_t>(batch_windows[b])
                                    .subspan(static_cast<size_t>(begin), static_cast<size_t>(len)),
                                LogitRows::kAll,
                                {}});
      }
      const std::span<float> step_logits(logits.data(), static_cast<size_t>(count * len * vocab));
      runner.step(batch, *pool, {step_logits, {}});
      for (int64_t b = 0; b < count; ++b) {
        for (int64_t i = begin; i < std::min(begin + len, segment); ++i) {
          result.total_nll +=
              token_nll(step_logits.subspan(static_cast<size_t>((b * len + i - begin) * vocab),
                                            static_cast<size_t>(vocab)),
                        batch_windows[b][i + 1]);
        }
      }
    }
    for (int64_t b = 0; b < count; ++b) {
      result.tokens += segment;
      ++result.windows;
      pool->remove_sequence(sequences[b]);
    }
    if (options.progress) options.progress(first + count, windows);
  }
  result.ppl = std::exp(result.total_nll / static_cast<double>(result.tokens));
  return result;
}

}  // namespace quantmla
