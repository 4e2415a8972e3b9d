// Continuous batching over a page pool: requests wait in a FCFS queue, each step decodes every
// running sequence and fills the rest of a token budget with prefill chunks, requests are admitted
// only when their whole prompt fits, and a decode that finds no free page preempts the most
// recently admitted request: by swap (its records copied to host memory and back at readmission)
// while the swap space holds them, else by recompute. Backend-independent: it drives any Runner.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "quantmla/logits_controls.h"
#include "quantmla/page_pool.h"
#include "quantmla/runner.h"
#include "quantmla/sampler.h"

namespace quantmla {

using RequestId = int64_t;

// The model's log-probabilities around one generated token (log-softmax of the raw logits, before
// temperature and top-p, as OpenAI's and vLLM's logprobs).
struct TokenLogprob {
  float logprob = 0.0f;                        // of the token generated (or scored)
  int64_t rank = 1;                            // 1 + the tokens more likely than it
  std::vector<std::pair<int32_t, float>> top;  // the most likely tokens, most likely first
};
inline constexpr int kMaxTopLogprobs = 20;

struct Request {
  std::vector<int32_t> prompt;  // token ids, BOS included if the model wants one
  SamplerOptions sampling;
  // top-k, min-p, penalties, biases: a request that sets any is drawn on the host from its logit
  // rows (logits_controls.h), which the runner returns for it alone (as for logprobs)
  LogitsControls controls;
  int64_t max_tokens = 16;  // generated tokens at most (>= 1)
  // Until this many tokens are generated (<= max_tokens), EOS and the stop token ids cannot be
  // drawn (host-side, as `controls`) and no stop ends the request (vLLM's min_tokens)
  int64_t min_tokens = 0;
  std::vector<int32_t> stop_token_ids;  // finish after generating one of these (it is kept)
  std::vector<std::string> stop;        // finish once the generated text contains one of these
  bool ignore_eos = false;              // false: the model's eos_token_id stops too
  // -1: no logprobs; 0..kMaxTopLogprobs: each generated token's logprob and this many of the
  // most likely tokens (the step then returns logits rows, which costs a copy of the vocabulary)
  int top_logprobs = -1;
  // -1: none; 0..kMaxTopLogprobs: the logprob of every prompt token after the first, given the
  // ones before it, and this many of the most likely tokens there (vLLM's prompt_logprobs,
  // OpenAI's echo with logprobs: scoring a text). The prefill then returns a logits row per
  // prompt token, a copy of the vocabulary each.
  int prompt_logprobs = -1;
};

enum class FinishReason {
  kLength,     // max_tokens generated
  kStop,       // EOS, a stop token or a stop string
  kCancelled,  // cancel() before it finished
  kError,      // the engine failed while running it (ServingEngine)
};
const char* to_string(FinishReason reason);

// A request that ended, with everything it generated. Times are seconds on the scheduler's clock
// (steady, from its construction).
struct FinishedRequest {
  RequestId id = 0;
  std::vector<int32_t> tokens;         // generated, in order
  std::vector<TokenLogprob> logprobs;  // one per token when the request asked (top_logprobs >= 0)
  // prompt_logprobs >= 0: one per prompt token after the first (the first has no context)
  std::vector<TokenLogprob> prompt_logprobs;
  FinishReason reason = FinishReason::kLength;
  double arrival_s = 0, first_token_s = -1, finish_s = 0;
  int64_t preemptions = 0;  // times it was preempted (swapped or recomputed)
};

struct SchedulerOptions {
  int64_t max_batched_tokens = 2048;  // tokens one step runs (decodes + prefill chunks)
  int64_t max_seqs = 256;             // sequences one step runs
  // Pages kept free when admitting (vLLM's watermark): admission needs the whole prompt's pages
  // plus these, so that running sequences can grow a while before anyone is preempted.
  int64_t watermark_pages = 1;
  // Positions a request may reach, prompt + max_tokens (vLLM's --max-model-len): 0 for the
  // model's max_position_embeddings, else at most that.
  int64_t max_model_len = 0;
  // Host memory for the records of preempted requests (vLLM's --swap-space): a preemption copies
  // the victim's computed records there while they fit and back at its readmission, instead of
  // recomputing them; 0: preemption by recompute only.
  int64_t swap_space_bytes = 0;
};

// The positions a request may reach under `options` on a model of `config` (max_model_len, or
// the model's when 0). Throws InvalidArgument for a max_model_len below 0 or past the model's.
int64_t effective_max_model_len(const SchedulerOptions& options, const ModelConfig& config);

// Counters since construction (bench-serve, logs).
struct SchedulerStats {
  int64_t steps = 0;
  int64_t decode_tokens = 0;      // tokens run as decodes (one per running sequence per step)
  int64_t prefill_tokens = 0;     // tokens run in prefill chunks, recomputation included
  int64_t recomputed_tokens = 0;  // prefill tokens that were already computed before a preemption
  int64_t preemptions = 0;
  int64_t swapped_out = 0;        // of the preemptions, those by swap
  int64_t swapped_in = 0;         // readmissions from the swap space
  int64_t peak_running = 0;       // most sequences holding pages at once
  int64_t peak_swap_bytes = 0;    // most swap space held at once (for sizing --swap-space)
  int64_t swapped_out_bytes = 0;  // records copied to the swap space (as many come back)
  int64_t decode_batches = 0;     // steps with at least one decode (for the mean decode batch)
};

// What one step ran (tests check the budget and the invariants through it).
struct StepReport {
  int64_t tokens = 0;          // tokens of the step
  int64_t sequences = 0;       // chunks of the step
  int64_t decodes = 0;         // of them single-token decodes of running sequences
  int64_t decode_context = 0;  // keys the decodes attend over, summed over them
  int64_t swap_bytes = 0;      // records copied out by its preemptions and in by its readmissions
  std::vector<FinishedRequest> finished;  // requests that ended in this step
  // Every token generated in this step, with its request (streaming), in step order.
  struct Generated {
    RequestId id;
    int32_t token;
    std::optional<TokenLogprob> logprob;  // when the request asked
  };
  std::vector<Generated> generated;
};

class Scheduler {
 public:
  // `detokenize`: the text of generated tokens, for stop strings (may be empty when no request
  // uses them). The pool's sequences belong to the scheduler from now on.
  Scheduler(Runner& runner, PagePool& pool, const SchedulerOptions& options,
            std::function<std::string(std::span<const int32_t>)> detokenize = {});

  // Queues a request (FCFS). Throws InvalidArgument, before queuing, for an empty prompt,
  // max_tokens < 1, a token id outside the vocabulary, prompt + max_tokens beyond the model's
  // max_position_embeddings, bad sampling options or controls, min_tokens outside
  // [0, max_tokens], a stop token id outside the vocabulary, stop strings without a detokenizer,
  // and CapacityError for a request whose prompt and max_tokens could never fit in the whole pool
  // (it would wait forever).
  RequestId add(Request request);
  // The same under an id the caller chose (a front end that hands ids out before the request
  // reaches the scheduler): ids must increase from call to call, and exceed those add() gave.
  void add(Request request, RequestId id);
  // add()'s checks alone. Reads only the model's config and the pool's size, which never change,
  // so it may run on any thread while another steps the scheduler.
  void validate(const Request& request) const;
  // Ends a waiting or running request at once (its pages freed); it is reported by the next
  // step() as kCancelled. False when the id is unknown or already finished.
  bool cancel(RequestId id);

  // One step: schedule, run the runner once, sample, finish. Nothing to run: an empty report.
  StepReport step();
  bool has_work() const { return !waiting_.empty() || !running_.empty() || !cancelled_.empty(); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  const SchedulerStats& stats() const { return stats_; }
  const SchedulerOptions& options() const { return options_; }
  // Bytes of the swap space that preempted requests' records hold now.
  int64_t swap_used_bytes() const { return swap_used_; }
  double now_s() const;

 private:
  struct Entry;
  std::shared_ptr<Entry> find(RequestId id) const;
  bool try_admit(const std::shared_ptr<Entry>& entry);
  void preempt(const std::shared_ptr<Entry>& victim);
  void release_swap(Entry& entry);
  bool ensure_pages(const std::shared_ptr<Entry>& entry, int64_t tokens);
  bool stops(const Entry& entry, int32_t token) const;
  bool draws_on_host(const Entry& entry) const;
  int32_t draw_on_host(const Entry& entry, std::span<const float> logits);
  FinishedRequest finish(const std::shared_ptr<Entry>& entry, FinishReason reason);

  Runner& runner_;
  PagePool& pool_;
  SchedulerOptions options_;
  std::function<std::string(std::span<const int32_t>)> detokenize_;
  RequestId next_id_ = 1;
  int64_t admissions_ = 0;
  int64_t rounds_ = 0;  // step() calls, to mark the entries one of them scheduled
  int64_t swap_used_ = 0;
  int64_t step_swap_bytes_ = 0;  // copied out and in during the step under way
  std::deque<std::shared_ptr<Entry>> waiting_;
  std::vector<std::shared_ptr<Entry>> running_;  // in admission order
  std::vector<FinishedRequest> cancelled_;
  SchedulerStats stats_;
  int64_t start_ns_ = 0;
  // The step's returned logit rows: those of the requests with logprobs, prompt logprobs or
  // controls
  std::vector<float> logits_;
  std::vector<float> controlled_row_;  // one of them changed by a request's controls
};

}  // namespace quantmla
