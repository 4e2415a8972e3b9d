// KL divergence of next-token distributions between a baseline cache and cache formats under test.
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "eval/windows.h"
#include "quantmla/eval.h"

namespace quantmla {
namespace {

// log softmax of one row, in double.
void log_softmax(const float* logits, int64_t vocab, std::vector<double>& out) {
  out.resize(static_cast<size_t>(vocab));
  const float max_logit = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(logits[v]) - max_logit);
  const double log_sum = std::log(sum) + max_logit;
  for (int64_t v = 0; v < vocab; ++v) out[v] = logits[v] - log_sum;
}

struct Accumulator {
  std::vector<float> klds;  // one per scored position
  double nll = 0.0;
  int64_t agree = 0;
};

}  // namespace

std::vector<KldResult> evaluate_kld(const Model& model, std::span<const int32_t> ids,
                                    const std::vector<CacheFormat>& formats,
                                    const KldOptions& options) {
  const int64_t ctx = options.ctx;
  const int64_t windows = count_windows(model, ids.size(), ctx, options.max_windows);
  const int64_t vocab = model.config().vocab_size;
  const int64_t scored = ctx - 1;

  const Model& baseline_model = options.baseline_model ? *options.baseline_model : model;
  auto baseline_cache = baseline_model.make_cache(ctx, options.baseline);
  std::vector<std::unique_ptr<MlaCache>> caches;
  for (const CacheFormat& format : formats) caches.push_back(model.make_cache(ctx, format));

  std::vector<int32_t> window;
  std::vector<float> baseline_logits(static_cast<size_t>(ctx * vocab));
  std::vector<float> logits(static_cast<size_t>(ctx * vocab));
  std::vector<double> base_logp, logp;
  double baseline_nll = 0.0;
  std::vector<Accumulator> accumulators(formats.size());
  std::vector<int32_t> baseline_argmax(static_cast<size_t>(scored));

  for (int64_t w = 0; w < windows; ++w) {
    fill_window(model, ids, ctx, w, window);
    baseline_cache->set_length(0);
    baseline_model.forward(window, *baseline_cache, baseline_logits);
    for (int64_t i = 0; i < scored; ++i) {
      const float* row = baseline_logits.data() + i * vocab;
      baseline_nll +=
          token_nll(std::span<const float>(row, static_cast<size_t>(vocab)), window[i + 1]);
      baseline_argmax[i] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
    }
    for (size_t f = 0; f < formats.size(); ++f) {
      caches[f]->set_length(0);
      model.forward(window, *caches[f], logits);
      Accumulator& acc = accumulators[f];
      for (int64_t i = 0; i < scored; ++i) {
        const float* row = logits.data() + i * vocab;
        log_softmax(baseline_logits.data() + i * vocab, vocab, base_logp);
        log_softmax(row, vocab, logp);
        double kld = 0.0;
        for (int64_t v = 0; v < vocab; ++v)
          kld += std::exp(base_logp[v]) * (base_logp[v] - logp[v]);
        acc.klds.push_back(static_cast<float>(std::max(kld, 0.0)));
        acc.nll -= logp[window[i + 1]];
        acc.agree += std::max_element(row, row + vocab) - row == baseline_argmax[i] ? 1 : 0;
      }
    }
    if (options.progress) options.progress(w + 1, windows);
  }

  const int64_t tokens = windows * scored;
  std::vector<KldResult> results;
  for (size_t f = 0; f < formats.size(); ++f) {
    Accumulator& acc = accumulators[f];
    KldResult result;
    result.format = formats[f];
    double sum = 0.0;
    for (float kld : acc.klds) sum += kld;
    result.kld_mean = sum / static_cast<double>(tokens);
    const auto p99 = acc.klds.begin() + static_cast<int64_t>(0.99 * (acc.klds.size() - 1));
    std::nth_element(acc.klds.begin(), p99, acc.klds.end());
    result.kld_p99 = *p99;
    result.top1_agree = static_cast<double>(acc.agree) / static_cast<double>(tokens);
    result.ppl = std::exp(acc.nll / static_cast<double>(tokens));
    result.ppl_baseline = std::exp(baseline_nll / static_cast<double>(tokens));
    result.tokens = tokens;
    result.windows = windows;
    results.push_back(result);
  }
  return results;
}

}  // namespace quantmla
