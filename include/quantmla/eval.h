// Perplexity under the window protocol of shared/README.md: consecutive non-overlapping segments of
// ctx - 1 tokens (a final partial one dropped), each window [BOS] + segment, every segment token
// scored from the positions before it.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "quantmla/model.h"
#include "quantmla/runner.h"

namespace quantmla {

struct PerplexityOptions {
  int64_t ctx = 1024;
  int64_t max_windows = 0;                 // 0 = every window
  CacheFormat cache = CacheFormat::f32();  // every position attends through a cache of this format
  // Called after each window with (windows done, windows total).
  std::function<void(int64_t, int64_t)> progress;
  // Runner version: windows run side by side, this many sequences a step (0: as many as
  // max_batch_tokens holds).
  int64_t windows_per_step = 0;
  int64_t max_batch_tokens = 8192;
  // Runner version: tokens of each window a step (0: the whole window in one step, a prefill).
  // 1 runs every position as a decode step (teacher-forced), through the backend's decode path
  // rather than its prefill path; the windows then run up to max_sequences side by side.
  int64_t chunk_tokens = 0;
  int64_t max_sequences = 256;  // CudaRunnerOptions::max_sequences's default
};

struct PerplexityResult {
  double ppl = 0.0;
  double total_nll = 0.0;
  int64_t tokens = 0;  // scored tokens
  int64_t windows = 0;
};

// Throws InvalidArgument when ctx < 2, ctx exceeds the model's positions, or the ids do not fill a
// single window.
PerplexityResult evaluate_perplexity(const Model& model, std::span<const int32_t> ids,
                                     const PerplexityOptions& options);
// The same windows through a runner (any backend), several windows per step, each in its own
// sequence of a pool of options.cache.
PerplexityResult evaluate_perplexity(Runner& runner, std::span<const int32_t> ids,
                                     const PerplexityOptions& options);

// Quality of cache formats against a baseline cache on the same windows (DESIGN §7: teacher-forced,
// every position attends through the cache under test).
struct KldOptions {
  int64_t ctx = 1024;
  int64_t first_window = 0;  // windows [first_window, first_window + max_windows) are scored
  int64_t max_windows = 0;   // 0 = every window from first_window on
  CacheFormat baseline = CacheFormat::parse("bf16");  // the distribution KLD is measured against
  // The model that runs with the baseline cache; null = the model under test. Set it to the
  // untransformed model when the model under test has transforms folded in.
  const Model* baseline_model = nullptr;
  // Runner version: the baseline's runner (null: the runner under test), windows a step (0: as
  // max_batch_tokens and about 2 GiB of baseline probabilities allow).
  Runner* baseline_runner = nullptr;
  int64_t windows_per_step = 0;
  int64_t max_batch_tokens = 8192;
  std::function<void(int64_t, int64_t)> progress;  // (windows done, windows total)
};

// The raw sums a KldResult is computed from. Tallies of consecutive window ranges of the same
// format merge into the tally of their union, so one evaluation can be split across processes.
struct KldTally {
  int64_t first_window = 0;
  int64_t windows = 0;
  int64_t tokens = 0;         // scored positions
  double nll = 0.0;           // summed over scored positions, format under test
  double baseline_nll = 0.0;  // the same for the baseline
  int64_t top1_agree = 0;     // positions whose argmax equals the baseline's
  std::vector<float> klds;    // one per scored position, in window order
};

// Throws InvalidArgument unless the tallies cover consecutive window ranges (in any order).
KldTally merge_kld_tallies(std::vector<KldTally> tallies);

struct KldResult {
  CacheFormat format;
  double kld_mean = 0.0;    // mean over scored positions of KL(P_baseline || P_format), nats
  double kld_p99 = 0.0;     // 99th percentile of the same
  double top1_agree = 0.0;  // fraction of positions whose argmax equals the baseline's
  double ppl = 0.0;
  double ppl_baseline = 0.0;
  int64_t tokens = 0;
  int64_t windows = 0;
  KldTally tally;  // what the figures above were computed from
};

// The figures of a tally (throws InvalidArgument when it scored no token).
KldResult summarize_kld(const CacheFormat& format, KldTally tally);

// One result per format; the baseline runs once per window and every format is compared with it.
std::vector<KldResult> evaluate_kld(const Model& model, std::span<const int32_t> ids,
                                    const std::vector<CacheFormat>& formats,
                                    const KldOptions& options);
// The same through runners (any backend; options.baseline_runner for the baseline), several
// windows a step.
std::vector<KldResult> evaluate_kld(Runner& runner, std::span<const int32_t> ids,
                                    const std::vector<CacheFormat>& formats,
                                    const KldOptions& options);

// -log softmax(logits)[target], computed in double.
double token_nll(std::span<const float> logits, int32_t target);

}  // namespace quantmla
