// The CUDA runner against transformers' logits (the GPU fixtures of
// ../shared/tools/make_gpu_fixtures.py) and against the CPU runner (any model with the production
// cache shape), on fresh ragged batches. No GoogleTest, so that it runs on the GPU machine; exits
// 77 (skipped) without a CUDA device, 1 on a failed check.
//   test_cuda_runner [--fixtures DIR] [--model DIR]... [--seed S]
// DIR of --fixtures holds mla-moe16-v2/, mla-moe16-v3/ and their NAME-reference.safetensors.
//
// Tolerances. The reference computes in FP32 on the BF16 weights; the GPU rounds every GEMM input
// (activations) and the cache rows, the absorbed queries and the attention output to BF16, a
// relative error of at most 2^-9 each. Through a few layers these add up to a few 2^-9 of the
// logits' scale: the bound is kRelTol * (1 + max |reference logit| of the row), kRelTol = 16 *
// 2^-9 = 1/32. An argmax may differ only where the reference's top-2 margin is below that bound.
// Two discontinuities are not covered by a rounding bound: a routed token whose k-th and
// (k+1)-th expert scores are within the rounding switches an expert, and a cache row within the
// rounding of an INT4/INT2 step boundary flips a code. So for MoE models at most 1% of the rows
// (kMaxRowsOverBound) may exceed the bound, and quantized caches are compared for argmax
// agreement only here; their model-level check is the perplexity within 0.1% of the CPU's
// (bench/gpu/run-runner.sh, stage ppl).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"
#include "quantmla/model.h"
#include "quantmla/runner.h"
#include "quantmla/safetensors.h"

namespace {

using namespace quantmla;
namespace fs = std::filesystem;

constexpr double kRelTol = 16.0 / 512.0;
constexpr double kMaxRowsOverBound = 0.01;
int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

int argmax(const float* row, int64_t n) {
  return static_cast<int>(std::max_element(row, row + n) - row);
}

struct Comparison {
  double max_abs = 0.0;      // largest |ours - reference|
  double worst_ratio = 0.0;  // largest |ours - reference| / bound
  int64_t rows = 0, rows_over_bound = 0, argmax_agree = 0, argmax_exempt = 0, nan = 0;
};

// ours, reference: [rows, vocab].
Comparison compare_rows(const float* ours, const float* reference, int64_t rows, int64_t vocab) {
  Comparison c;
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = ours + r * vocab;
    const float* b = reference + r * vocab;
    double scale = 0.0;
    for (int64_t v = 0; v < vocab; ++v) scale = std::max(scale, std::abs(double(b[v])));
    const double bound = kRelTol * (1.0 + scale);
    double row_ratio = 0.0;
    for (int64_t v = 0; v < vocab; ++v) {
      if (std::isnan(a[v])) {
        ++c.nan;
        continue;
      }
      const double diff = std::abs(double(a[v]) - b[v]);
      c.max_abs = std::max(c.max_abs, diff);
      row_ratio = std::max(row_ratio, diff / bound);
    }
    c.worst_ratio = std::max(c.worst_ratio, row_ratio);
    if (row_ratio > 1.0) ++c.rows_over_bound;
    const int best = argmax(b, vocab);
    float second = -INFINITY;
    for (int64_t v = 0; v < vocab; ++v) {
      if (v != best) second = std::max(second, b[v]);
    }
    if (argmax(a, vocab) == best) {
      ++c.argmax_agree;
    } else if (b[best] - second < bound) {
      ++c.argmax_exempt;
    }
    ++c.rows;
  }
  return c;
}

// How a comparison is judged: every row within the bound (dense model, exact cache), at most
// kMaxRowsOverBound of them beyond it (routing switches), or argmax agreement only (a quantized
// cache's code flips; see the top comment).
enum class Bound { kEveryRow, kMostRows, kArgmaxOnly };

void report(const std::string& what, const Comparison& c, Bound bound) {
  std::printf(
      "%-48s max|d| %.4g  worst d/bound %.3f  rows over %lld  argmax %lld/%lld (+%lld "
      "within bound)  NaN %lld\n",
      what.c_str(), c.max_abs, c.worst_ratio, static_cast<long long>(c.rows_over_bound),
      static_cast<long long>(c.argmax_agree), static_cast<long long>(c.rows),
      static_cast<long long>(c.argmax_exempt), static_cast<long long>(c.nan));
  check(c.nan == 0, what + ": NaN logits");
  if (bound == Bound::kEveryRow) check(c.worst_ratio <= 1.0, what + ": logits beyond the bound");
  if (bound == Bound::kMostRows) {
    check(c.rows_over_bound <= kMaxRowsOverBound * c.rows,
          what + ": too many rows beyond the bound");
  }
  if (bound == Bound::kArgmaxOnly) {
    // Each flipped code moves its row's logits by up to about one logit (the CPU engine's
    // DecodeStepsMatchPrefill); argmax agreement still holds away from near-ties on most rows.
    check(c.argmax_agree + c.argmax_exempt >= 0.95 * c.rows, what + ": argmax differs on >5%");
  } else {
    check(c.argmax_agree + c.argmax_exempt == c.rows, what + ": argmax differs beyond the bound");
  }
}

// Logits of sequences run as one prefill step each (kAll), all sequences in one step.
std::vector<float> prefill_all(Runner& runner, const CacheFormat& format,
                               const std::vector<std::vector<int32_t>>& seqs) {
  const int64_t vocab = runner.config().vocab_size;
  int64_t tokens = 0, pages = 0;
  for (const auto& s : seqs) {
    tokens += static_cast<int64_t>(s.size());
    pages += PagePool::pages_for_tokens(static_cast<int64_t>(s.size()));
  }
  auto pool = runner.make_pool(format, pages);
  StepBatch batch;
  for (const auto& s : seqs) {
    const SequenceId id = pool->add_sequence();
    pool->reserve(id, static_cast<int64_t>(s.size()));
    batch.chunks.push_back({id, s, LogitRows::kAll, {}});
  }
  std::vector<float> logits(static_cast<size_t>(tokens * vocab));
  runner.step(batch, *pool, {logits, {}});
  return logits;
}

// A prefill chunk of `first` tokens per sequence, then one decode step at a time for all of them
// together; the logits of every position, sequence-major ([seqs, len, vocab]).
std::vector<float> chunk_then_decode(Runner& runner, const CacheFormat& format,
                                     const std::vector<std::vector<int32_t>>& seqs, int64_t first) {
  const int64_t vocab = runner.config().vocab_size;
  const int64_t len = static_cast<int64_t>(seqs[0].size());
  const int64_t n = static_cast<int64_t>(seqs.size());
  auto pool = runner.make_pool(format, n * PagePool::pages_for_tokens(len));
  std::vector<SequenceId> ids;
  for (int64_t b = 0; b < n; ++b) {
    ids.push_back(pool->add_sequence());
    pool->reserve(ids.back(), len);
  }
  std::vector<float> out(static_cast<size_t>(n * len * vocab));
  std::vector<float> step_logits(static_cast<size_t>(n * first * vocab));
  StepBatch batch;
  for (int64_t b = 0; b < n; ++b) {
    batch.chunks.push_back({ids[b], std::span(seqs[b]).first(first), LogitRows::kAll, {}});
  }
  runner.step(batch, *pool, {step_logits, {}});
  for (int64_t b = 0; b < n; ++b) {
    std::copy_n(step_logits.begin() + b * first * vocab, first * vocab,
                out.begin() + b * len * vocab);
  }
  for (int64_t t = first; t < len; ++t) {
    StepBatch decode;
    for (int64_t b = 0; b < n; ++b) {
      decode.chunks.push_back({ids[b], std::span(seqs[b]).subspan(t, 1), LogitRows::kLast, {}});
    }
    runner.step(decode, *pool, {std::span(step_logits).first(n * vocab), {}});
    for (int64_t b = 0; b < n; ++b) {
      std::copy_n(step_logits.begin() + b * vocab, vocab, out.begin() + (b * len + t) * vocab);
    }
  }
  return out;
}

void check_fixture(const fs::path& dir, const std::string& name) {
  const fs::path model_dir = dir / name;
  const auto reference = SafetensorsFile::open(dir / (name + "-reference.safetensors"));
  const std::vector<int32_t> ids = to_i32(*reference->find("input_ids"));
  const std::vector<float> logits = to_f32(*reference->find("logits"));
  const auto cuda = make_cuda_runner(model_dir);
  const int64_t vocab = cuda->config().vocab_size;
  const int64_t len = static_cast<int64_t>(ids.size()) / 2;
  const std::vector<std::vector<int32_t>> seqs = {{ids.begin(), ids.begin() + len},
                                                  {ids.begin() + len, ids.end()}};
  const CacheFormat bf16 = CacheFormat::parse("bf16");
  const Bound moe = cuda->config().n_routed_experts > 0 ? Bound::kMostRows : Bound::kEveryRow;
  report(name + " cuda prefill (bf16 cache)",
         compare_rows(prefill_all(*cuda, bf16, seqs).data(), logits.data(), 2 * len, vocab), moe);
  report(
      name + " cuda chunk 100 + decode (bf16)",
      compare_rows(chunk_then_decode(*cuda, bf16, seqs, 100).data(), logits.data(), 2 * len, vocab),
      moe);
  {
    // 64 sequences decoding together (32 copies of the two): decode steps of 64 tokens, whose
    // routed experts may take another form than a 2-token step's (moe_grouped).
    constexpr int64_t kCopies = 32;
    std::vector<std::vector<int32_t>> many;
    for (int64_t c = 0; c < kCopies; ++c) many.insert(many.end(), seqs.begin(), seqs.end());
    const std::vector<float> got = chunk_then_decode(*cuda, bf16, many, 100);
    std::vector<float> expected(got.size());
    for (int64_t c = 0; c < kCopies; ++c) {
      std::copy(logits.begin(), logits.end(), expected.begin() + c * 2 * len * vocab);
    }
    report(name + " cuda chunk 100 + decode, 64 seqs",
           compare_rows(got.data(), expected.data(), kCopies * 2 * len, vocab), moe);
  }
  if (cuda->config().n_routed_experts > 0) {
    // The routed experts' other forms (CudaRunnerOptions::expert_products; the checks above ran
    // the default, kOurs): the prefill's ~150 rows an expert take their paths.
    using ExpertProducts = CudaRunnerOptions::ExpertProducts;
    for (const auto& [products, label] : {std::pair{ExpertProducts::kCublas, "cublas"},
                                          std::pair{ExpertProducts::kOursGated, "ours-gated"}}) {
      CudaRunnerOptions options;
      options.expert_products = products;
      const auto other = make_cuda_runner(model_dir, options);
      report(name + " cuda prefill, experts " + label,
             compare_rows(prefill_all(*other, bf16, seqs).data(), logits.data(), 2 * len, vocab),
             moe);
    }
  }
  // The CPU runner on the same fixture (FP32 engine, exact cache): far inside the bound.
  const Model model = Model::load(model_dir);
  const auto cpu = make_cpu_runner(model);
  const Comparison c = compare_rows(prefill_all(*cpu, CacheFormat::f32(), seqs).data(),
                                    logits.data(), 2 * len, vocab);
  report(name + " cpu prefill (f32 cache)", c, Bound::kEveryRow);
  check(c.max_abs < 1e-3, name + ": CPU runner farther than 1e-3 from transformers");

  // Greedy continuation through the runner's own sampling: identical up to the first step whose
  // reference top-2 margin is inside the bound.
  const std::vector<int32_t> prompt = to_i32(*reference->find("greedy_prompt"));
  const std::vector<int32_t> expected = to_i32(*reference->find("greedy_tokens"));
  const std::vector<float> margin = to_f32(*reference->find("greedy_top2_margin"));
  const int64_t total = static_cast<int64_t>(prompt.size() + expected.size());
  auto pool = cuda->make_pool(bf16, PagePool::pages_for_tokens(total));
  const SequenceId seq = pool->add_sequence();
  pool->reserve(seq, total);
  std::vector<int32_t> got;
  int32_t next = 0;
  StepBatch batch{{{seq, prompt, LogitRows::kLast, {}}}};
  while (got.size() < expected.size()) {
    cuda->step(batch, *pool, {{}, std::span(&next, 1)});
    got.push_back(next);
    batch.chunks[0].tokens = std::span<const int32_t>(&got.back(), 1);
  }
  size_t same = 0;
  while (same < got.size() && got[same] == expected[same]) ++same;
  // Two logits each within the bound: a margin under twice the bound may flip.
  double scale = 0.0;
  for (float v : logits) scale = std::max(scale, std::abs(double(v)));
  const bool ok = same == got.size() || margin[same] < 2 * kRelTol * (1.0 + scale);
  std::printf("%-48s %zu/%zu tokens identical%s\n", (name + " cuda greedy").c_str(), same,
              got.size(),
              same == got.size()
                  ? ""
                  : (", then a step of reference margin " + std::to_string(margin[same])).c_str());
  check(ok, name + ": greedy continuation differs at a step with a clear margin");
}

// CUDA runner against the CPU runner on a fresh ragged batch (prefill chunks, continued chunks,
// single-token decodes) in a cache format both run: random lengths, printed seed. Chunks of 128
// tokens and more take the expanded prefill attention unless the options turn it off.
void check_against_cpu(const fs::path& model_dir, const std::string& spec, uint64_t seed,
                       const CudaRunnerOptions& options = {}, const std::string& variant = "") {
  const Model model = Model::load(model_dir);
  const auto cpu = make_cpu_runner(model);
  const auto cuda = make_cuda_runner(model_dir, options);
  const int64_t vocab = model.config().vocab_size;
  const CacheFormat format = CacheFormat::parse(spec);
  std::mt19937_64 rng(seed);
  const int sequences = 6;
  std::vector<std::vector<int32_t>> prefixes(sequences), chunks(sequences);
  for (int s = 0; s < sequences; ++s) {
    const int64_t prefix = std::uniform_int_distribution<int64_t>(0, 300)(rng);
    const int64_t chunk = s % 3 == 0   ? 1
                          : s % 3 == 1 ? std::uniform_int_distribution<int64_t>(1, 127)(rng)
                                       : std::uniform_int_distribution<int64_t>(128, 400)(rng);
    for (int64_t i = 0; i < prefix + chunk; ++i) {
      const int32_t id = std::uniform_int_distribution<int32_t>(0, int32_t(vocab) - 1)(rng);
      (i < prefix ? prefixes[s] : chunks[s]).push_back(id);
    }
  }
  std::vector<std::vector<float>> out;
  for (Runner* runner : {cpu.get(), cuda.get()}) {
    auto pool = runner->make_pool(format, sequences * 12);
    StepBatch batch;
    for (int s = 0; s < sequences; ++s) {
      const SequenceId id = pool->add_sequence();
      pool->reserve(id, static_cast<int64_t>(prefixes[s].size() + chunks[s].size()));
      if (!prefixes[s].empty()) {
        runner->step(StepBatch{{{id, prefixes[s], LogitRows::kNone, {}}}}, *pool, {});
      }
      batch.chunks.push_back({id, chunks[s], LogitRows::kAll, {}});
    }
    out.emplace_back(static_cast<size_t>(batch.num_logit_rows() * vocab));
    runner->step(batch, *pool, {out.back(), {}});
  }
  const bool rounded_only = format.content.bits() >= 16 && format.rope.bits() >= 16;
  const Bound bound = !rounded_only                         ? Bound::kArgmaxOnly
                      : model.config().n_routed_experts > 0 ? Bound::kMostRows
                                                            : Bound::kEveryRow;
  report(model_dir.filename().string() + " cuda" + variant + " vs cpu, " + spec + ", seed " +
             std::to_string(seed),
         compare_rows(out[1].data(), out[0].data(), static_cast<int64_t>(out[0].size()) / vocab,
                      vocab),
         bound);
}

// A prefill of three sequences, then decode steps (sampled), on an INT4 cache: every step's logits
// (of the sequences that `returned` names) and sampled tokens, and how many steps were replayed
// from a CUDA graph.
struct DecodeRun {
  std::vector<float> out;
  int replayed = 0;
};
constexpr int kDecodeSteps = 6;
DecodeRun run_decode_steps(Runner& runner, uint64_t seed,
                           const std::vector<bool>& returned = {true, true, true}) {
  const int64_t vocab = runner.config().vocab_size;
  std::mt19937_64 rng(seed + 1);
  const int sequences = 3, prompt = 70;
  std::vector<std::vector<int32_t>> ids(sequences);
  for (auto& s : ids) {
    for (int i = 0; i < prompt + kDecodeSteps; ++i) {
      s.push_back(std::uniform_int_distribution<int32_t>(0, int32_t(vocab) - 1)(rng));
    }
  }
  const CacheFormat format = CacheFormat::parse("content=int4:g64,rope=int4:g64");
  DecodeRun run;
  auto pool = runner.make_pool(format, sequences * 2);
  std::vector<SequenceId> seqs;
  StepBatch prefill;
  for (int s = 0; s < sequences; ++s) {
    seqs.push_back(pool->add_sequence());
    pool->reserve(seqs.back(), prompt + kDecodeSteps);
    prefill.chunks.push_back({seqs.back(), std::span(ids[s]).first(prompt), LogitRows::kNone, {}});
  }
  runner.step(prefill, *pool, {});
  const auto returned_rows = std::count(returned.begin(), returned.end(), true);
  std::vector<float> logits(static_cast<size_t>(returned_rows * vocab));
  std::vector<int32_t> tokens(sequences);
  for (int t = 0; t < kDecodeSteps; ++t) {
    StepBatch decode;
    for (int s = 0; s < sequences; ++s) {
      decode.chunks.push_back({seqs[s], std::span(ids[s]).subspan(prompt + t, 1), LogitRows::kLast,
                               SamplerOptions{0.8f, 0.9f, 7}, returned[s]});
    }
    runner.step(decode, *pool, {logits, tokens});
    run.out.insert(run.out.end(), logits.begin(), logits.end());
    for (int32_t token : tokens) run.out.push_back(static_cast<float>(token));
    if (runner.last_step_stats().graph_replayed) ++run.replayed;
  }
  return run;
}

size_t count_differences(const std::vector<float>& a, const std::vector<float>& b) {
  size_t differ = a.size() == b.size() ? 0 : std::max(a.size(), b.size());
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) differ += a[i] != b[i];
  return differ;
}

// Decode steps replayed from captured CUDA graphs give the logits of the same steps run
// launch by launch, bit for bit (same kernels, same inputs), and the graphs are used; so do the
// steps of a runner whose kernels are plain launches instead of programmatic dependent ones
// (the default: each kernel waits for its predecessor before reading what that one writes, and
// only the weights, and routing two kernels old, are read earlier).
void check_graphs(const fs::path& model_dir, uint64_t seed) {
  DecodeRun graphs, plain, without_pdl;
  {
    const auto runner = make_cuda_runner(model_dir);
    graphs = run_decode_steps(*runner, seed);
  }
  {
    CudaRunnerOptions options;
    options.max_graph_tokens = 0;
    const auto runner = make_cuda_runner(model_dir, options);
    plain = run_decode_steps(*runner, seed);
  }
  {
    CudaRunnerOptions options;
    options.programmatic_launch = false;
    const auto runner = make_cuda_runner(model_dir, options);
    without_pdl = run_decode_steps(*runner, seed);
  }
  gpu::set_programmatic_launch(true);
  const size_t differ = count_differences(graphs.out, plain.out);
  const size_t differ_without_pdl = count_differences(graphs.out, without_pdl.out);
  std::printf(
      "%-48s %d of %d steps replayed, %zu of %zu values differ; without programmatic launches: "
      "%d replayed, %zu differ\n",
      (model_dir.filename().string() + " graphs vs launches").c_str(), graphs.replayed,
      kDecodeSteps, differ, graphs.out.size(), without_pdl.replayed, differ_without_pdl);
  check(graphs.replayed == kDecodeSteps - 1,
        "decode steps after the first not replayed from a graph");
  check(differ == 0, "graph replay changed logits or sampled tokens");
  check(without_pdl.replayed == kDecodeSteps - 1 && differ_without_pdl == 0,
        "programmatic dependent launches changed logits or sampled tokens");
}

// Steps whose chunks bring back only some sequences' logits (return_logits) give those rows and
// every sampled token bit for bit as steps that bring back all, from their graphs alike: one run of
// rows in the middle, and two runs (two copies).
void check_returned_rows(const fs::path& model_dir, uint64_t seed) {
  const auto runner = make_cuda_runner(model_dir);
  const int64_t vocab = runner->config().vocab_size;
  const DecodeRun all = run_decode_steps(*runner, seed);
  for (const std::vector<bool>& returned :
       {std::vector<bool>{false, true, false}, std::vector<bool>{true, false, true}}) {
    const DecodeRun some = run_decode_steps(*runner, seed, returned);
    // Each step of `all`: 3 rows of logits, then 3 tokens; of `some`: its rows, then 3 tokens.
    std::vector<float> expected;
    const auto step_size = static_cast<size_t>(3 * vocab + 3);
    for (size_t step = 0; step < kDecodeSteps; ++step) {
      const auto first = all.out.begin() + static_cast<ptrdiff_t>(step * step_size);
      for (int s = 0; s < 3; ++s) {
        if (returned[s])
          expected.insert(expected.end(), first + s * vocab, first + (s + 1) * vocab);
      }
      expected.insert(expected.end(), first + 3 * vocab, first + 3 * vocab + 3);
    }
    const size_t differ = count_differences(expected, some.out);
    const std::string what = model_dir.filename().string() + " returned rows " +
                             (returned[0] ? "first and last" : "middle");
    std::printf("%-48s %zu of %zu values differ, %d of %d steps replayed\n", what.c_str(), differ,
                expected.size(), some.replayed, kDecodeSteps);
    check(differ == 0, what + ": the returned rows or the sampled tokens differ");
    check(some.replayed >= kDecodeSteps - 1, what + ": decode steps not replayed from a graph");
  }
}

// One sequence's logits three ways (BatchInvariance): (alone) its prompt in one chunk, then its
// tokens decoded one a step; (mixed) the prompt in chunks of 37 and 63 beside other sequences'
// prefills, then decoded beside two other sequences; (recomputed) prompt and decoded tokens as one
// chunk, every row's logits, as a preempted request is prefilled again. Rows: the logits after
// the prompt and after each decoded token.
struct ThreeWays {
  std::vector<float> alone, mixed, recomputed;
};
ThreeWays run_three_ways(Runner& runner, const CacheFormat& format, uint64_t seed) {
  constexpr int kPrompt = 100, kSteps = 6;
  const int64_t vocab = runner.config().vocab_size;
  std::mt19937_64 rng(seed + 2);
  const auto random_ids = [&](int count) {
    std::vector<int32_t> ids(static_cast<size_t>(count));
    for (auto& id : ids) id = std::uniform_int_distribution<int32_t>(0, int32_t(vocab) - 1)(rng);
    return ids;
  };
  const std::vector<int32_t> a = random_ids(kPrompt + kSteps), b = random_ids(150 + kSteps),
                             c = random_ids(30 + kSteps);
  const std::span<const int32_t> as(a), bs(b), cs(c);
  ThreeWays out;
  std::vector<float> logits(static_cast<size_t>((kPrompt + kSteps) * vocab));
  const auto keep = [&](std::vector<float>& into, int64_t row) {
    into.insert(into.end(), logits.begin() + row * vocab, logits.begin() + (row + 1) * vocab);
  };
  {
    auto pool = runner.make_pool(format, 16);
    const SequenceId s = pool->add_sequence();
    pool->reserve(s, kPrompt + kSteps);
    runner.step({{{s, as.first(kPrompt), LogitRows::kLast, {}}}}, *pool,
                {std::span(logits).first(vocab), {}});
    keep(out.alone, 0);
    for (int t = 0; t < kSteps; ++t) {
      runner.step({{{s, as.subspan(kPrompt + t, 1), LogitRows::kLast, {}}}}, *pool,
                  {std::span(logits).first(vocab), {}});
      keep(out.alone, 0);
    }
  }
  {
    auto pool = runner.make_pool(format, 16);
    const SequenceId sa = pool->add_sequence(), sb = pool->add_sequence(),
                     sc = pool->add_sequence();
    pool->reserve(sa, kPrompt + kSteps);
    pool->reserve(sb, 150 + kSteps);
    pool->reserve(sc, 30 + kSteps);
    runner.step(
        {{{sa, as.first(37), LogitRows::kNone, {}}, {sb, bs.first(150), LogitRows::kNone, {}}}},
        *pool, {});
    runner.step({{{sc, cs.first(30), LogitRows::kNone, {}},
                  {sa, as.subspan(37, kPrompt - 37), LogitRows::kLast, {}}}},
                *pool, {std::span(logits).first(vocab), {}});
    keep(out.mixed, 0);
    for (int t = 0; t < kSteps; ++t) {
      runner.step({{{sb, bs.subspan(150 + t, 1), LogitRows::kLast, {}},
                    {sa, as.subspan(kPrompt + t, 1), LogitRows::kLast, {}},
                    {sc, cs.subspan(30 + t, 1), LogitRows::kLast, {}}}},
                  *pool, {std::span(logits).first(3 * vocab), {}});
      keep(out.mixed, 1);
    }
  }
  {
    auto pool = runner.make_pool(format, 16);
    const SequenceId s = pool->add_sequence();
    pool->reserve(s, kPrompt + kSteps);
    runner.step({{{s, as, LogitRows::kAll, {}}}}, *pool, {logits, {}});
    for (int row = kPrompt - 1; row < kPrompt + kSteps; ++row) keep(out.recomputed, row);
  }
  return out;
}

// The batch-invariant runner (CudaRunnerOptions::batch_invariant) gives the three ways the same
// bits; the default runner, for comparison, is printed (its products and attention splits follow
// the step's size, so its rows may differ).
void check_batch_invariance(const fs::path& model_dir, const std::string& spec, uint64_t seed) {
  const CacheFormat format = CacheFormat::parse(spec);
  CudaRunnerOptions options;
  options.batch_invariant = true;
  ThreeWays invariant, fast;
  {
    const auto runner = make_cuda_runner(model_dir, options);
    invariant = run_three_ways(*runner, format, seed);
  }
  {
    const auto runner = make_cuda_runner(model_dir);
    fast = run_three_ways(*runner, format, seed);
  }
  const size_t mixed = count_differences(invariant.alone, invariant.mixed);
  const size_t recomputed = count_differences(invariant.alone, invariant.recomputed);
  bool finite = true;
  for (const float v : invariant.alone) finite = finite && std::isfinite(v);
  std::printf(
      "%-48s batch-invariant: %zu (mixed) and %zu (recomputed) of %zu logits differ from the "
      "alone run; default runner: %zu and %zu\n",
      (model_dir.filename().string() + " " + spec).c_str(), mixed, recomputed,
      invariant.alone.size(), count_differences(fast.alone, fast.mixed),
      count_differences(fast.alone, fast.recomputed));
  check(finite && mixed == 0 && recomputed == 0,
        "batch-invariant runner: a sequence's logits changed with its step's company or chunking");
}

// A batch-invariant step whose decode plan needs more device memory than is free (a long prompt's
// chunk: its runs' partial results, ~1 GB for 4000 tokens at 16 padded heads) fails with a
// CapacityError, commits nothing and leaves the runner usable: the same step runs once the memory
// is back.
void check_workspace_refusal(const fs::path& model_dir) {
  CudaRunnerOptions options;
  options.batch_invariant = true;
  const auto runner = make_cuda_runner(model_dir, options);
  const int64_t vocab = runner->config().vocab_size;
  const int64_t tokens = std::min<int64_t>(4000, runner->config().max_position_embeddings);
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i)
    ids[static_cast<size_t>(i)] = static_cast<int32_t>(i % vocab);
  auto pool = runner->make_pool(CacheFormat::parse("bf16"), PagePool::pages_for_tokens(tokens));
  const SequenceId s = pool->add_sequence();
  pool->reserve(s, tokens);
  std::vector<float> logits(static_cast<size_t>(vocab));
  const StepBatch step{{{s, ids, LogitRows::kLast, {}}}};
  size_t free_bytes = 0, total_bytes = 0;
  QUANTMLA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  void* hog = nullptr;  // all but 256 MiB of the free memory
  QUANTMLA_CUDA_CHECK(cudaMalloc(&hog, free_bytes - (size_t{256} << 20)));
  std::string refusal;
  try {
    runner->step(step, *pool, {logits, {}});
  } catch (const CapacityError& e) {
    refusal = e.what();
  }
  QUANTMLA_CUDA_CHECK(cudaFree(hog));
  std::printf("%-48s %s\n", (model_dir.filename().string() + " workspace refusal").c_str(),
              refusal.empty() ? "NOT refused" : refusal.c_str());
  check(!refusal.empty(), "a decode plan workspace beyond the free memory was not refused");
  check(pool->length(s) == 0, "a refused step changed the sequence's length");
  runner->step(step, *pool, {logits, {}});
  bool finite = true;
  for (const float v : logits) finite = finite && std::isfinite(v);
  check(finite && pool->length(s) == tokens, "the runner is not usable after a refused workspace");
}

// A swap (PagePool::copy_out / copy_in on a device pool): a sequence's records copied to the host
// and into another sequence's pages come back bit for bit, and its next decode step gives the
// original's logits bit for bit (the same step shape alone).
// `staging_pages`: the pinned staging buffer in pages (CudaRunnerOptions::swap_staging_bytes; -1
// for its default, which holds the whole sequence; 0 for none, the copies from pageable memory):
// fewer than the copy's layers x pages moves them in several rounds, the last a partial one where
// they do not divide.
void check_swap(const fs::path& model_dir, const std::string& spec, uint64_t seed,
                int64_t staging_pages) {
  const CacheFormat format = CacheFormat::parse(spec);
  const ModelConfig config = ModelConfig::from_file(model_dir / "config.json");
  const int64_t page_bytes =
      kPageTokens * format.record_bytes(config.kv_lora_rank, config.qk_rope_head_dim);
  CudaRunnerOptions options;
  if (staging_pages == 0) options.swap_staging_bytes = 0;
  if (staging_pages > 0) options.swap_staging_bytes = staging_pages * page_bytes + page_bytes / 2;
  const auto runner = make_cuda_runner(model_dir, options);
  const int64_t vocab = runner->config().vocab_size;
  std::mt19937_64 rng(seed);
  const int64_t tokens = 150;
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  auto pool = runner->make_pool(format, 16);
  const SequenceId a = pool->add_sequence();
  pool->reserve(a, tokens + 1);
  runner->step(StepBatch{{{a, ids, LogitRows::kNone, {}}}}, *pool, {});
  std::vector<uint8_t> out(static_cast<size_t>(pool->swap_bytes(tokens)));
  pool->copy_out(a, tokens, out);
  const SequenceId filler = pool->add_sequence();
  pool->reserve(filler, 200);  // the copy lands on other pages
  const SequenceId b = pool->add_sequence();
  pool->reserve(b, tokens + 1);
  pool->copy_in(b, tokens, out);
  std::vector<uint8_t> again(out.size());
  pool->copy_out(b, tokens, again);
  const std::vector<int32_t> next = {ids[0]};
  std::vector<float> logits_a(static_cast<size_t>(vocab)), logits_b(logits_a.size());
  runner->step(StepBatch{{{a, next, LogitRows::kLast, {}}}}, *pool, {logits_a, {}});
  runner->step(StepBatch{{{b, next, LogitRows::kLast, {}}}}, *pool, {logits_b, {}});
  const bool records_same = again == out;
  const bool logits_same =
      std::memcmp(logits_a.data(), logits_b.data(), logits_a.size() * sizeof(float)) == 0;
  const std::string staging = staging_pages < 0 ? "default staging"
                              : staging_pages == 0
                                  ? "no staging"
                                  : std::to_string(staging_pages) + "-page staging";
  std::printf("%-48s %-16s: records %s, next logits %s\n",
              (model_dir.filename().string() + " swap " + spec).c_str(), staging.c_str(),
              records_same ? "equal" : "DIFFER", logits_same ? "equal" : "DIFFER");
  check(records_same,
        spec + ", " + staging + ": a swapped sequence's records did not come back bit for bit");
  check(logits_same,
        spec + ", " + staging + ": a swapped sequence's next logits differ from the original's");
}

// Bad steps are refused before any work, with the runner and the pool still usable after.
void check_refusals(const fs::path& model_dir) {
  const auto cuda = make_cuda_runner(model_dir);
  const int64_t vocab = cuda->config().vocab_size;
  auto pool = cuda->make_pool(CacheFormat::parse("bf16"), 4);
  const SequenceId seq = pool->add_sequence();
  pool->reserve(seq, 64);
  const std::vector<int32_t> good = {1, 2, 3};
  const std::vector<int32_t> bad = {1, static_cast<int32_t>(vocab), 3};
  std::vector<float> logits(static_cast<size_t>(vocab));
  const auto refused = [&](const std::string& what, const StepBatch& batch, PagePool& p,
                           const StepOutputs& outputs) {
    try {
      cuda->step(batch, p, outputs);
    } catch (const Error& e) {
      std::printf("refused as expected (%s): %s\n", what.c_str(), e.what());
      return;
    }
    check(false, what + ": not refused");
  };
  refused("token id = vocab", StepBatch{{{seq, bad, LogitRows::kLast, {}}}}, *pool, {logits, {}});
  refused("logits buffer too small", StepBatch{{{seq, good, LogitRows::kAll, {}}}}, *pool,
          {logits, {}});
  const std::vector<int32_t> too_long(65, 1);
  refused("more tokens than reserved", StepBatch{{{seq, too_long, LogitRows::kNone, {}}}}, *pool,
          {});
  const Model model = Model::load(model_dir);
  const auto cpu = make_cpu_runner(model);
  auto host_pool = cpu->make_pool(CacheFormat::parse("bf16"), 4);
  const SequenceId host_seq = host_pool->add_sequence();
  host_pool->reserve(host_seq, 8);
  refused("a host pool", StepBatch{{{host_seq, good, LogitRows::kLast, {}}}}, *host_pool,
          {logits, {}});
  check(pool->length(seq) == 0, "a refused step changed the sequence's length");
  cuda->step(StepBatch{{{seq, good, LogitRows::kLast, {}}}}, *pool, {logits, {}});
  bool finite = true;
  for (float v : logits) finite = finite && std::isfinite(v);
  check(finite && pool->length(seq) == 3, "the runner is not usable after refused steps");

  // The profiling aid refuses an operation it does not know, at load, naming it.
  setenv("QUANTMLA_ABLATE", "uk,attention_but_faster", 1);
  try {
    make_cuda_runner(model_dir);
    check(false, "QUANTMLA_ABLATE with an unknown operation: not refused");
  } catch (const InvalidArgument& e) {
    std::printf("refused as expected (QUANTMLA_ABLATE): %s\n", e.what());
    check(std::string(e.what()).find("attention_but_faster") != std::string::npos,
          "the refusal names the unknown operation");
  }
  unsetenv("QUANTMLA_ABLATE");
  CudaRunnerOptions negative_staging;
  negative_staging.swap_staging_bytes = -1;
  try {
    make_cuda_runner(model_dir, negative_staging);
    check(false, "swap_staging_bytes -1: not refused");
  } catch (const InvalidArgument& e) {
    std::printf("refused as expected (swap_staging_bytes): %s\n", e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a crash keeps every line printed before it
  if (!gpu::device_available()) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  fs::path fixtures;
  std::vector<fs::path> models;
  uint64_t seed = std::random_device{}();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--fixtures") fixtures = argv[i + 1];
    if (flag == "--model") models.emplace_back(argv[i + 1]);
    if (flag == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
  }
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  try {
    if (!fixtures.empty()) {
      for (const char* name : {"mla-moe16-v2", "mla-moe16-v3"}) {
        check_fixture(fixtures, name);
        check_graphs(fixtures / name, seed);  // routed and shared experts (mla-tiny has none)
        check_returned_rows(fixtures / name, seed);
        for (const char* spec : {"bf16", "content=int4:g64,rope=int4:g64"}) {
          check_batch_invariance(fixtures / name, spec, seed);
        }
      }
    }
    for (const fs::path& model : models) {
      for (const char* spec : {"bf16", "content=int4:g64,rope=int4:g64"}) {
        check_against_cpu(model, spec, seed);
      }
      // The path the default replaces: prefill attention through the decode kernel.
      CudaRunnerOptions absorbed;
      absorbed.prefill_expanded_max_context = 0;
      check_against_cpu(model, "bf16", seed, absorbed, " (absorbed prefill)");
      check_graphs(model, seed);
      check_batch_invariance(model, "content=int2:g64,rope=int4:g64", seed);
      for (const char* spec : {"bf16", "content=int4:g64,rope=int4:g64"}) {
        check_swap(model, spec, seed, -1);
        // 150 tokens: 3 pages a layer; 4 pages a round leave a partial last one at any layer
        // count that is not a multiple of 4.
        check_swap(model, spec, seed, 4);
        check_swap(model, spec, seed, 0);
      }
      check_workspace_refusal(model);
      check_refusals(model);
    }
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  std::printf("%s: %d failed checks\n", failures == 0 ? "PASS" : "FAIL", failures);
  return failures == 0 ? 0 : 1;
}
