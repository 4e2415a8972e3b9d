// The scheduler: FCFS admission by whole prompt, decodes first, chunked prefill in the rest of the
// token budget, preemption of the most recently admitted request by swap (while the swap space
// holds it) or recompute.
#include "quantmla/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <utility>

#include "quantmla/error.h"

namespace quantmla {
namespace {

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string str(int64_t v) { return std::to_string(v); }

// log-softmax of one logits row at `token`, and the `top` most likely tokens (ties: lower id).
TokenLogprob token_logprob(std::span<const float> logits, int32_t token, int top) {
  double max_logit = -INFINITY;
  for (float v : logits) max_logit = std::max<double>(max_logit, v);
  double sum = 0.0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - max_logit);
  const double log_z = max_logit + std::log(sum);
  TokenLogprob out;
  out.logprob = static_cast<float>(logits[static_cast<size_t>(token)] - log_z);
  const float own = logits[static_cast<size_t>(token)];
  out.rank = 1 + std::count_if(logits.begin(), logits.end(), [own](float v) { return v > own; });
  std::vector<int32_t> ids(logits.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  const size_t k = std::min(static_cast<size_t>(top), ids.size());
  std::partial_sort(
      ids.begin(), ids.begin() + static_cast<long>(k), ids.end(), [&](int32_t a, int32_t b) {
        return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] ||
               (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
      });
  for (size_t i = 0; i < k; ++i) {
    out.top.emplace_back(ids[i], static_cast<float>(logits[static_cast<size_t>(ids[i])] - log_z));
  }
  return out;
}

}  // namespace

const char* to_string(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "?";
}

struct Scheduler::Entry {
  RequestId id = 0;
  Request request;
  std::vector<int32_t> tokens;  // the prompt, then what was generated
  int64_t prompt_len = 0;
  SequenceId sequence = 0;
  bool has_sequence = false;
  int64_t computed = 0;    // tokens of `tokens` whose rows are in the pool
  int64_t high_water = 0;  // most tokens computed before a preemption (recomputation counts)
  // A preemption by swap: the records of the first swapped_tokens tokens in host memory
  // (PagePool::swap_bytes of them; the buffer stays empty over a pool without records).
  int64_t swapped_tokens = 0;
  std::unique_ptr<uint8_t[]> swapped;  // not zeroed first: the copy writes every byte
  int64_t admission = 0;
  int64_t preemptions = 0;
  int64_t scheduled_round = 0;  // the step() call that last scheduled it (Scheduler::rounds_)
  double arrival_s = 0, first_token_s = -1;

  int64_t known() const { return static_cast<int64_t>(tokens.size()); }
  int64_t generated() const { return known() - prompt_len; }
  std::vector<TokenLogprob> logprobs;         // per generated token, when asked
  std::vector<TokenLogprob> prompt_logprobs;  // per prompt token after the first, when asked

  // Whether the chunk of `count` tokens from position `first` holds the next prompt token to
  // score (a recomputation after a preemption scores nothing twice).
  bool scores_prompt(int64_t first, int64_t count) const {
    const int64_t next = static_cast<int64_t>(prompt_logprobs.size());
    return request.prompt_logprobs >= 0 && next < prompt_len - 1 && first <= next &&
           next < first + count;
  }
};

int64_t effective_max_model_len(const SchedulerOptions& options, const ModelConfig& config) {
  if (options.max_model_len < 0 || options.max_model_len > config.max_position_embeddings) {
    throw InvalidArgument("max_model_len " + str(options.max_model_len) +
                          ": expected 0 (the model's) or at most the model's " +
                          str(config.max_position_embeddings) + " positions");
  }
  return options.max_model_len > 0 ? options.max_model_len : config.max_position_embeddings;
}

Scheduler::Scheduler(Runner& runner, PagePool& pool, const SchedulerOptions& options,
                     std::function<std::string(std::span<const int32_t>)> detokenize)
    : runner_(runner),
      pool_(pool),
      options_(options),
      detokenize_(std::move(detokenize)),
      start_ns_(steady_ns()) {
  if (options.max_batched_tokens < 1 || options.max_seqs < 1 || options.watermark_pages < 0 ||
      options.swap_space_bytes < 0) {
    throw InvalidArgument("scheduler: max_batched_tokens " + str(options.max_batched_tokens) +
                          ", max_seqs " + str(options.max_seqs) + ", watermark_pages " +
                          str(options.watermark_pages) + ", swap_space_bytes " +
                          str(options.swap_space_bytes) + " (need >= 1, >= 1, >= 0, >= 0)");
  }
  effective_max_model_len(options, runner.config());  // throws for a length past the model's
}

double Scheduler::now_s() const { return static_cast<double>(steady_ns() - start_ns_) * 1e-9; }

RequestId Scheduler::add(Request request) {
  const RequestId id = next_id_;
  add(std::move(request), id);
  return id;
}

void Scheduler::add(Request request, RequestId id) {
  validate(request);
  if (id < next_id_) {
    throw InvalidArgument("request: id " + str(id) + " was handed out before (next is " +
                          str(next_id_) + ")");
  }
  next_id_ = id + 1;
  auto entry = std::make_shared<Entry>();
  entry->id = id;
  entry->prompt_len = static_cast<int64_t>(request.prompt.size());
  entry->tokens = request.prompt;
  entry->request = std::move(request);
  entry->arrival_s = now_s();
  waiting_.push_back(entry);
}

void Scheduler::validate(const Request& request) const {
  const ModelConfig& config = runner_.config();
  const int64_t prompt = static_cast<int64_t>(request.prompt.size());
  if (prompt == 0) throw InvalidArgument("request: empty prompt");
  if (request.max_tokens < 1) {
    throw InvalidArgument("request: max_tokens " + str(request.max_tokens) + " (need >= 1)");
  }
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t id = request.prompt[i];
    if (id < 0 || id >= config.vocab_size) {
      throw InvalidArgument("request: prompt token " + str(static_cast<int64_t>(i)) + " is " +
                            str(id) + ", outside the vocabulary [0, " + str(config.vocab_size) +
                            ")");
    }
  }
  const int64_t max_model_len = effective_max_model_len(options_, config);
  if (prompt + request.max_tokens > max_model_len) {
    throw InvalidArgument(
        "request: prompt of " + str(prompt) + " tokens + max_tokens " + str(request.max_tokens) +
        " exceed the " + str(max_model_len) + " positions a request may reach (" +
        (options_.max_model_len > 0 ? "--max-model-len" : "the model's max_position_embeddings") +
        ")");
  }
  check_sampler_options(request.sampling);
  check_logits_controls(request.controls, config.vocab_size);
  if (request.min_tokens < 0 || request.min_tokens > request.max_tokens) {
    throw InvalidArgument("request: min_tokens " + str(request.min_tokens) +
                          " (need 0..max_tokens, " + str(request.max_tokens) + ")");
  }
  for (const int32_t id : request.stop_token_ids) {
    if (id < 0 || id >= config.vocab_size) {
      throw InvalidArgument("request: stop token id " + str(id) +
                            " is outside the vocabulary [0, " + str(config.vocab_size) + ")");
    }
  }
  for (const auto& [name, value] :
       {std::pair<const char*, int>{"top_logprobs", request.top_logprobs},
        {"prompt_logprobs", request.prompt_logprobs}}) {
    if (value < -1 || value > kMaxTopLogprobs) {
      throw InvalidArgument(std::string("request: ") + name + " " + str(value) +
                            " (need -1 for none, or 0.." + str(kMaxTopLogprobs) + ")");
    }
  }
  if (!request.stop.empty() && !detokenize_) {
    throw InvalidArgument("request: stop strings need a scheduler with a detokenizer");
  }
  const int64_t pages = PagePool::pages_for_tokens(prompt + request.max_tokens);
  if (pages > pool_.num_pages()) {
    throw CapacityError("request: a prompt of " + str(prompt) + " tokens with max_tokens " +
                        str(request.max_tokens) + " needs " + str(pages) +
                        " pages, and the whole cache holds " + str(pool_.num_pages()));
  }
}

std::shared_ptr<Scheduler::Entry> Scheduler::find(RequestId id) const {
  for (const auto& e : running_) {
    if (e->id == id) return e;
  }
  for (const auto& e : waiting_) {
    if (e->id == id) return e;
  }
  return nullptr;
}

bool Scheduler::cancel(RequestId id) {
  const std::shared_ptr<Entry> entry = find(id);
  if (entry == nullptr) return false;
  cancelled_.push_back(finish(entry, FinishReason::kCancelled));
  return true;
}

// Pages for the whole known sequence (prompt, and what a preempted request had generated) plus
// the watermark, so that admission never admits what it cannot prefill; with nothing running the
// whole pool is the request's.
bool Scheduler::try_admit(const std::shared_ptr<Entry>& entry) {
  const int64_t watermark = running_.empty() ? 0 : options_.watermark_pages;
  const int64_t need = PagePool::pages_for_tokens(entry->known()) + watermark;
  if (pool_.free_pages() < need) return false;
  entry->sequence = pool_.add_sequence();
  entry->has_sequence = true;
  pool_.reserve(entry->sequence, entry->known());
  entry->computed = 0;
  if (entry->swapped_tokens > 0) {
    if (pool_.memory() != PoolMemory::kNone) {
      try {
        pool_.copy_in(
            entry->sequence, entry->swapped_tokens,
            {entry->swapped.get(), static_cast<size_t>(pool_.swap_bytes(entry->swapped_tokens))});
      } catch (...) {
        // The request stays first in the queue with its swapped records, and its pages go back:
        // a later step admits it again (a retry's new sequence would otherwise strand them).
        pool_.remove_sequence(entry->sequence);
        entry->has_sequence = false;
        throw;
      }
    }
    entry->computed = entry->swapped_tokens;
    step_swap_bytes_ += pool_.swap_bytes(entry->swapped_tokens);
    ++stats_.swapped_in;
    release_swap(*entry);
  }
  entry->admission = ++admissions_;
  return true;
}

void Scheduler::release_swap(Entry& entry) {
  swap_used_ -= pool_.swap_bytes(entry.swapped_tokens);
  entry.swapped_tokens = 0;
  entry.swapped.reset();
}

bool Scheduler::ensure_pages(const std::shared_ptr<Entry>& entry, int64_t tokens) {
  const int64_t held = pool_.capacity(entry->sequence) / kPageTokens;
  const int64_t need = PagePool::pages_for_tokens(tokens) - held;
  if (need > pool_.free_pages()) return false;
  if (need > 0) pool_.reserve(entry->sequence, tokens);
  return true;
}

// The pages go back at once, the generated tokens stay, and the request waits at the front of the
// queue. By swap, where the swap space has room for its computed records: they are copied to host
// memory and back at readmission, and it goes on from there. Else by recompute: it prefills
// everything again. Sampling draws depend on (seed, position) only, so either way its output is
// the one it would have produced unpreempted.
void Scheduler::preempt(const std::shared_ptr<Entry>& victim) {
  const int64_t bytes = pool_.swap_bytes(victim->computed);
  if (victim->computed > 0 && swap_used_ + bytes <= options_.swap_space_bytes) {
    if (pool_.memory() != PoolMemory::kNone) {
      victim->swapped = std::make_unique_for_overwrite<uint8_t[]>(static_cast<size_t>(bytes));
      pool_.copy_out(victim->sequence, victim->computed,
                     {victim->swapped.get(), static_cast<size_t>(bytes)});
    }
    victim->swapped_tokens = victim->computed;
    swap_used_ += bytes;
    stats_.peak_swap_bytes = std::max(stats_.peak_swap_bytes, swap_used_);
    stats_.swapped_out_bytes += bytes;
    step_swap_bytes_ += bytes;
    ++stats_.swapped_out;
  }
  pool_.remove_sequence(victim->sequence);
  victim->has_sequence = false;
  victim->high_water = std::max(victim->high_water, victim->computed);
  victim->computed = 0;
  ++victim->preemptions;
  ++stats_.preemptions;
  running_.erase(std::find(running_.begin(), running_.end(), victim));
  waiting_.push_front(victim);
}

bool Scheduler::stops(const Entry& entry, int32_t token) const {
  const Request& r = entry.request;
  if (entry.generated() < r.min_tokens) return false;
  if (!r.ignore_eos && token == runner_.config().eos_token_id) return true;
  if (std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) !=
      r.stop_token_ids.end()) {
    return true;
  }
  if (r.stop.empty()) return false;
  // A stop string that the new token completes lies in the last (its length) tokens: every
  // token is at least one byte.
  size_t longest = 0;
  for (const std::string& s : r.stop) longest = std::max(longest, s.size());
  const int64_t tail = std::min<int64_t>(entry.generated(), static_cast<int64_t>(longest) + 1);
  const std::string text =
      detokenize_(std::span<const int32_t>(entry.tokens).last(static_cast<size_t>(tail)));
  for (const std::string& s : r.stop) {
    if (!s.empty() && text.find(s) != std::string::npos) return true;
  }
  return false;
}

// Whether the entry's next token is drawn here rather than taken from the runner.
bool Scheduler::draws_on_host(const Entry& entry) const {
  return entry.request.controls.active() || entry.generated() < entry.request.min_tokens;
}

// The entry's next token from its logit row: the controls applied, EOS and the stop token ids
// excluded while min_tokens are not generated, and the runners' draw for that position.
int32_t Scheduler::draw_on_host(const Entry& entry, std::span<const float> logits) {
  const Request& r = entry.request;
  std::vector<int32_t> banned;
  if (entry.generated() < r.min_tokens) {
    banned = r.stop_token_ids;
    if (!r.ignore_eos) banned.push_back(static_cast<int32_t>(runner_.config().eos_token_id));
  }
  const std::span<const int32_t> tokens(entry.tokens);
  return draw_with_controls(
      logits, r.sampling, r.controls, tokens.first(static_cast<size_t>(entry.prompt_len)),
      tokens.subspan(static_cast<size_t>(entry.prompt_len)), banned,
      counter_uniform(r.sampling.seed, static_cast<uint64_t>(entry.known())), controlled_row_);
}

FinishedRequest Scheduler::finish(const std::shared_ptr<Entry>& entry, FinishReason reason) {
  if (entry->has_sequence) {
    pool_.remove_sequence(entry->sequence);
    entry->has_sequence = false;
  }
  release_swap(*entry);  // a swapped request cancelled while it waits
  if (auto it = std::find(running_.begin(), running_.end(), entry); it != running_.end()) {
    running_.erase(it);
  }
  if (auto it = std::find(waiting_.begin(), waiting_.end(), entry); it != waiting_.end()) {
    waiting_.erase(it);
  }
  FinishedRequest done;
  done.id = entry->id;
  done.tokens.assign(entry->tokens.begin() + entry->prompt_len, entry->tokens.end());
  done.logprobs = entry->logprobs;
  done.prompt_logprobs = entry->prompt_logprobs;
  done.reason = reason;
  done.arrival_s = entry->arrival_s;
  done.first_token_s = entry->first_token_s;
  done.finish_s = now_s();
  done.preemptions = entry->preemptions;
  return done;
}

StepReport Scheduler::step() {
  StepReport report;
  step_swap_bytes_ = 0;
  report.finished = std::move(cancelled_);
  cancelled_.clear();
  struct Scheduled {
    std::shared_ptr<Entry> entry;
    int64_t first;  // tokens [first, first + count) of entry->tokens
    int64_t count;
  };
  std::vector<Scheduled> scheduled;
  int64_t budget = options_.max_batched_tokens;
  // A mark on the entry, not a search of `scheduled`: a step over n running requests stays O(n).
  const int64_t round = ++rounds_;
  const auto is_scheduled = [&](const std::shared_ptr<Entry>& e) {
    return e->scheduled_round == round;
  };
  const auto schedule = [&](const std::shared_ptr<Entry>& e, int64_t first, int64_t count) {
    e->scheduled_round = round;
    scheduled.push_back({e, first, count});
    budget -= count;
  };
  // Running requests in admission order: first every decode (one token), then the prefills
  // still under way. Pages for a chunk are taken when it is scheduled; when none are free the
  // most recently admitted running request not yet scheduled gives its pages back (itself, if it
  // is the latest).
  for (const bool decodes : {true, false}) {
    for (size_t i = 0; i < running_.size();) {
      const std::shared_ptr<Entry> entry = running_[i];
      const int64_t remaining = entry->known() - entry->computed;
      const bool is_decode = remaining == 1 && entry->computed > 0;
      if (is_decode != decodes || is_scheduled(entry) || budget == 0 ||
          static_cast<int64_t>(scheduled.size()) >= options_.max_seqs) {
        ++i;
        continue;
      }
      const int64_t count = std::min(remaining, budget);
      bool self_preempted = false;
      while (!ensure_pages(entry, entry->computed + count)) {
        std::shared_ptr<Entry> victim;
        for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
          if (!is_scheduled(*it)) {
            victim = *it;
            break;
          }
        }
        preempt(victim);  // never null: `entry` itself is running and not scheduled
        if (victim == entry) {
          self_preempted = true;
          break;
        }
      }
      if (self_preempted) continue;  // running_[i] is now the next request
      schedule(entry, entry->computed, count);
      ++i;
    }
  }
  // Waiting requests, first come first served: no request overtakes one that does not fit.
  while (!waiting_.empty() && budget > 0 &&
         static_cast<int64_t>(scheduled.size()) < options_.max_seqs &&
         static_cast<int64_t>(running_.size()) < options_.max_seqs) {
    const std::shared_ptr<Entry> entry = waiting_.front();
    if (!try_admit(entry)) break;
    waiting_.pop_front();
    running_.push_back(entry);
    // From its first token, or after what a swap brought back.
    schedule(entry, entry->computed, std::min(entry->known() - entry->computed, budget));
  }
  stats_.peak_running = std::max<int64_t>(stats_.peak_running, running_.size());
  report.swap_bytes = step_swap_bytes_;
  if (scheduled.empty()) return report;

  StepBatch batch;
  int64_t logit_rows = 0, returned_rows = 0;
  std::vector<int64_t> first_row(scheduled.size());  // each chunk's first row of the tokens
  // And of the logits, for the chunks whose logits come back (-1: none).
  std::vector<int64_t> first_returned(scheduled.size(), -1);
  for (size_t i = 0; i < scheduled.size(); ++i) {
    const Scheduled& s = scheduled[i];
    const bool completes = s.first + s.count == s.entry->known();
    // A prefill chunk that scores prompt tokens returns a row per token (its last one, when it
    // completes the sequence's known tokens, is also the row its next token is drawn from).
    const bool scores = s.entry->scores_prompt(s.first, s.count);
    // Only the chunks whose rows the host reads bring their logits back.
    const bool returns =
        scores || (completes && (s.entry->request.top_logprobs >= 0 || draws_on_host(*s.entry)));
    batch.chunks.push_back(
        {s.entry->sequence,
         std::span<const int32_t>(s.entry->tokens)
             .subspan(static_cast<size_t>(s.first), static_cast<size_t>(s.count)),
         scores      ? LogitRows::kAll
         : completes ? LogitRows::kLast
                     : LogitRows::kNone,
         s.entry->request.sampling, returns});
    const int64_t rows = batch.chunks.back().num_logit_rows();
    first_row[i] = logit_rows;
    logit_rows += rows;
    if (returns) first_returned[i] = returned_rows, returned_rows += rows;
  }
  std::vector<int32_t> sampled(static_cast<size_t>(logit_rows));
  const int64_t vocab = runner_.config().vocab_size;
  logits_.resize(static_cast<size_t>(returned_rows * vocab));
  runner_.step(batch, pool_, {logits_, sampled});
  // Row `offset` of chunk i's logits (empty where the chunk's logits stayed on the device).
  const auto logits_row = [&](size_t i, int64_t offset) {
    return first_returned[i] < 0 ? std::span<const float>()
                                 : std::span<const float>(logits_).subspan(
                                       static_cast<size_t>((first_returned[i] + offset) * vocab),
                                       static_cast<size_t>(vocab));
  };

  ++stats_.steps;
  bool any_decode = false;
  for (size_t i = 0; i < scheduled.size(); ++i) {
    const Scheduled& s = scheduled[i];
    const std::shared_ptr<Entry>& entry = s.entry;
    const bool is_decode = s.count == 1 && s.first > 0 && s.first + 1 == entry->known();
    report.tokens += s.count;
    ++report.sequences;
    if (is_decode) {
      ++report.decodes;
      report.decode_context += s.first + 1;
      ++stats_.decode_tokens;
      any_decode = true;
    } else {
      stats_.prefill_tokens += s.count;
      stats_.recomputed_tokens +=
          std::max<int64_t>(0, std::min(entry->high_water, s.first + s.count) - s.first);
    }
    // The chunk's last row: the one its next token is drawn from.
    const int64_t last = batch.chunks[i].num_logit_rows() - 1;
    if (batch.chunks[i].logits == LogitRows::kAll) {
      // Row j predicts the token after position s.first + j: prompt token p + 1 from row p.
      for (int64_t p = s.first; p < s.first + s.count; ++p) {
        if (p == static_cast<int64_t>(entry->prompt_logprobs.size()) && p + 1 < entry->prompt_len) {
          entry->prompt_logprobs.push_back(token_logprob(logits_row(i, p - s.first),
                                                         entry->tokens[static_cast<size_t>(p + 1)],
                                                         entry->request.prompt_logprobs));
        }
      }
    }
    entry->computed = s.first + s.count;
    if (entry->computed != entry->known()) continue;
    const std::span<const float> logits = logits_row(i, last);
    const int32_t token =
        draws_on_host(*entry) ? draw_on_host(*entry, logits) : sampled[first_row[i] + last];
    entry->tokens.push_back(token);
    std::optional<TokenLogprob> logprob;
    if (entry->request.top_logprobs >= 0) {
      logprob = token_logprob(logits, token, entry->request.top_logprobs);
      entry->logprobs.push_back(*logprob);
    }
    report.generated.push_back({entry->id, token, std::move(logprob)});
    if (entry->first_token_s < 0) entry->first_token_s = now_s();
    if (stops(*entry, token)) {
      report.finished.push_back(finish(entry, FinishReason::kStop));
    } else if (entry->generated() >= entry->request.max_tokens) {
      report.finished.push_back(finish(entry, FinishReason::kLength));
    }
  }
  if (any_decode) ++stats_.decode_batches;
  return report;
}

}  // namespace quantmla
