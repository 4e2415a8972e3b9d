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
  const auto runner = make_cpu_runner(model);
  const auto baseline_runner =
      options.baseline_model != nullptr ? make_cpu_runner(*options.baseline_model) : nullptr;
  KldOptions cpu = options;
  cpu.baseline_runner = baseline_runner.get();
  cpu.windows_per_step = 1;  // one window fills the cores
  return evaluate_kld(*runner, ids, formats, cpu);
}

std::vector<KldResult> evaluate_kld(Runner& runner, std::span<const int32_t> ids,
                                    const std::vector<CacheFormat>& formats,
                                    const KldOptions& options) {
  const ModelConfig& config = runner.config();
  const int64_t ctx = options.ctx;
  const int64_t total_windows = count_windows(config, ids.size(), ctx, 0);
  if (options.first_window < 0 || options.first_window >= total_windows) {
    throw InvalidArgument("first window " + std::to_string(options.first_window) +
                          " is outside the text's " + std::to_string(total_windows) +
                          " windows of " + std::to_string(ctx));
  }
  const int64_t end_window =
      options.max_windows > 0 ? std::min(total_windows, options.first_window + options.max_windows)
                              : total_windows;
  const int64_t vocab = config.vocab_size;
  const int64_t scored = ctx - 1;

  Runner& baseline_runner = options.baseline_runner ? *options.baseline_runner : runner;
  const ModelConfig& baseline_config = baseline_runner.config();
  // The distributions are compared token by token, over the same windows.
  if (baseline_config.vocab_size != vocab || baseline_config.max_position_embeddings < ctx) {
    throw InvalidArgument("baseline model (vocabulary " +
                          std::to_string(baseline_config.vocab_size) + ", " +
                          std::to_string(baseline_config.max_position_embeddings) +
                          " positions) cannot score the model's windows (vocabulary " +
                          std::to_string(vocab) + ", ctx " + std::to_string(ctx) + ")");
  }
  // Windows a step: as the runner's token budget allows, and the baseline's log-probabilities of
  // every window of the step (doubles) within about 2 GiB.
  const int64_t per_step = std::clamp<int64_t>(
      options.windows_per_step > 0
          ? options.windows_per_step
          : std::min(options.max_batch_tokens / ctx, (int64_t{1} << 27) / (scored * vocab)),
      1, end_window - options.first_window);
  const int64_t pages = per_step * PagePool::pages_for_tokens(ctx);
  auto baseline_pool = baseline_runner.make_pool(options.baseline, pages);
  std::vector<std::unique_ptr<PagePool>> pools;
  for (const CacheFormat& format : formats) pools.push_back(runner.make_pool(format, pages));

  std::vector<std::vector<int32_t>> windows(static_cast<size_t>(per_step));
  std::vector<float> logits(static_cast<size_t>(per_step * ctx * vocab));
  // The baseline's log-probabilities and probabilities of every scored position of the step's
  // windows, computed once and shared by all formats.
  std::vector<double> base_logp(static_cast<size_t>(per_step * scored * vocab));
  std::vector<double> base_p(base_logp.size());
  std::vector<double> logp(static_cast<size_t>(vocab));
  std::vector<int32_t> baseline_argmax(static_cast<size_t>(per_step * scored));
  std::vector<KldTally> tallies(formats.size());
  double baseline_nll = 0.0;

  // Runs the step's windows through `run` on `pool`, all logits back.
  const auto run_windows = [&](Runner& run, PagePool& pool, int64_t count) {
    StepBatch batch;
    for (int64_t b = 0; b < count; ++b) {
      const SequenceId seq = pool.add_sequence();
      pool.reserve(seq, ctx);
      batch.chunks.push_back({seq, windows[b], LogitRows::kAll, {}});
    }
    run.step(batch, pool, {std::span(logits).first(static_cast<size_t>(count * ctx * vocab)), {}});
    for (const SequenceChunk& chunk : batch.chunks) pool.remove_sequence(chunk.sequence);
  };

  for (int64_t first = options.first_window; first < end_window; first += per_step) {
    const int64_t count = std::min(per_step, end_window - first);
    for (int64_t b = 0; b < count; ++b) fill_window(config, ids, ctx, first + b, windows[b]);
    run_windows(baseline_runner, *baseline_pool, count);
    for (int64_t b = 0; b < count; ++b) {
      for (int64_t i = 0; i < scored; ++i) {
        const float* row = logits.data() + (b * ctx + i) * vocab;
        const int64_t k = b * scored + i;
        double* row_logp = base_logp.data() + k * vocab;
        log_softmax(row, vocab, row_logp);
        for (int64_t v = 0; v < vocab; ++v) base_p[k * vocab + v] = std::exp(row_logp[v]);
        baseline_nll -= row_logp[windows[b][i + 1]];
        baseline_argmax[k] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      }
    }
    for (size_t f = 0; f < formats.size(); ++f) {
      run_windows(runner, *pools[f], count);
      KldTally& tally = tallies[f];
      for (int64_t b = 0; b < count; ++b) {
        for (int64_t i = 0; i < scored; ++i) {
          const float* row = logits.data() + (b * ctx + i) * vocab;
          const int64_t k = b * scored + i;
          log_softmax(row, vocab, logp.data());
          const double* p = base_p.data() + k * vocab;
          const double* lp = base_logp.data() + k * vocab;
          double kld = 0.0;
          for (int64_t v = 0; v < vocab; ++v) kld += p[v] * (lp[v] - logp[v]);
          tally.klds.push_back(static_cast<float>(std::max(kld, 0.0)));
          tally.nll -= logp[windows[b][i + 1]];
          tally.top1_agree +=
              std::max_element(row, row + vocab) - row == baseline_argmax[k] ? 1 : 0;
        }
      }
    }
    if (options.progress) {
      options.progress(first + count - options.first_window, end_window - options.first_window);
    }
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
