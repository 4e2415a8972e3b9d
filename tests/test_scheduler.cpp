// The scheduler's invariants under random request mixes, driven by a scripted fake runner whose
// next token depends only on the sequence's tokens (so preemption by recompute must not change any
// output), and on the real CPU runner with the bundled model: preempted requests give exactly the
// tokens they give unpreempted. Random tests print their seed (QUANTMLA_TEST_SEED=S repeats one).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "error_matchers.h"
#include "model_fixtures.h"
#include "quantmla/engine.h"
#include "quantmla/error.h"
#include "quantmla/page_pool.h"
#include "quantmla/runner.h"
#include "quantmla/scheduler.h"
#include "quantmla/serve_bench.h"
#include "test_seed.h"

namespace quantmla {
namespace {

using testing::error_message;
using testing::expect_contains;

// A runner without a model: the token after a sequence is a hash of all its tokens, and every step
// checks that no page belongs to two live sequences and that the pool's used pages are exactly
// the live sequences' pages.
class FakeRunner final : public Runner {
 public:
  FakeRunner() {
    config_.vocab_size = 97;
    config_.max_position_embeddings = 4096;
    config_.eos_token_id = 3;
    config_.num_layers = 1;
    config_.kv_lora_rank = 8;
    config_.qk_rope_head_dim = 8;
  }
  const ModelConfig& config() const override { return config_; }
  std::string device() const override { return "fake"; }
  std::unique_ptr<PagePool> make_pool(const CacheFormat& format, int64_t num_pages) override {
    return PagePool::on_host({1, 8, 8}, format, num_pages);
  }
  void step(const StepBatch& batch, PagePool& pool, const StepOutputs& outputs) override {
    check_step(batch, pool, config_, outputs);
    ++steps;
    StepShape shape;
    for (const SequenceChunk& chunk : batch.chunks) {
      shape.decode = shape.decode && chunk.tokens.size() == 1;
      shape.tokens += static_cast<int64_t>(chunk.tokens.size());
      shape.widest = std::max<int64_t>(shape.widest, pool.block_table(chunk.sequence).size());
    }
    shape.chunks = static_cast<int64_t>(batch.chunks.size());
    shapes.push_back(shape);
    size_t row = 0;
    for (const SequenceChunk& chunk : batch.chunks) {
      // The "cache" is the tokens themselves, one a record, so that whatever moves the records (a
      // swap) moves what the next tokens depend on.
      sequences.insert(chunk.sequence);
      const int64_t start = pool.length(chunk.sequence);
      for (size_t i = 0; i < chunk.tokens.size(); ++i) {
        std::memcpy(pool.record(0, chunk.sequence, start + static_cast<int64_t>(i)),
                    &chunk.tokens[i], sizeof(int32_t));
      }
      const int64_t length = start + static_cast<int64_t>(chunk.tokens.size());
      pool.set_length(chunk.sequence, length);
      if (chunk.logits == LogitRows::kLast && !outputs.tokens.empty()) {
        uint64_t h = 1469598103934665603ull;
        for (int64_t pos = 0; pos < length; ++pos) {
          int32_t t = 0;
          std::memcpy(&t, pool.record(0, chunk.sequence, pos), sizeof(int32_t));
          h = (h ^ static_cast<uint64_t>(t)) * 1099511628211ull;
        }
        outputs.tokens[row] = static_cast<int32_t>(h % static_cast<uint64_t>(config_.vocab_size));
      }
      if (chunk.logits != LogitRows::kNone) ++row;
    }
    check_pages(pool);
  }
  // A device time that names its step, so that a figure summed from the wrong steps shows.
  StepStats last_step_stats() const override {
    StepStats stats;
    stats.device_ms = 0.001 * static_cast<double>(steps);
    return stats;
  }

  void check_pages(const PagePool& pool) {
    std::set<int32_t> owned;
    int64_t total = 0;
    for (const SequenceId sequence : sequences) {
      if (!pool.has_sequence(sequence)) continue;
      for (int32_t page : pool.block_table(sequence)) {
        if (!owned.insert(page).second) ++pages_owned_twice;
        ++total;
      }
    }
    // Sequences admitted but not yet run hold pages too: the pool may use more, never fewer.
    if (total > pool.used_pages()) ++pages_owned_twice;
  }

  ModelConfig config_;
  std::set<SequenceId> sequences;  // every sequence a step ran
  int64_t steps = 0;
  struct StepShape {
    bool decode = true;  // every chunk one token
    int64_t chunks = 0, tokens = 0;
    int64_t widest = 0;  // the longest block table among the chunks' sequences
  };
  std::vector<StepShape> shapes;
  int64_t pages_owned_twice = 0;
};

struct Mix {
  std::vector<Request> requests;
  std::vector<int> cancel_at_step;  // -1: never cancelled
};

Mix random_mix(std::mt19937_64& rng, int count, int vocab) {
  Mix mix;
  for (int i = 0; i < count; ++i) {
    Request r;
    const int len = std::uniform_int_distribution<int>(1, 300)(rng);
    for (int t = 0; t < len; ++t)
      r.prompt.push_back(std::uniform_int_distribution<int>(4, vocab - 1)(rng));
    r.max_tokens = std::uniform_int_distribution<int>(1, 120)(rng);
    r.ignore_eos = rng() % 3 == 0;
    if (rng() % 4 == 0) r.stop_token_ids = {static_cast<int32_t>(10 + rng() % 20)};
    mix.requests.push_back(r);
    mix.cancel_at_step.push_back(rng() % 10 == 0 ? static_cast<int>(rng() % 50) : -1);
  }
  return mix;
}

struct RunResult {
  std::map<RequestId, FinishedRequest> finished;
  int64_t finished_twice = 0;
  int64_t steps = 0;
  SchedulerStats stats;
  int64_t swap_left = 0;  // swap space still held at the end
};

// Runs every request of `mix` to the end, checking the step invariants on the way.
RunResult run_mix(Runner& runner, PagePool& pool, const SchedulerOptions& options, const Mix& mix,
                  bool cancel) {
  Scheduler scheduler(runner, pool, options);
  std::vector<RequestId> ids;
  for (const Request& r : mix.requests) ids.push_back(scheduler.add(r));
  RunResult result;
  int64_t budget_steps = 0;
  for (const Request& r : mix.requests) {
    budget_steps += static_cast<int64_t>(r.prompt.size()) + r.max_tokens;
  }
  budget_steps = 4 * budget_steps + 1000;  // no starvation: everything ends well before this
  while (scheduler.has_work() && result.steps < budget_steps) {
    if (cancel) {
      for (size_t i = 0; i < ids.size(); ++i) {
        if (mix.cancel_at_step[i] == result.steps) scheduler.cancel(ids[i]);
      }
    }
    const StepReport report = scheduler.step();
    ++result.steps;
    EXPECT_LE(report.tokens, options.max_batched_tokens);
    EXPECT_LE(report.sequences, options.max_seqs);
    EXPECT_LE(scheduler.num_running(), options.max_seqs);
    EXPECT_LE(scheduler.swap_used_bytes(), options.swap_space_bytes);
    for (const FinishedRequest& f : report.finished) {
      if (!result.finished.emplace(f.id, f).second) ++result.finished_twice;
    }
  }
  EXPECT_FALSE(scheduler.has_work()) << "requests still waiting after " << result.steps << " steps";
  result.stats = scheduler.stats();
  result.swap_left = scheduler.swap_used_bytes();
  return result;
}

void expect_finished_properly(const Mix& mix, const RunResult& result, int32_t eos, bool cancel) {
  EXPECT_EQ(result.finished_twice, 0);
  ASSERT_EQ(result.finished.size(), mix.requests.size());
  for (size_t i = 0; i < mix.requests.size(); ++i) {
    const Request& r = mix.requests[i];
    const FinishedRequest& f = result.finished.at(static_cast<RequestId>(i + 1));
    if (f.reason == FinishReason::kCancelled) {
      EXPECT_TRUE(cancel && mix.cancel_at_step[i] >= 0) << "request " << i << " cancelled";
      continue;
    }
    ASSERT_FALSE(f.tokens.empty()) << "request " << i;
    EXPECT_LE(static_cast<int64_t>(f.tokens.size()), r.max_tokens) << "request " << i;
    const int32_t last = f.tokens.back();
    const bool stop_token =
        (!r.ignore_eos && last == eos) ||
        std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), last) != r.stop_token_ids.end();
    if (f.reason == FinishReason::kLength) {
      EXPECT_EQ(static_cast<int64_t>(f.tokens.size()), r.max_tokens) << "request " << i;
    } else {
      EXPECT_TRUE(stop_token) << "request " << i << " stopped on " << last;
    }
    // Nothing before the last token should have stopped it.
    for (size_t t = 0; t + 1 < f.tokens.size(); ++t) {
      const int32_t token = f.tokens[t];
      EXPECT_FALSE((!r.ignore_eos && token == eos) ||
                   std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) !=
                       r.stop_token_ids.end())
          << "request " << i << " ran past a stop at " << t;
    }
  }
}

TEST(Scheduler, RandomMixesKeepEveryInvariant) {
  std::mt19937_64 rng(testing::test_seed("RandomMixesKeepEveryInvariant"));
  for (int round = 0; round < 12; ++round) {
    FakeRunner runner;
    const Mix mix = random_mix(rng, 40, static_cast<int>(runner.config().vocab_size));
    SchedulerOptions options;
    options.max_batched_tokens = std::uniform_int_distribution<int64_t>(8, 600)(rng);
    options.max_seqs = std::uniform_int_distribution<int64_t>(1, 24)(rng);
    options.watermark_pages = static_cast<int64_t>(rng() % 3);
    // A pool where every request fits alone but few fit together: preemptions happen.
    const int64_t pages = 8 + static_cast<int64_t>(rng() % 24);
    auto pool = runner.make_pool(CacheFormat::parse("bf16"), pages);
    // Preemption by recompute, by swap into room for 0-12 pages' records, or by swap alone.
    const int64_t page_records = pool->swap_bytes(kPageTokens);
    options.swap_space_bytes = round % 3 == 0   ? 0
                               : round % 3 == 1 ? page_records * static_cast<int64_t>(rng() % 13)
                                                : int64_t{1} << 30;
    const bool cancel = round % 2 == 1;
    SCOPED_TRACE("round " + std::to_string(round) + ": budget " +
                 std::to_string(options.max_batched_tokens) + ", max_seqs " +
                 std::to_string(options.max_seqs) + ", pages " + std::to_string(pages) +
                 ", swap space " + std::to_string(options.swap_space_bytes));
    const RunResult pressed = run_mix(runner, *pool, options, mix, cancel);
    expect_finished_properly(mix, pressed, static_cast<int32_t>(runner.config().eos_token_id),
                             cancel);
    EXPECT_EQ(runner.pages_owned_twice, 0);
    EXPECT_EQ(pool->used_pages(), 0) << "pages not returned";
    EXPECT_EQ(pool->num_sequences(), 0);
    EXPECT_LE(pressed.stats.swapped_in, pressed.stats.swapped_out);  // less the cancelled ones
    EXPECT_EQ(pressed.swap_left, 0) << "swap space not returned";
    if (options.swap_space_bytes == 0) EXPECT_EQ(pressed.stats.swapped_out, 0);

    // The same requests with room for all of them: no preemption, the same outputs.
    FakeRunner roomy_runner;
    auto roomy = roomy_runner.make_pool(CacheFormat::parse("bf16"), 40 * 8);
    SchedulerOptions roomy_options = options;
    roomy_options.max_seqs = 64;
    const RunResult free_run = run_mix(roomy_runner, *roomy, roomy_options, mix, false);
    EXPECT_EQ(free_run.stats.preemptions, 0);
    for (const auto& [id, f] : pressed.finished) {
      if (f.reason == FinishReason::kCancelled) continue;
      EXPECT_EQ(f.tokens, free_run.finished.at(id).tokens)
          << "request " << id << " preempted " << f.preemptions << " times";
    }
    std::printf(
        "round %d: %lld steps, %lld preemptions (%lld by swap), %lld recomputed tokens, peak "
        "%lld\n",
        round, static_cast<long long>(pressed.steps),
        static_cast<long long>(pressed.stats.preemptions),
        static_cast<long long>(pressed.stats.swapped_out),
        static_cast<long long>(pressed.stats.recomputed_tokens),
        static_cast<long long>(pressed.stats.peak_running));
  }
}

TEST(Scheduler, PreemptsUnderPressureAndAdmitsByWholePrompt) {
  FakeRunner runner;
  auto pool = runner.make_pool(CacheFormat::parse("bf16"), 6);  // 384 tokens
  SchedulerOptions options;
  options.max_batched_tokens = 64;
  options.watermark_pages = 0;
  Scheduler scheduler(runner, *pool, options);
  Request r;
  r.prompt.assign(100, 5);
  r.max_tokens = 150;  // 250 tokens: two fit by prompt (2 pages each), not by length
  r.ignore_eos = true;
  scheduler.add(r);
  scheduler.add(r);
  Request big;
  big.prompt.assign(300, 6);  // 5 pages: waits until the pool is nearly empty
  big.max_tokens = 10;
  big.ignore_eos = true;
  scheduler.add(big);
  int64_t steps = 0;
  std::vector<FinishedRequest> done;
  while (scheduler.has_work() && steps < 10000) {
    const StepReport report = scheduler.step();
    ++steps;
    // The big request is never admitted on its first chunk alone.
    EXPECT_LE(pool->used_pages(), pool->num_pages());
    done.insert(done.end(), report.finished.begin(), report.finished.end());
  }
  ASSERT_EQ(done.size(), 3u);
  EXPECT_GT(scheduler.stats().preemptions, 0);
  EXPECT_GT(scheduler.stats().recomputed_tokens, 0);
  for (const FinishedRequest& f : done) EXPECT_EQ(f.reason, FinishReason::kLength);
  EXPECT_EQ(pool->used_pages(), 0);
}

TEST(Scheduler, RefusesRequestsThatCanNeverRun) {
  FakeRunner runner;
  auto pool = runner.make_pool(CacheFormat::parse("bf16"), 4);
  Scheduler scheduler(runner, *pool, {});
  Request ok;
  ok.prompt = {5, 6};
  Request r = ok;
  r.prompt.clear();
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(r); }), {"empty prompt"});
  r = ok;
  r.max_tokens = 0;
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(r); }), {"max_tokens 0"});
  r = ok;
  r.prompt = {5, 97};
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(r); }),
                  {"prompt token 1 is 97", "[0, 97)"});
  r = ok;
  r.max_tokens = 300;  // 302 tokens: 5 pages, the pool has 4
  expect_contains(error_message<CapacityError>([&] { scheduler.add(r); }),
                  {"needs 5 pages", "holds 4"});
  r = ok;
  r.max_tokens = 5000;
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(r); }),
                  {"4096 positions", "max_position_embeddings"});
  r = ok;
  r.stop = {"x"};
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(r); }), {"detokenizer"});
  r = ok;
  r.sampling.top_p = 0.0f;
  EXPECT_THROW(scheduler.add(r), InvalidArgument);
  EXPECT_FALSE(scheduler.has_work()) << "a refused request was queued";
  EXPECT_FALSE(scheduler.cancel(12345));
}

// --max-model-len: requests reach at most that many positions; the model's is the ceiling.
TEST(Scheduler, MaxModelLenCapsRequests) {
  FakeRunner runner;
  auto pool = runner.make_pool(CacheFormat::parse("bf16"), 16);
  SchedulerOptions options;
  options.max_model_len = 100;
  Scheduler scheduler(runner, *pool, options);
  Request r;
  r.prompt = {5, 6};
  r.max_tokens = 98;
  EXPECT_NO_THROW(scheduler.add(r));
  r.max_tokens = 99;
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(r); }),
                  {"max_tokens 99", "100 positions", "--max-model-len"});
  EXPECT_EQ(effective_max_model_len(options, runner.config()), 100);
  EXPECT_EQ(effective_max_model_len({}, runner.config()), 4096);
  for (const int64_t bad : {int64_t{-1}, int64_t{4097}}) {
    options.max_model_len = bad;
    expect_contains(
        error_message<InvalidArgument>([&] { Scheduler refused(runner, *pool, options); }),
        {"max_model_len " + std::to_string(bad), "4096 positions"});
  }
}

TEST(Scheduler, StopStringsAndCancellation) {
  FakeRunner runner;
  auto pool = runner.make_pool(CacheFormat::parse("bf16"), 16);
  // Token t reads as the letter 'a' + t % 26.
  Scheduler scheduler(runner, *pool, {}, [](std::span<const int32_t> tokens) {
    std::string text;
    for (int32_t t : tokens) text += static_cast<char>('a' + t % 26);
    return text;
  });
  Request r;
  r.prompt = {7, 8, 9};
  r.max_tokens = 200;
  r.ignore_eos = true;
  const RequestId free_id = scheduler.add(r);
  std::vector<FinishedRequest> done;
  while (scheduler.has_work()) {
    const StepReport report = scheduler.step();
    done.insert(done.end(), report.finished.begin(), report.finished.end());
  }
  ASSERT_EQ(done.size(), 1u);
  // Stop at the two letters that end the tokens' 10th and 11th outputs.
  const std::vector<int32_t> unstopped = done[0].tokens;
  ASSERT_GE(unstopped.size(), 12u);
  std::string stop;
  stop += static_cast<char>('a' + unstopped[9] % 26);
  stop += static_cast<char>('a' + unstopped[10] % 26);
  r.stop = {stop};
  const RequestId stopped_id = scheduler.add(r);
  const RequestId cancelled_id = scheduler.add(r);
  EXPECT_TRUE(scheduler.cancel(cancelled_id));
  EXPECT_FALSE(scheduler.cancel(cancelled_id));
  done.clear();
  while (scheduler.has_work()) {
    const StepReport report = scheduler.step();
    done.insert(done.end(), report.finished.begin(), report.finished.end());
  }
  ASSERT_EQ(done.size(), 2u);
  for (const FinishedRequest& f : done) {
    if (f.id == cancelled_id) {
      EXPECT_EQ(f.reason, FinishReason::kCancelled);
    } else {
      EXPECT_EQ(f.id, stopped_id);
      EXPECT_EQ(f.reason, FinishReason::kStop);
      EXPECT_LE(f.tokens.size(), 11u);  // at the first occurrence, which may come earlier
      const std::vector<int32_t> prefix(unstopped.begin(),
                                        unstopped.begin() + static_cast<long>(f.tokens.size()));
      EXPECT_EQ(f.tokens, prefix);
    }
  }
  EXPECT_NE(free_id, stopped_id);
  EXPECT_EQ(pool->used_pages(), 0);
}

// The real engine: greedy requests squeezed into a pool that forces preemptions produce exactly
// the tokens they produce in a pool that holds them all. (Exactly up to floating point: a
// recomputed row comes from a prefill GEMM where it first came from a decode GEMV, so the exact
// cache keeps the difference at rounding level; a quantized cache can flip a code on it, and a
// sampled token can flip where its draw falls on a boundary.)
// Greedy outputs under preemption are those of a roomy pool, whether the victims are recomputed,
// swapped to host memory and back (a swap space that holds them all: nothing is recomputed), or
// recomputed because the swap space is too small for them (one page's records: every victim here
// has computed more than 64 tokens).
TEST(Scheduler, PreemptedRequestsMatchUnpreemptedOnTheCpuRunner) {
  const Model& model = testing::mla_tiny();
  const auto runner = make_cpu_runner(model);
  std::mt19937_64 rng(20261201);
  std::vector<Request> requests;
  for (int i = 0; i < 6; ++i) {
    Request r;
    r.prompt.push_back(static_cast<int32_t>(model.config().bos_token_id));
    const int len = 40 + 17 * i;
    for (int t = 0; t < len; ++t) r.prompt.push_back(static_cast<int32_t>(4 + rng() % 4000));
    r.max_tokens = 60;
    r.ignore_eos = true;
    requests.push_back(r);
  }
  const int64_t page_records = runner->make_pool(CacheFormat::f32(), 1)->swap_bytes(kPageTokens);
  struct Run {
    int64_t pages, swap_space;
  };
  const std::vector<Run> runs = {{40, 0}, {5, 0}, {5, int64_t{1} << 30}, {5, page_records}};
  std::vector<std::vector<int32_t>> roomy;
  for (const Run& run : runs) {
    auto pool = runner->make_pool(CacheFormat::f32(), run.pages);
    SchedulerOptions options;
    options.max_batched_tokens = 96;
    options.swap_space_bytes = run.swap_space;
    Scheduler scheduler(*runner, *pool, options);
    for (const Request& r : requests) scheduler.add(r);
    std::vector<std::vector<int32_t>> tokens(requests.size());
    int64_t most_swap_seen = 0;  // between steps (the peak can fall within a step)
    while (scheduler.has_work()) {
      for (const FinishedRequest& f : scheduler.step().finished) {
        tokens[static_cast<size_t>(f.id - 1)] = f.tokens;
      }
      EXPECT_LE(scheduler.swap_used_bytes(), run.swap_space);
      most_swap_seen = std::max(most_swap_seen, scheduler.swap_used_bytes());
    }
    const SchedulerStats& stats = scheduler.stats();
    EXPECT_GE(stats.peak_swap_bytes, most_swap_seen);
    EXPECT_LE(stats.peak_swap_bytes, run.swap_space);
    EXPECT_EQ(stats.peak_swap_bytes > 0, stats.swapped_out > 0);
    EXPECT_GE(stats.swapped_out_bytes, stats.peak_swap_bytes);
    EXPECT_EQ(stats.swapped_out_bytes > 0, stats.swapped_out > 0);
    const std::string name =
        std::to_string(run.pages) + " pages, swap space " + std::to_string(run.swap_space);
    EXPECT_EQ(pool->used_pages(), 0) << name;
    EXPECT_EQ(scheduler.swap_used_bytes(), 0) << name;
    EXPECT_EQ(stats.swapped_in, stats.swapped_out) << name;
    EXPECT_LE(stats.swapped_out, stats.preemptions) << name;
    if (run.pages == 40) {
      EXPECT_EQ(stats.preemptions, 0);
      roomy = tokens;
      continue;
    }
    EXPECT_GT(stats.preemptions, 0) << name << ": the small pool did not force a preemption";
    if (run.swap_space < 2 * page_records) {
      EXPECT_EQ(stats.swapped_out, 0) << name;
      EXPECT_GT(stats.recomputed_tokens, 0) << name;
    }
    if (run.swap_space == int64_t{1} << 30) {
      EXPECT_EQ(stats.swapped_out, stats.preemptions) << name;
      EXPECT_EQ(stats.recomputed_tokens, 0) << name;
    }
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ(tokens[i].size(), 60u) << name;
      EXPECT_EQ(tokens[i], roomy[i]) << name << ": request " << i;
    }
  }
}

// A request cancelled while its records wait in the swap space gives them back.
TEST(Scheduler, CancellingASwappedRequestFreesItsSwapSpace) {
  const Model& model = testing::mla_tiny();
  const auto runner = make_cpu_runner(model);
  auto pool = runner->make_pool(CacheFormat::f32(), 5);
  SchedulerOptions options;
  options.max_batched_tokens = 96;
  options.swap_space_bytes = int64_t{1} << 30;
  Scheduler scheduler(*runner, *pool, options);
  std::vector<RequestId> ids;
  for (int i = 0; i < 6; ++i) {
    Request r;
    r.prompt.assign(static_cast<size_t>(60 + 10 * i), 7);
    r.max_tokens = 60;
    r.ignore_eos = true;
    ids.push_back(scheduler.add(r));
  }
  while (scheduler.has_work() && scheduler.swap_used_bytes() == 0) scheduler.step();
  ASSERT_GT(scheduler.swap_used_bytes(), 0) << "no request was swapped out";
  for (const RequestId id : ids) scheduler.cancel(id);
  int64_t cancelled = 0;
  while (scheduler.has_work()) {
    for (const FinishedRequest& f : scheduler.step().finished) {
      cancelled += f.reason == FinishReason::kCancelled;
    }
  }
  EXPECT_GT(cancelled, 0);
  EXPECT_EQ(scheduler.swap_used_bytes(), 0);
  EXPECT_EQ(pool->used_pages(), 0);
  EXPECT_THROW(Scheduler(*runner, *pool, SchedulerOptions{.swap_space_bytes = -1}),
               InvalidArgument);
}

// Host storage whose copies back into the pool fail while `fail_writes` is set (a device copy
// that fails at readmission).
class FlakyStorage final : public PageStorage {
 public:
  FlakyStorage(int64_t num_layers, int64_t layer_bytes)
      : host_(make_host_page_storage(num_layers, layer_bytes)) {}
  PoolMemory memory() const override { return PoolMemory::kHost; }
  uint8_t* layer_pages(int64_t layer) override { return host_->layer_pages(layer); }
  void write_pages(int64_t num_layers, std::span<const int32_t> pages, int64_t page_bytes,
                   const uint8_t* host) override {
    if (*fail_writes) throw IoError("copy into the pool failed (test)");
    host_->write_pages(num_layers, pages, page_bytes, host);
  }
  std::shared_ptr<bool> fail_writes = std::make_shared<bool>(false);

 private:
  std::unique_ptr<PageStorage> host_;
};

// A readmission whose copy back fails: the step throws, and nothing is lost: the request stays
// queued with its swapped records, its pages go back, and the next steps finish every request
// with the outputs of a run where nothing failed.
TEST(Scheduler, AFailedSwapInLosesNothing) {
  std::vector<Request> requests;
  for (int i = 0; i < 6; ++i) {
    Request r;
    r.prompt.assign(static_cast<size_t>(60 + 10 * i), 7 + i);
    r.max_tokens = 60;
    r.ignore_eos = true;
    requests.push_back(r);
  }
  const CacheShape shape{1, 8, 8};
  const CacheFormat format = CacheFormat::parse("bf16");
  const int64_t pages = 5;
  SchedulerOptions options;
  options.max_batched_tokens = 96;
  options.swap_space_bytes = int64_t{1} << 30;
  const auto run = [&](bool fail_once) {
    FakeRunner runner;
    auto storage = std::make_unique<FlakyStorage>(
        shape.num_layers, pages * PagePool::bytes_per_page(shape, format) / shape.num_layers);
    const std::shared_ptr<bool> fail_writes = storage->fail_writes;
    PagePool pool(shape, format, pages, std::move(storage));
    Scheduler scheduler(runner, pool, options);
    for (const Request& r : requests) scheduler.add(r);
    std::vector<std::vector<int32_t>> tokens(requests.size());
    *fail_writes = fail_once;
    int64_t failures = 0, steps = 0;
    // Stranded pages would leave a request that never fits: bounded, so that it fails, not hangs.
    while (scheduler.has_work() && ++steps < 10000) {
      try {
        for (const FinishedRequest& f : scheduler.step().finished) {
          tokens[static_cast<size_t>(f.id - 1)] = f.tokens;
        }
      } catch (const IoError&) {
        ++failures;
        *fail_writes = false;
        EXPECT_GT(scheduler.num_waiting(), 0) << "the request whose copy failed left the queue";
      }
    }
    EXPECT_LT(steps, 10000) << "the requests never finished";
    EXPECT_EQ(failures, fail_once ? 1 : 0);
    EXPECT_EQ(pool.used_pages(), 0) << "pages stranded";
    EXPECT_EQ(pool.num_sequences(), 0);
    EXPECT_EQ(scheduler.swap_used_bytes(), 0);
    EXPECT_GT(scheduler.stats().swapped_in, 0);
    return tokens;
  };
  const auto clean = run(false);
  const auto failed_once = run(true);
  EXPECT_EQ(failed_once, clean);
  for (const auto& t : clean) EXPECT_EQ(t.size(), 60u);
}

// Logprobs are the log-softmax of the runner's own logits: the first generated token's against a
// prefill of the same prompt run directly.
TEST(Scheduler, LogprobsAreTheModelsLogSoftmax) {
  const Model& model = testing::mla_tiny();
  const auto runner = make_cpu_runner(model);
  const int64_t vocab = model.config().vocab_size;
  Request r;
  r.prompt = {static_cast<int32_t>(model.config().bos_token_id), 400, 500, 600, 700};
  r.max_tokens = 4;
  r.ignore_eos = true;
  r.top_logprobs = 3;
  auto pool = runner->make_pool(CacheFormat::f32(), 4);
  Scheduler scheduler(*runner, *pool, {});
  scheduler.add(r);
  std::vector<FinishedRequest> done;
  while (scheduler.has_work()) {
    for (FinishedRequest& f : scheduler.step().finished) done.push_back(std::move(f));
  }
  ASSERT_EQ(done.size(), 1u);
  const FinishedRequest& f = done[0];
  ASSERT_EQ(f.logprobs.size(), f.tokens.size());
  for (size_t i = 0; i < f.tokens.size(); ++i) {
    const TokenLogprob& lp = f.logprobs[i];
    ASSERT_EQ(lp.top.size(), 3u);
    EXPECT_EQ(lp.top[0].first, f.tokens[i]) << "greedy: the chosen token is the most likely";
    EXPECT_EQ(lp.top[0].second, lp.logprob);
    EXPECT_LE(lp.logprob, 0.0f);
    EXPECT_GE(lp.top[0].second, lp.top[1].second);
    EXPECT_GE(lp.top[1].second, lp.top[2].second);
  }
  auto direct_pool = runner->make_pool(CacheFormat::f32(), 4);
  const SequenceId seq = direct_pool->add_sequence();
  direct_pool->reserve(seq, static_cast<int64_t>(r.prompt.size()));
  std::vector<float> logits(static_cast<size_t>(vocab));
  runner->step(StepBatch{{{seq, r.prompt, LogitRows::kLast, {}}}}, *direct_pool, {logits, {}});
  double max_logit = -INFINITY, sum = 0;
  for (float v : logits) max_logit = std::max<double>(max_logit, v);
  for (float v : logits) sum += std::exp(v - max_logit);
  const double expected = logits[static_cast<size_t>(f.tokens[0])] - max_logit - std::log(sum);
  EXPECT_NEAR(f.logprobs[0].logprob, expected, 1e-5);
  Request bad = r;
  bad.top_logprobs = 21;
  EXPECT_THROW(scheduler.add(bad), InvalidArgument);
}

// A runner that passes every step to another and records how many logit rows each step computed
// and how many it returned to the caller.
class RowCountingRunner final : public Runner {
 public:
  explicit RowCountingRunner(Runner& inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_.config(); }
  std::string device() const override { return inner_.device(); }
  std::unique_ptr<PagePool> make_pool(const CacheFormat& format, int64_t num_pages) override {
    return inner_.make_pool(format, num_pages);
  }
  void step(const StepBatch& batch, PagePool& pool, const StepOutputs& outputs) override {
    rows.push_back({batch.num_logit_rows(),
                    static_cast<int64_t>(outputs.logits.size()) / config().vocab_size});
    inner_.step(batch, pool, outputs);
  }
  std::vector<std::pair<int64_t, int64_t>> rows;  // each step's (computed, returned) rows

 private:
  Runner& inner_;
};

// Only the requests that read logits on the host get their rows back from a step: beside two
// requests without logprobs, one with them brings back one row a step, and every request's tokens
// are those of the same requests run without any logprobs.
TEST(Scheduler, StepsReturnOnlyTheLogitRowsTheHostReads) {
  const Model& model = testing::mla_tiny();
  const auto cpu = make_cpu_runner(model);
  const auto run = [&](bool with_logprobs) {
    RowCountingRunner runner(*cpu);
    auto pool = runner.make_pool(CacheFormat::f32(), 8);
    Scheduler scheduler(runner, *pool, {});
    for (int i = 0; i < 3; ++i) {
      Request r;
      r.prompt = {static_cast<int32_t>(model.config().bos_token_id), 400 + i, 500, 600 + 7 * i};
      r.max_tokens = 5;
      r.ignore_eos = true;
      r.sampling = SamplerOptions{0.9f, 0.95f, static_cast<uint64_t>(11 + i)};
      if (with_logprobs && i == 1) r.top_logprobs = 2;
      scheduler.add(r);
    }
    std::vector<FinishedRequest> done(3);
    while (scheduler.has_work()) {
      for (FinishedRequest& f : scheduler.step().finished) {
        done[static_cast<size_t>(f.id - 1)] = std::move(f);
      }
    }
    return std::make_pair(std::move(done), runner.rows);
  };
  const auto [plain, plain_rows] = run(false);
  const auto [with, with_rows] = run(true);
  int64_t returned = 0;
  for (const auto& [computed, back] : plain_rows) EXPECT_EQ(back, 0) << computed;
  for (const auto& [computed, back] : with_rows) {
    EXPECT_LE(back, 1);
    EXPECT_LE(back, computed);
    returned += back;
  }
  EXPECT_EQ(returned, 5);  // one row for each of the logprobs request's 5 tokens
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(with[i].tokens, plain[i].tokens) << i;
  EXPECT_EQ(with[1].logprobs.size(), 5u);
  EXPECT_TRUE(with[0].logprobs.empty());
}

// Runs `requests` to the end on `runner` with a pool of `pages` pages: each one's tokens (by
// request order) and the preemptions.
struct CpuRun {
  std::vector<FinishedRequest> finished;
  int64_t preemptions = 0;
};
CpuRun run_on(Runner& runner, int64_t pages, const std::vector<Request>& requests) {
  auto pool = runner.make_pool(CacheFormat::f32(), pages);
  SchedulerOptions options;
  options.max_batched_tokens = 96;
  Scheduler scheduler(runner, *pool, options);
  for (const Request& r : requests) scheduler.add(r);
  CpuRun run;
  run.finished.resize(requests.size());
  while (scheduler.has_work()) {
    for (FinishedRequest& f : scheduler.step().finished) {
      run.finished[static_cast<size_t>(f.id - 1)] = std::move(f);
    }
  }
  run.preemptions = scheduler.stats().preemptions;
  EXPECT_EQ(pool->used_pages(), 0);
  return run;
}

Request tiny_request(const Model& model, std::initializer_list<int32_t> tokens,
                     int64_t max_tokens) {
  Request r;
  r.prompt.push_back(static_cast<int32_t>(model.config().bos_token_id));
  r.prompt.insert(r.prompt.end(), tokens);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  return r;
}

// A request with controls is drawn on the host from its logit rows: with controls that keep
// every token (top_k = the vocabulary) it gets exactly the runner's draws, so the host uses the
// runner's (seed, position) counter; penalties and top-k change the tokens, never by preemption.
TEST(Scheduler, ControlsAreDrawnOnTheHostWithTheRunnersDraw) {
  const Model& model = testing::mla_tiny();
  const auto runner = make_cpu_runner(model);
  std::vector<Request> plain;
  for (int i = 0; i < 4; ++i) {
    Request r = tiny_request(model, {static_cast<int32_t>(400 + i), 500, 600, 700, 800}, 40);
    for (int t = 0; t < 30 + 20 * i; ++t) r.prompt.push_back(static_cast<int32_t>(900 + 7 * t));
    r.sampling = {0.9f, 0.95f, static_cast<uint64_t>(11 + i)};
    plain.push_back(r);
  }
  std::vector<Request> keep_all = plain, penalized = plain;
  for (Request& r : keep_all) r.controls.top_k = static_cast<int32_t>(model.config().vocab_size);
  for (Request& r : penalized) {
    r.controls.top_k = 50;
    r.controls.presence_penalty = 1.5f;
    r.controls.repetition_penalty = 1.3f;
  }
  const CpuRun by_runner = run_on(*runner, 40, plain);
  const CpuRun by_host = run_on(*runner, 40, keep_all);
  const CpuRun with_penalties = run_on(*runner, 40, penalized);
  const CpuRun preempted = run_on(*runner, 3, penalized);
  EXPECT_GT(preempted.preemptions, 0) << "the small pool did not force a preemption";
  int differing = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(by_host.finished[i].tokens, by_runner.finished[i].tokens) << "request " << i;
    EXPECT_EQ(preempted.finished[i].tokens, with_penalties.finished[i].tokens) << "request " << i;
    differing += with_penalties.finished[i].tokens != by_runner.finished[i].tokens;
    // A presence penalty of 1.5 with top-k 50: fewer repeats than the plain draws.
    const std::set<int32_t> distinct(with_penalties.finished[i].tokens.begin(),
                                     with_penalties.finished[i].tokens.end());
    EXPECT_GE(distinct.size(), 30u) << "request " << i;
  }
  EXPECT_EQ(differing, 4);
}

// stop_token_ids end a request on that token; min_tokens holds it (and EOS) back until that many
// tokens are generated. A bias of +100 makes the token the greedy choice at every step.
TEST(Scheduler, MinTokensHoldStopTokensAndEosBack) {
  const Model& model = testing::mla_tiny();
  const auto runner = make_cpu_runner(model);
  const int32_t eos = static_cast<int32_t>(model.config().eos_token_id);
  const int32_t forced = 1234;
  std::vector<Request> requests;
  Request stop = tiny_request(model, {400, 500, 600}, 10);
  stop.controls.logit_bias = {{forced, 100.0f}};
  stop.stop_token_ids = {forced};
  requests.push_back(stop);
  Request held = stop;
  held.min_tokens = 4;
  requests.push_back(held);
  Request held_eos = tiny_request(model, {400, 500, 600}, 10);
  held_eos.controls.logit_bias = {{eos, 100.0f}};
  held_eos.ignore_eos = false;
  held_eos.min_tokens = 2;
  requests.push_back(held_eos);
  const CpuRun run = run_on(*runner, 40, requests);
  EXPECT_EQ(run.finished[0].tokens, std::vector<int32_t>{forced});
  EXPECT_EQ(run.finished[0].reason, FinishReason::kStop);
  ASSERT_EQ(run.finished[1].tokens.size(), 5u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NE(run.finished[1].tokens[i], forced) << "token " << i;
  EXPECT_EQ(run.finished[1].tokens[4], forced);
  EXPECT_EQ(run.finished[1].reason, FinishReason::kStop);
  ASSERT_EQ(run.finished[2].tokens.size(), 3u);
  EXPECT_NE(run.finished[2].tokens[0], eos);
  EXPECT_NE(run.finished[2].tokens[1], eos);
  EXPECT_EQ(run.finished[2].tokens[2], eos);
  EXPECT_EQ(run.finished[2].reason, FinishReason::kStop);
}

TEST(Scheduler, RefusesBadControls) {
  const Model& model = testing::mla_tiny();
  const auto runner = make_cpu_runner(model);
  auto pool = runner->make_pool(CacheFormat::f32(), 4);
  Scheduler scheduler(*runner, *pool, {});
  const Request ok = tiny_request(model, {400}, 4);
  Request r = ok;
  r.min_tokens = 5;
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(r); }),
                  {"min_tokens 5", "max_tokens, 4"});
  r = ok;
  r.stop_token_ids = {4096};
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(r); }),
                  {"stop token id 4096", "[0, 4096)"});
  r = ok;
  r.controls.logit_bias = {{-1, 1.0f}};
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(r); }), {"token -1"});
  r = ok;
  r.controls.top_k = -1;
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(r); }), {"top_k"});
  EXPECT_FALSE(scheduler.has_work());
}

// Prompt logprobs are the log-softmax of a direct prefill's rows at each next prompt token, the
// same whether the prompt runs in one chunk or several, and never twice after a preemption.
TEST(Scheduler, PromptLogprobsScoreEveryPromptTokenOnce) {
  const Model& model = testing::mla_tiny();
  const auto runner = make_cpu_runner(model);
  const int64_t vocab = model.config().vocab_size;
  Request r = tiny_request(model, {}, 30);
  for (int t = 0; t < 119; ++t) r.prompt.push_back(static_cast<int32_t>(300 + 11 * t % 3000));
  r.prompt_logprobs = 2;
  const size_t n = r.prompt.size();

  auto direct_pool = runner->make_pool(CacheFormat::f32(), 4);
  const SequenceId seq = direct_pool->add_sequence();
  direct_pool->reserve(seq, static_cast<int64_t>(n));
  std::vector<float> logits(n * static_cast<size_t>(vocab));
  runner->step(StepBatch{{{seq, r.prompt, LogitRows::kAll, {}}}}, *direct_pool, {logits, {}});

  // Three requests on a small pool with a small budget: the prompt runs in chunks, and the
  // later requests are preempted and recompute theirs.
  std::vector<Request> requests(3, r);
  requests[1].prompt_logprobs = -1;
  const CpuRun run = run_on(*runner, 5, requests);
  EXPECT_GT(run.preemptions, 0) << "the small pool did not force a preemption";
  EXPECT_TRUE(run.finished[1].prompt_logprobs.empty());
  for (const size_t k : {size_t{0}, size_t{2}}) {
    const FinishedRequest& f = run.finished[k];
    ASSERT_EQ(f.prompt_logprobs.size(), n - 1) << "request " << k;
    for (size_t p = 0; p + 1 < n; ++p) {
      const std::span<const float> row(logits.data() + p * static_cast<size_t>(vocab),
                                       static_cast<size_t>(vocab));
      double max_logit = -INFINITY, sum = 0;
      for (float v : row) max_logit = std::max<double>(max_logit, v);
      for (float v : row) sum += std::exp(v - max_logit);
      const double expected = row[static_cast<size_t>(r.prompt[p + 1])] - max_logit - std::log(sum);
      ASSERT_NEAR(f.prompt_logprobs[p].logprob, expected, 1e-4)
          << "request " << k << ", token " << p + 1;
      ASSERT_EQ(f.prompt_logprobs[p].top.size(), 2u);
      EXPECT_GE(f.prompt_logprobs[p].top[0].second, f.prompt_logprobs[p].logprob);
    }
    EXPECT_EQ(f.tokens, run.finished[1].tokens) << "scoring the prompt changed the output";
  }
  Request bad = r;
  bad.prompt_logprobs = 21;
  auto pool = runner->make_pool(CacheFormat::f32(), 4);
  Scheduler scheduler(*runner, *pool, {});
  expect_contains(error_message<InvalidArgument>([&] { scheduler.add(bad); }),
                  {"prompt_logprobs 21"});
}

// A request whose token callback throws (the server's text handling failed) ends with an error;
// the engine thread and the other requests go on.
TEST(ServingEngine, ACallbackThatThrowsEndsOnlyItsRequest) {
  const Model& model = testing::mla_tiny();
  const auto runner = make_cpu_runner(model);
  auto pool = runner->make_pool(CacheFormat::f32(), 8);
  ServingEngine engine(
      *runner, *pool, {}, [](std::span<const int32_t>) { return std::string(); }, 16);
  Request r;
  r.prompt = {static_cast<int32_t>(model.config().bos_token_id), 400, 500, 600};
  r.max_tokens = 6;
  r.ignore_eos = true;
  std::promise<FinishedRequest> failing_done, healthy_done;
  RequestCallbacks failing;
  failing.on_token = [](const StepReport::Generated&) { throw InvalidArgument("no text"); };
  failing.on_finish = [&](const FinishedRequest& f) { failing_done.set_value(f); };
  RequestCallbacks healthy;
  int healthy_tokens = 0;
  healthy.on_token = [&](const StepReport::Generated&) { ++healthy_tokens; };
  healthy.on_finish = [&](const FinishedRequest& f) { healthy_done.set_value(f); };
  engine.submit(r, std::move(failing));
  engine.submit(r, std::move(healthy));
  auto failed = failing_done.get_future(), finished = healthy_done.get_future();
  ASSERT_EQ(failed.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  ASSERT_EQ(finished.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_EQ(failed.get().reason, FinishReason::kError);
  const FinishedRequest ok = finished.get();
  EXPECT_EQ(ok.reason, FinishReason::kLength);
  EXPECT_EQ(ok.tokens.size(), 6u);
  EXPECT_EQ(healthy_tokens, 6);
  engine.shutdown(std::chrono::milliseconds(1000));
  EXPECT_EQ(pool->used_pages(), 0) << "the failed request's pages went back";
}

TEST(ServeBench, WorkloadAndFiguresAddUp) {
  FakeRunner runner;
  ServeWorkload w;
  w.num_prompts = 30;
  w.input_len = 100;
  w.output_len = 20;
  w.range_ratio = 0.5;
  w.seed = 3;
  const std::vector<Request> requests = make_workload(w, runner.config());
  ASSERT_EQ(requests.size(), 30u);
  int64_t outputs = 0;
  for (const Request& r : requests) {
    EXPECT_GE(r.prompt.size(), 50u);
    EXPECT_LE(r.prompt.size(), 150u);
    EXPECT_GE(r.max_tokens, 10);
    EXPECT_LE(r.max_tokens, 30);
    EXPECT_TRUE(r.ignore_eos);
    outputs += r.max_tokens;
  }
  EXPECT_EQ(make_workload(w, runner.config())[7].prompt, requests[7].prompt) << "not seeded";
  const CacheFormat bf16 = CacheFormat::parse("bf16");
  const int64_t page = PagePool::bytes_per_page({1, 8, 8}, bf16);
  SchedulerOptions options;
  options.max_batched_tokens = 128;
  const ServeResult result = run_serve_bench(runner, bf16, 10 * page + page / 2, requests, options);
  EXPECT_EQ(result.pages, 10);
  EXPECT_EQ(result.completed, 30);
  EXPECT_EQ(result.failed, 0);
  EXPECT_EQ(result.output_tokens, outputs);  // ignore_eos: every request runs to max_tokens
  EXPECT_LE(result.peak_seqs, 10);
  EXPECT_GT(result.output_tok_s, 0.0);
  EXPECT_LE(result.ttft_p50_ms, result.ttft_p99_ms);
  EXPECT_EQ(result.decode_steps + result.prefill_steps, result.steps);
  EXPECT_GT(result.prefill_steps, 0);
  EXPECT_LE(result.decode_steps_s + result.prefill_steps_s, result.wall_s);
  // The step log's generated tokens add up to the outputs, its pages stay within the pool, and
  // the queued part (steps up to the last that left a request waiting) is a proper prefix: 30
  // requests wait for 10 pages at first, and the last ones to finish run with nothing waiting.
  int64_t generated = 0;
  for (const StepRecord& s : result.step_log) {
    generated += s.generated;
    EXPECT_LE(s.pages_used, result.pages);
  }
  EXPECT_EQ(generated, outputs);
  // Each step's device time is its own runner step's (the fake's: 0.001 ms times its number), and
  // the run's is their sum.
  ASSERT_EQ(runner.steps, result.steps) << "a runner step a logged step";
  double device_ms = 0;
  for (size_t i = 0; i < result.step_log.size(); ++i) {
    EXPECT_DOUBLE_EQ(result.step_log[i].device_ms, 0.001 * static_cast<double>(i + 1)) << i;
    device_ms += result.step_log[i].device_ms;
  }
  EXPECT_NEAR(result.device_s, device_ms * 1e-3, 1e-12);
  EXPECT_EQ(result.step_log.back().pages_used, 0) << "every page back at the end";
  EXPECT_EQ(result.step_log.back().waiting, 0);
  ASSERT_GT(result.queued_steps, 0);
  ASSERT_LT(result.queued_steps, result.steps);
  EXPECT_GT(result.step_log[static_cast<size_t>(result.queued_steps - 1)].waiting, 0);
  for (size_t i = static_cast<size_t>(result.queued_steps); i < result.step_log.size(); ++i) {
    EXPECT_EQ(result.step_log[i].waiting, 0) << "step " << i;
  }
  EXPECT_GT(result.queued_output_tokens, 0);
  EXPECT_LT(result.queued_output_tokens, outputs);
  EXPECT_GT(result.queued_s, 0.0);
  EXPECT_LT(result.queued_s, result.wall_s);
  EXPECT_DOUBLE_EQ(result.queued_output_tok_s,
                   static_cast<double>(result.queued_output_tokens) / result.queued_s);
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(static_cast<int64_t>(result.outputs[i].size()), requests[i].max_tokens);
  }
  EXPECT_THROW(run_serve_bench(runner, bf16, page - 1, requests, options), InvalidArgument);
  w.range_ratio = 1.0;
  EXPECT_THROW(make_workload(w, runner.config()), InvalidArgument);
}

// The schedule-only runner (bench-serve --schedule-only) makes the scheduler take the decisions it
// takes over a runner that computes: the same steps, batches, preemptions and recomputation, and
// a step log that adds up to the run's counters.
TEST(ServeBench, ScheduleOnlyReplaysTheSchedule) {
  const uint64_t seed = testing::test_seed("ScheduleOnlyReplaysTheSchedule");
  FakeRunner runner;
  const std::unique_ptr<Runner> replay = make_schedule_only_runner(runner.config());
  EXPECT_EQ(replay->device(), "schedule-only");
  ServeWorkload w;
  w.num_prompts = 40;
  w.input_len = 120;
  w.output_len = 40;
  w.range_ratio = 0.6;
  const CacheFormat bf16 = CacheFormat::parse("bf16");
  SchedulerOptions options;
  options.max_batched_tokens = 96;
  options.max_seqs = 12;
  const int64_t bytes = 9 * PagePool::bytes_per_page({1, 8, 8}, bf16);
  // The budget preempts for most workloads; the first seed from the run's whose workload does
  // (one in a few dozen does not), so that every run replays preemptions.
  std::vector<Request> requests;
  ServeResult real;
  for (w.seed = seed; w.seed < seed + 100; ++w.seed) {
    requests = make_workload(w, runner.config());
    real = run_serve_bench(runner, bf16, bytes, requests, options);
    if (real.preemptions > 0) break;
  }
  ASSERT_GT(real.preemptions, 0) << "no workload of seeds " << seed << " to " << w.seed
                                 << " preempts under the budget";
  std::printf("workload seed %llu\n", static_cast<unsigned long long>(w.seed));
  const ServeResult planned = run_serve_bench(*replay, bf16, bytes, requests, options);
  EXPECT_EQ(planned.steps, real.steps);
  EXPECT_EQ(planned.decode_steps, real.decode_steps);
  EXPECT_EQ(planned.preemptions, real.preemptions);
  EXPECT_EQ(planned.recomputed_tokens, real.recomputed_tokens);
  EXPECT_EQ(planned.peak_seqs, real.peak_seqs);
  EXPECT_DOUBLE_EQ(planned.mean_batch, real.mean_batch);
  EXPECT_EQ(planned.completed, 40);
  ASSERT_EQ(planned.step_log.size(), real.step_log.size());
  int64_t decodes = 0, prefill = 0, context = 0;
  for (size_t i = 0; i < planned.step_log.size(); ++i) {
    const StepRecord& p = planned.step_log[i];
    const StepRecord& r = real.step_log[i];
    EXPECT_EQ(std::make_tuple(p.decodes, p.decode_context, p.prefill_tokens, p.generated,
                              p.pages_used, p.waiting),
              std::make_tuple(r.decodes, r.decode_context, r.prefill_tokens, r.generated,
                              r.pages_used, r.waiting))
        << "step " << i;
    EXPECT_LE(p.decodes + p.prefill_tokens, options.max_batched_tokens);
    // The shortest prompt is 48 tokens (floor(120 x (1 - 0.6))); a decode also attends the token
    // it decodes.
    EXPECT_GE(p.decode_context, p.decodes * 49) << "each decode attends its prompt and more";
    decodes += p.decodes;
    prefill += p.prefill_tokens;
    context += p.decode_context;
  }
  // Every token a request holds is computed once, but its last sampled one (never fed back), and
  // again for each recomputation: prefill and decode tokens add up to exactly that. (A one-token
  // segment that ends the known tokens is a decode to the step log, as the runner computes it,
  // also where it is the last of a prompt's or a recomputation's chunks: so the prefill tokens
  // alone can fall short of the prompts and the recomputed tokens.)
  EXPECT_EQ(prefill + decodes, planned.prompt_tokens + planned.output_tokens -
                                   static_cast<int64_t>(requests.size()) +
                                   planned.recomputed_tokens);
  EXPECT_GT(context, 0);
  // With a swap space that holds every victim: the same preemptions, none recomputed, and the
  // replay (whose pools copy nothing) takes the real run's schedule too.
  SchedulerOptions swapping = options;
  swapping.swap_space_bytes = int64_t{1} << 30;
  const ServeResult swapped = run_serve_bench(runner, bf16, bytes, requests, swapping);
  const ServeResult swap_plan = run_serve_bench(*replay, bf16, bytes, requests, swapping);
  EXPECT_GT(swapped.preemptions, 0);
  EXPECT_EQ(swapped.swapped_out, swapped.preemptions);
  EXPECT_EQ(swapped.recomputed_tokens, 0);
  EXPECT_EQ(swapped.outputs, real.outputs);
  EXPECT_EQ(std::make_tuple(swap_plan.steps, swap_plan.preemptions, swap_plan.swapped_out),
            std::make_tuple(swapped.steps, swapped.preemptions, swapped.swapped_out));
  // Step by step the same copies, and every byte copied out comes back once (nothing cancelled).
  ASSERT_EQ(swap_plan.step_log.size(), swapped.step_log.size());
  int64_t copied = 0;
  for (size_t i = 0; i < swapped.step_log.size(); ++i) {
    EXPECT_EQ(swap_plan.step_log[i].swap_bytes, swapped.step_log[i].swap_bytes) << "step " << i;
    copied += swapped.step_log[i].swap_bytes;
  }
  EXPECT_GT(swapped.swapped_out_bytes, 0);
  EXPECT_EQ(copied, 2 * swapped.swapped_out_bytes);
  // A warm-up pass runs the same requests on the same pool first, untimed: the timed run then
  // takes the same schedule, and its pool was left empty by the warm-up.
  const int64_t steps_before = runner.steps;
  const ServeResult warmed =
      run_serve_bench(runner, bf16, bytes, requests, options, {}, ServeWarmup::kFull);
  EXPECT_EQ(runner.steps - steps_before, 2 * real.steps);
  EXPECT_EQ(warmed.steps, real.steps);
  EXPECT_EQ(warmed.preemptions, real.preemptions);
  EXPECT_EQ(warmed.outputs, real.outputs);
  // Its pools hold no records, so their bytes cost nothing and a record cannot be read.
  auto pool = replay->make_pool(bf16, int64_t{1} << 20);
  EXPECT_EQ(pool->memory(), PoolMemory::kNone);
  const SequenceId sequence = pool->add_sequence();
  pool->reserve(sequence, 64);
  EXPECT_THROW(pool->record(0, sequence, 0), InvalidArgument);
  auto host_pool = runner.make_pool(bf16, 4);
  const SequenceId host_sequence = host_pool->add_sequence();
  host_pool->reserve(host_sequence, 1);
  const std::vector<int32_t> token = {5};
  expect_contains(error_message<InvalidArgument>([&] {
                    replay->step({{{host_sequence, token, LogitRows::kLast, {}}}}, *host_pool, {});
                  }),
                  {"another runner"});
}

// The shape warm-up meets every decode batch size twice at each block-table width class and a
// prefill chunk of each power of two of tokens, and leaves the pool as it found it.
TEST(ServeBench, ShapeWarmUpMeetsEveryDecodeBatchAndWidth) {
  FakeRunner runner;
  const CacheFormat bf16 = CacheFormat::parse("bf16");
  auto pool = runner.make_pool(bf16, 200);
  SchedulerOptions options;
  options.max_seqs = 12;
  options.max_batched_tokens = 2048;
  warm_up_shapes(runner, *pool, options, 3000);  // 47 pages: widths 1, 32 and 47
  EXPECT_EQ(pool->used_pages(), 0);
  EXPECT_EQ(pool->num_sequences(), 0);
  EXPECT_EQ(runner.pages_owned_twice, 0);
  std::map<std::pair<int64_t, int64_t>, int> decodes;  // (batch, widest) -> steps
  std::set<int64_t> prefill_chunks;
  for (const auto& shape : runner.shapes) {
    if (shape.decode) {
      ++decodes[{shape.chunks, shape.widest}];
    } else if (shape.chunks == 1) {
      prefill_chunks.insert(shape.tokens);
    }
  }
  for (int64_t batch = 1; batch <= 12; ++batch) {
    for (const int64_t widest : {1, 32, 47}) {
      EXPECT_EQ((decodes[{batch, widest}]), 2) << "batch " << batch << ", widest " << widest;
    }
  }
  EXPECT_EQ(decodes.size(), 36u) << "no other decode shapes";
  for (const int64_t count : {512, 1024, 2048}) EXPECT_TRUE(prefill_chunks.contains(count));
  EXPECT_FALSE(prefill_chunks.contains(4096)) << "past the step budget";

  // A pool too small for the widest ramp skips it; a busy pool's sequences are left alone.
  FakeRunner small;
  auto tight = small.make_pool(bf16, 40);
  const SequenceId kept = tight->add_sequence();
  tight->reserve(kept, 64 * 5);
  warm_up_shapes(small, *tight, options, 3000);
  EXPECT_EQ(tight->used_pages(), 5);
  int64_t widest = 0;
  for (const auto& shape : small.shapes) widest = std::max(widest, shape.widest);
  EXPECT_EQ(widest, 32) << "47 pages do not fit beside the 5 in use";

  // Through run_serve_bench: the same timed schedule as without a warm-up.
  ServeWorkload w;
  w.num_prompts = 20;
  w.input_len = 200;
  w.output_len = 30;
  const std::vector<Request> requests = make_workload(w, runner.config());
  const int64_t bytes = 30 * PagePool::bytes_per_page({1, 8, 8}, bf16);
  const ServeResult cold = run_serve_bench(runner, bf16, bytes, requests, options);
  const ServeResult warm =
      run_serve_bench(runner, bf16, bytes, requests, options, {}, ServeWarmup::kShapes);
  EXPECT_EQ(warm.steps, cold.steps);
  EXPECT_EQ(warm.preemptions, cold.preemptions);
  EXPECT_EQ(warm.outputs, cold.outputs);
  EXPECT_EQ(parse_serve_warmup("shapes"), ServeWarmup::kShapes);
  expect_contains(error_message<InvalidArgument>([] { parse_serve_warmup("twice"); }),
                  {"none, shapes or full"});
}

TEST(ServeBench, ParsesByteSizes) {
  EXPECT_EQ(parse_byte_size("8GiB"), int64_t{8} << 30);
  EXPECT_EQ(parse_byte_size("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(parse_byte_size("1.5GB"), 1'500'000'000);
  EXPECT_EQ(parse_byte_size("300000"), 300000);
  for (const char* bad : {"", "GiB", "8 gigs", "-1GiB", "8GIB"}) {
    expect_contains(error_message<InvalidArgument>([&] { parse_byte_size(bad); }), {"e.g. 8GiB"});
  }
}

// vLLM's --gpu-memory-utilization: the fraction of the whole device, less what it already holds.
TEST(ServeBench, GpuMemoryUtilizationLeavesTheRestOfTheFraction) {
  const int64_t gib = int64_t{1} << 30;
  EXPECT_EQ(utilization_budget_bytes(0.9, 70 * gib, 100 * gib), 60 * gib);
  EXPECT_EQ(utilization_budget_bytes(1.0, 70 * gib, 100 * gib), 70 * gib);
  expect_contains(
      error_message<InvalidArgument>([&] { utilization_budget_bytes(0.25, 70 * gib, 100 * gib); }),
      {"--gpu-memory-utilization", "25.00 GiB of the device's 100.00 GiB", "already take 30.00 GiB",
       "--cache-memory"});
  for (const double bad : {0.0, -0.5, 1.5}) {
    expect_contains(
        error_message<InvalidArgument>([&] { utilization_budget_bytes(bad, 70 * gib, 100 * gib); }),
        {"expected a fraction in (0, 1]"});
  }
}

}  // namespace
}  // namespace quantmla
