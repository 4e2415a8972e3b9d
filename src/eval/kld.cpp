// KL divergence of next-token distributions between a baseline cache and cache formats under test.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "eval/windows.h"
#include "quantmla/error.h"
#include "quantmla/eval.h"

namespace quantmla {

void log_softmax(const float* logits, int64_t vocab, double* out) {
  const float max_logit = *std::max_element(logits, logits + vocab);
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(logits[v]) - max_logit);
  const double log_sum = std::log(sum) + max_logit;
  for (int64_t v = 0; v < vocab; ++v) out[v] = logits[v] - log_sum;
}

KldResult summarize_kld(const CacheFormat& format, KldTally tally) {
  if (tally.tokens == 0 || tally.klds.size() != static_cast<size_t>(tally.tokens)) {
    throw InvalidArgument("KLD tally of " + format.to_string() + ": " +
                          std::to_string(tally.klds.size()) + " KLD values for " +
                          std::to_string(tally.tokens) + " scored tokens");
  }
  const double tokens = static_cast<double>(tally.tokens);
  KldResult result;
  result.format = format;
  double sum = 0.0;
  for (float kld : tally.klds) sum += kld;
  result.kld_mean = sum / tokens;
  std::vector<float> sorted = tally.klds;
  const auto p99 =
      sorted.begin() + static_cast<int64_t>(0.99 * static_cast<double>(sorted.size() - 1));
  std::nth_element(sorted.begin(), p99, sorted.end());
  result.kld_p99 = *p99;
  result.top1_agree = static_cast<double>(tally.top1_agree) / tokens;
  result.ppl = std::exp(tally.nll / tokens);
  result.ppl_baseline = std::exp(tally.baseline_nll / tokens);
  result.tokens = tally.tokens;
  result.windows = tally.windows;
  result.tally = std::move(tally);
  return result;
}

KldTally merge_kld_tallies(std::vector<KldTally> tallies) {
  if (tallies.empty()) throw InvalidArgument("no KLD tallies to merge");
  std::sort(tallies.begin(), tallies.end(),
            [](const KldTally& a, const KldTally& b) { return a.first_window < b.first_window; });
  KldTally merged;
  merged.first_window = tallies.front().first_window;
  for (const KldTally& part : tallies) {
    const int64_t expected = merged.first_window + merged.windows;
    if (part.first_window != expected) {
      throw InvalidArgument(
          "KLD tallies do not cover consecutive windows: a part starts at window " +
          std::to_string(part.first_window) + ", expected " + std::to_string(expected));
    }
    merged.windows += part.windows;
    merged.tokens += part.tokens;
    merged.nll += part.nll;
    merged.baseline_nll += part.baseline_nll;
    merged.top1_agree += part.top1_agree;
    merged.klds.insert(merged.klds.end(), part.klds.begin(), part.klds.end());
  }
  return merged;
}

std::vector<KldResult> evaluate_kld(const Model& model, std::span<const int32_t> ids,
                                    const std::vector<CacheFormat>& formats,
                                    const KldOptions& options) {
  const int64_t ctx = options.ctx;
  const int64_t total_windows = count_windows(model, ids.size(), ctx, 0);
  if (options.first_window < 0 || options.first_window >= total_windows) {
    throw InvalidArgument("first window " + std::to_string(options.first_window) +
                          " is outside the text's " + std::to_string(total_windows) +
                          " windows of " + std::to_string(ctx));
  }
  const int64_t end_window =
      options.max_windows > 0 ? std::min(total_windows, options.first_window + options.max_windows)
                              : total_windows;
  const int64_t vocab = model.config().vocab_size;
  const int64_t scored = ctx - 1;

  const Model& baseline_model = options.baseline_model ? *options.baseline_model : model;
  // The distributions are compared token by token, over the same windows.
  if (baseline_model.config().vocab_size != vocab || baseline_model.max_positions() < ctx) {
    throw InvalidArgument("baseline model (vocabulary " +
                          std::to_string(baseline_model.config().vocab_size) + ", " +
                          std::to_string(baseline_model.max_positions()) +
                          " positions) cannot score the model's windows (vocabulary " +
                          std::to_string(vocab) + ", ctx " + std::to_string(ctx) + ")");
  }
  auto baseline_cache = baseline_model.make_cache(ctx, options.baseline);
  std::vector<std::unique_ptr<MlaCache>> caches;
  for (const CacheFormat& format : formats) caches.push_back(model.make_cache(ctx, format));

  std::vector<int32_t> window;
  std::vector<float> logits(static_cast<size_t>(ctx * vocab));
  // The baseline's log-probabilities and probabilities of every scored position of the window,
  // computed once and shared by all formats.
  std::vector<double> base_logp(static_cast<size_t>(scored * vocab));
  std::vector<double> base_p(base_logp.size());
  std::vector<double> logp(static_cast<size_t>(vocab));
  std::vector<int32_t> baseline_argmax(static_cast<size_t>(scored));
  std::vector<KldTally> tallies(formats.size());
  double baseline_nll = 0.0;

  for (int64_t w = options.first_window; w < end_window; ++w) {
    fill_window(model, ids, ctx, w, window);
    baseline_cache->set_length(0);
    baseline_model.forward(window, *baseline_cache, logits);
    for (int64_t i = 0; i < scored; ++i) {
      const float* row = logits.data() + i * vocab;
      double* row_logp = base_logp.data() + i * vocab;
      log_softmax(row, vocab, row_logp);
      for (int64_t v = 0; v < vocab; ++v) base_p[i * vocab + v] = std::exp(row_logp[v]);
      baseline_nll -= row_logp[window[i + 1]];
      baseline_argmax[i] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
    }
    for (size_t f = 0; f < formats.size(); ++f) {
      caches[f]->set_length(0);
      model.forward(window, *caches[f], logits);
      KldTally& tally = tallies[f];
      for (int64_t i = 0; i < scored; ++i) {
        const float* row = logits.data() + i * vocab;
        log_softmax(row, vocab, logp.data());
        const double* p = base_p.data() + i * vocab;
        const double* lp = base_logp.data() + i * vocab;
        double kld = 0.0;
        for (int64_t v = 0; v < vocab; ++v) kld += p[v] * (lp[v] - logp[v]);
        tally.klds.push_back(static_cast<float>(std::max(kld, 0.0)));
        tally.nll -= logp[window[i + 1]];
        tally.top1_agree += std::max_element(row, row + vocab) - row == baseline_argmax[i] ? 1 : 0;
      }
    }
    if (options.progress)
      options.progress(w + 1 - options.first_window, end_window - options.first_window);
  }

  std::vector<KldResult> results;
  for (size_t f = 0; f < formats.size(); ++f) {
    KldTally& tally = tallies[f];
    tally.first_window = options.first_window;
    tally.windows = end_window - options.first_window;
    tally.tokens = tally.windows * scored;
    tally.baseline_nll = baseline_nll;
    results.push_back(summarize_kld(formats[f], std::move(tally)));
  }
  return results;
}

}  // namespace quantmla
