#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "quantmla/error.h"
#include "quantmla/eval.h"

namespace quantmla {

double token_nll(std::span<const float> logits, int32_t target) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(static_cast<double>(logit) - max_logit);
  return std::log(sum) + max_logit - static_cast<double>(logits[target]);
}

PerplexityResult evaluate_perplexity(const Model& model, std::span<const int32_t> ids,
                                     const PerplexityOptions& options) {
  const ModelConfig& config = model.config();
  const int64_t ctx = options.ctx;
  if (ctx < 2) throw InvalidArgument("ctx must be at least 2, got " + std::to_string(ctx));
  if (ctx > model.max_positions()) {
    throw InvalidArgument("ctx " + std::to_string(ctx) + " exceeds the model's " +
                          std::to_string(model.max_positions()) + " positions");
  }
  const int64_t segment = ctx - 1;
  int64_t windows = static_cast<int64_t>(ids.size()) / segment;
  if (windows == 0) {
    throw InvalidArgument("text has " + std::to_string(ids.size()) +
                          " tokens, fewer than one window of " + std::to_string(segment));
  }
  if (options.max_windows > 0) windows = std::min(windows, options.max_windows);

  const int64_t vocab = config.vocab_size;
  auto cache = model.make_cache(ctx, options.cache);
  std::vector<int32_t> window(static_cast<size_t>(ctx));
  std::vector<float> logits(static_cast<size_t>(ctx * vocab));
  PerplexityResult result;
  for (int64_t w = 0; w < windows; ++w) {
    window[0] = static_cast<int32_t>(config.bos_token_id);
    std::copy_n(ids.begin() + w * segment, segment, window.begin() + 1);
    cache->set_length(0);
    model.forward(window, *cache, logits);
    for (int64_t i = 0; i < segment; ++i) {
      result.total_nll +=
          token_nll(std::span<const float>(logits.data() + i * vocab, static_cast<size_t>(vocab)),
                    window[i + 1]);
    }
    result.tokens += segment;
    ++result.windows;
    if (options.progress) options.progress(w + 1, windows);
  }
  result.ppl = std::exp(result.total_nll / static_cast<double>(result.tokens));
  return result;
}

}  // namespace quantmla
