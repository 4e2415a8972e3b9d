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
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "quantmla/gpu_mla.h"
#include "quantmla/model.h"
#include "quantmla/runner.h"
#include "quantmla/safetensors.h"

namespace {

using namespace quantmla;
namespace fs = std::filesystem;

constexpr double kRelTol = 16.0 / 512.0;
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
  double max_abs = 0.0;     // largest |ours - reference|
  double worst_ratio = 0.0;  // largest |ours - reference| / bound
  int64_t rows = 0, argmax_agree = 0, argmax_exempt = 0, nan = 0;
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
    for (int64_t v = 0; v < vocab; ++v) {
      if (std::isnan(a[v])) {
        ++c.nan;
        continue;
      }
      const double diff = std::abs(double(a[v]) - b[v]);
      c.max_abs = std::max(c.max_abs, diff);
      c.worst_ratio = std::max(c.worst_ratio, diff / bound);
    }
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

void report(const std::string& what, const Comparison& c) {
  std::printf("%-48s max|d| %.4g  worst d/bound %.3f  argmax %lld/%lld (+%lld within bound)  "
              "NaN %lld\n",
              what.c_str(), c.max_abs, c.worst_ratio, static_cast<long long>(c.argmax_agree),
              static_cast<long long>(c.rows), static_cast<long long>(c.argmax_exempt),
              static_cast<long long>(c.nan));
  check(c.nan == 0, what + ": NaN logits");
  check(c.worst_ratio <= 1.0, what + ": logits outside the BF16 bound");
  check(c.argmax_agree + c.argmax_exempt == c.rows, what + ": argmax differs beyond the bound");
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
  report(name + " cuda prefill (bf16 cache)",
         compare_rows(prefill_all(*cuda, bf16, seqs).data(), logits.data(), 2 * len, vocab));
  report(name + " cuda chunk 100 + decode (bf16)",
         compare_rows(chunk_then_decode(*cuda, bf16, seqs, 100).data(), logits.data(), 2 * len,
                      vocab));
  // The CPU runner on the same fixture (FP32 engine, exact cache): far inside the bound.
  const Model model = Model::load(model_dir);
  const auto cpu = make_cpu_runner(model);
  const Comparison c =
      compare_rows(prefill_all(*cpu, CacheFormat::f32(), seqs).data(), logits.data(), 2 * len,
                   vocab);
  report(name + " cpu prefill (f32 cache)", c);
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
              same == got.size() ? ""
                                 : (", then a step of reference margin " +
                                    std::to_string(margin[same]))
                                       .c_str());
  check(ok, name + ": greedy continuation differs at a step with a clear margin");
}

// CUDA runner against the CPU runner on a fresh ragged batch (prefill chunks, continued chunks,
// single-token decodes) in a cache format both run: random lengths, printed seed.
void check_against_cpu(const fs::path& model_dir, const std::string& spec, uint64_t seed) {
  const Model model = Model::load(model_dir);
  const auto cpu = make_cpu_runner(model);
  const auto cuda = make_cuda_runner(model_dir);
  const int64_t vocab = model.config().vocab_size;
  const CacheFormat format = CacheFormat::parse(spec);
  std::mt19937_64 rng(seed);
  const int sequences = 6;
  std::vector<std::vector<int32_t>> prefixes(sequences), chunks(sequences);
  for (int s = 0; s < sequences; ++s) {
    const int64_t prefix = std::uniform_int_distribution<int64_t>(0, 300)(rng);
    const int64_t chunk = s % 3 == 0 ? 1 : std::uniform_int_distribution<int64_t>(1, 200)(rng);
    for (int64_t i = 0; i < prefix + chunk; ++i) {
      const int32_t id = std::uniform_int_distribution<int32_t>(0, int32_t(vocab) - 1)(rng);
      (i < prefix ? prefixes[s] : chunks[s]).push_back(id);
    }
  }
  std::vector<std::vector<float>> out;
  for (Runner* runner : {cpu.get(), cuda.get()}) {
    auto pool = runner->make_pool(format, sequences * 10);
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
  report(model_dir.filename().string() + " cuda vs cpu, " + spec + ", seed " + std::to_string(seed),
         compare_rows(out[1].data(), out[0].data(), static_cast<int64_t>(out[0].size()) / vocab,
                      vocab));
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
      for (const char* name : {"mla-moe16-v2", "mla-moe16-v3"}) check_fixture(fixtures, name);
    }
    for (const fs::path& model : models) {
      for (const char* spec : {"bf16", "content=int4:g64,rope=int4:g64"}) {
        check_against_cpu(model, spec, seed);
      }
    }
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  std::printf("%s: %d failed checks\n", failures == 0 ? "PASS" : "FAIL", failures);
  return failures == 0 ? 0 : 1;
}
