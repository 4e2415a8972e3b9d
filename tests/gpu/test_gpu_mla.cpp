// The GPU kernels against the CPU: quantize-on-write byte for byte against encode_path, and the
// decode kernel against the scalar attention reference (double accumulation) on the records the
// CPU codec wrote, with tolerances derived from the formats' roundings. Fresh random inputs each
// run (the seed is printed; --seed S repeats a run), outputs poisoned with NaN before each launch.
// Exit status: 0 all checks passed, 1 a check failed, 77 no CUDA device (ctest: skipped).
// --quick: a smaller set of cases, for compute-sanitizer.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "checks.h"
#include "decode_reference.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_kernels.h"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/model_ops.h"
#include "quantmla/attention.h"
#include "quantmla/cache_format.h"
#include "quantmla/dtype.h"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"

namespace {

using namespace quantmla;
using gpu::DeviceArray;
using gpu::kKeyDim;
using gpu::kLatentDim;
using gpu::kPageTokens;
using gpu::kRopeDim;
using testing::compare_faithful;
using testing::faithful_decode;
using testing::FaithfulComparison;
using testing::kFaithfulRms;
using testing::Mutation;

using gpu_checks::expect;
using gpu_checks::expect_throws;
using gpu_checks::rng;

// The decode kernel a plan picks (QUANTMLA_DECODE_KERNEL, read when a plan is made).
std::string decode_kernel_name() {
  const char* forced = std::getenv("QUANTMLA_DECODE_KERNEL");
  return forced == nullptr ? "auto" : forced;
}

// Runs f once per 16-row decode kernel that reads `spec`, each forced in turn: the tiled one, and
// the fragment kernel (both its forms where its three-block form reads the format) and the
// transposed one (both its forms: 32-row blocks where the rows come in 32s) where they read it
// (gpu::fragments_kernel_reads, gpu::fragments_three_blocks_reads, gpu::transposed_kernel_reads:
// the plan's own predicates); the tiled one alone otherwise.
void for_each_decode_kernel(const std::string& spec, const std::function<void()>& f) {
  const CacheFormat format = CacheFormat::parse(spec);
  std::vector<const char*> kernels = {"tiled"};
  if (gpu::fragments_kernel_reads(format)) kernels.push_back("fragments");
  if (gpu::fragments_three_blocks_reads(format)) kernels.push_back("fragments3");
  if (gpu::transposed_kernel_reads(format)) {
    kernels.push_back("transposed");
    kernels.push_back("transposed32");
  }
  if (kernels.size() == 1) {
    f();
    return;
  }
  for (const char* kernel : kernels) {
    setenv("QUANTMLA_DECODE_KERNEL", kernel, 1);
    f();
  }
  unsetenv("QUANTMLA_DECODE_KERNEL");
}

// A paged pool as the CPU cache writes it (random_paged_records) and the values written.
struct HostCache : testing::PagedRecords {
  std::vector<std::vector<float>> rows;  // per sequence [len, kKeyDim]
};

HostCache make_cache(const CacheFormat& format, const std::vector<int32_t>& lens) {
  HostCache cache;
  static_cast<testing::PagedRecords&>(cache) =
      testing::random_paged_records(format, lens, rng, &cache.rows);
  return cache;
}

// Largest error the GPU's dequantization to BF16 adds to one decoded value of this path, relative
// to the largest magnitude in its record, with u = 2^-8 the unit roundoff of BF16 (8 significant
// bits; the gather test measured errors up to 1.8x of a bound built on 2^-9): int formats round
// scale and min to BF16 (u each of |scale * code| <= range and |min|) and the result (u), fp8
// rounds the scaled value.
double dequant_error_factor(const PathFormat& format) {
  constexpr double kBf16Unit = 0x1.0p-8;
  switch (format.codec) {
    case Codec::kBF16:
      return 0.0;
    case Codec::kFP8:
      return kBf16Unit;
    default:
      return 4.0 * kBf16Unit;  // range <= 2 max|v|, |min| <= max|v| (+ clip), result
  }
}

struct DecodeCase {
  std::string format;
  int num_heads;
  int s_q;
  std::vector<int32_t> lens;
  int pages_per_split;  // 0: automatic
};

// One decode call's inputs on the device; run() launches it with a plan and returns the outputs
// (BF16 bits) and log-sum-exps, both poisoned with NaN before the launch so that every element
// must be written.
class DeviceDecode {
 public:
  DeviceDecode(const HostCache& cache, const std::vector<uint16_t>& q, int s_q, int num_heads,
               float softmax_scale)
      : format_(cache.format),
        q_(q),
        pool_(cache.pool),
        table_(cache.block_table),
        lens_(cache.lens),
        out_(cache.lens.size() * s_q * num_heads * kLatentDim),
        lse_(cache.lens.size() * s_q * num_heads) {
    params_.q = q_.data();
    params_.pool = pool_.data();
    params_.block_table = table_.data();
    params_.block_table_stride = cache.max_pages;
    params_.seq_lens = lens_.data();
    params_.out = out_.data();
    params_.lse = lse_.data();
    params_.batch = static_cast<int>(cache.lens.size());
    params_.s_q = s_q;
    params_.num_heads = num_heads;
    params_.softmax_scale = softmax_scale;
  }
  std::pair<std::vector<uint16_t>, std::vector<float>> run(const gpu::MlaDecodePlan& plan) {
    out_.fill_bytes(0xff);  // NaN in BF16 and FP32
    lse_.fill_bytes(0xff);
    gpu::mla_decode(format_, params_, plan);
    QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize());
    return {out_.download(), lse_.download()};
  }
  // The same call as the runner launches it: under programmatic dependent launches on `stream`,
  // with MlaDecodeParams::pool_ready, after a kernel that writes q (a row gather of `q_values`,
  // q's values as FP32, one row a query row), q poisoned with NaN before it.
  std::pair<std::vector<uint16_t>, std::vector<float>> run_after_q_kernel(
      const gpu::MlaDecodePlan& plan, const DeviceArray<float>& q_values,
      const DeviceArray<int32_t>& row_ids, cudaStream_t stream) {
    const int64_t rows = static_cast<int64_t>(row_ids.size());
    q_.fill_bytes(0xff);
    out_.fill_bytes(0xff);
    lse_.fill_bytes(0xff);
    gpu::set_programmatic_launch(true);
    gpu::MlaDecodeParams params = params_;
    params.pool_ready = true;
    gpu::gather_rows(q_values.data(), kKeyDim, rows, row_ids.data(), rows, q_.data(), kKeyDim,
                     DType::kBF16, kKeyDim, stream);
    gpu::mla_decode(format_, params, plan, stream);
    gpu::set_programmatic_launch(false);
    QUANTMLA_CUDA_CHECK(cudaStreamSynchronize(stream));
    return {out_.download(), lse_.download()};
  }

 private:
  CacheFormat format_;
  DeviceArray<uint16_t> q_;
  DeviceArray<uint8_t> pool_;
  DeviceArray<int32_t> table_, lens_;
  DeviceArray<uint16_t> out_;
  DeviceArray<float> lse_;
  gpu::MlaDecodeParams params_;
};

void run_decode_case(const DecodeCase& test) {
  const CacheFormat format = CacheFormat::parse(test.format);
  HostCache cache = make_cache(format, test.lens);
  const int batch = static_cast<int>(test.lens.size());
  const int rows = test.s_q * test.num_heads;
  const float softmax_scale = 1.0f / std::sqrt(192.0f);

  std::vector<uint16_t> q(static_cast<size_t>(batch) * rows * kKeyDim);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint16_t& v : q) v = f32_to_bf16(normal(rng));

  DeviceDecode device(cache, q, test.s_q, test.num_heads, softmax_scale);
  gpu::MlaDecodePlan plan(format, test.lens, test.s_q, test.num_heads, test.pages_per_split);
  const auto [out, lse] = device.run(plan);
  if (test.pages_per_split == 0) {
    // The same schedule planned into a caller's workspace, with the fixed grid of a captured step
    // (padding blocks) and with its own grid: the same bits.
    for (const bool fixed_grid : {true, false}) {
      const size_t bytes =
          fixed_grid
              ? gpu::MlaDecodePlan::workspace_bytes(format, batch, test.s_q, test.num_heads)
              : gpu::MlaDecodePlan::workspace_bytes(format, test.lens, test.s_q, test.num_heads);
      DeviceArray<uint8_t> workspace(bytes);
      const gpu::MlaDecodePlan placed(format, test.lens, test.s_q, test.num_heads,
                                      {workspace.data(), bytes}, fixed_grid, nullptr);
      expect(device.run(placed) == std::pair(out, lse),
             test.format + (fixed_grid ? ": fixed-grid" : ": own-grid") +
                 " workspace plan differs from the owning plan");
    }
  }

  const double content_factor = dequant_error_factor(format.content);
  const double rope_factor = dequant_error_factor(format.rope);
  double worst_ratio = 0.0;  // max over elements of |error| / tolerance
  double worst_abs = 0.0;
  double worst_lse = 0.0;
  int nan_count = 0;
  for (int b = 0; b < batch; ++b) {
    const int len = test.lens[b];
    // The values the attention sees on the CPU: the records decoded.
    std::vector<float> keys(static_cast<size_t>(len) * kKeyDim);
    double content_error = 0.0;  // bound on one dequantized value's GPU error
    double rope_error = 0.0;
    double value_max = 0.0;
    for (int pos = 0; pos < len; ++pos) {
      float* row = keys.data() + static_cast<size_t>(pos) * kKeyDim;
      const uint8_t* rec = cache.record(b, pos);
      decode_path(format.content, rec, kLatentDim, row);
      decode_path(format.rope, rec + cache.content_bytes, kRopeDim, row + kLatentDim);
      double content_max = 0.0, rope_max = 0.0;
      for (int i = 0; i < kLatentDim; ++i)
        content_max = std::max<double>(content_max, std::fabs(row[i]));
      for (int i = kLatentDim; i < kKeyDim; ++i)
        rope_max = std::max<double>(rope_max, std::fabs(row[i]));
      content_error = std::max(content_error, content_factor * content_max);
      rope_error = std::max(rope_error, rope_factor * rope_max);
      value_max = std::max(value_max, content_max);
    }
    for (int i = 0; i < test.s_q; ++i) {
      const int visible = len - test.s_q + i + 1;
      std::vector<float> q_row(static_cast<size_t>(test.num_heads) * kKeyDim);
      for (int h = 0; h < test.num_heads; ++h) {
        for (int d = 0; d < kKeyDim; ++d) {
          q_row[h * kKeyDim + d] = bf16_to_f32(
              q[((static_cast<size_t>(b) * test.s_q + i) * test.num_heads + h) * kKeyDim + d]);
        }
      }
      std::vector<float> ref(static_cast<size_t>(test.num_heads) * kLatentDim);
      std::vector<float> ref_lse(test.num_heads);
      AttentionParams ap;
      ap.q = q_row.data();
      ap.q_row_stride = test.num_heads * kKeyDim;
      ap.q_head_stride = kKeyDim;
      ap.kv = keys.data();
      ap.kv_row_stride = kKeyDim;
      ap.out = ref.data();
      ap.out_row_stride = test.num_heads * kLatentDim;
      ap.out_head_stride = kLatentDim;
      ap.lse = ref_lse.data();
      ap.n_q = 1;
      ap.num_heads = test.num_heads;
      ap.kv_lora_rank = kLatentDim;
      ap.rope_dim = kRopeDim;
      ap.q_pos0 = visible - 1;
      ap.softmax_scale = softmax_scale;
      attention_reference(ap);
      for (int h = 0; h < test.num_heads; ++h) {
        // Scaled-logit error: the keys' dequantization error against |q|, plus FP32 accumulation.
        double q_content = 0.0, q_rope = 0.0, qk = 0.0;
        const float* qh = q_row.data() + h * kKeyDim;
        for (int d = 0; d < kLatentDim; ++d) q_content += std::fabs(qh[d]);
        for (int d = kLatentDim; d < kKeyDim; ++d) q_rope += std::fabs(qh[d]);
        for (int j = 0; j < visible; ++j) {
          double dot = 0.0;
          for (int d = 0; d < kKeyDim; ++d)
            dot += std::fabs(qh[d] * keys[static_cast<size_t>(j) * kKeyDim + d]);
          qk = std::max(qk, dot);
        }
        // FP32 accumulation of kKeyDim products: at most kKeyDim units in the last place of the
        // sum of their magnitudes.
        const double logit_error =
            softmax_scale *
            (q_content * content_error + q_rope * rope_error + qk * kKeyDim * std::ldexp(1.0, -24));
        const size_t row = (static_cast<size_t>(b) * test.s_q + i) * test.num_heads + h;
        for (int d = 0; d < kLatentDim; ++d) {
          const double got = bf16_to_f32(out[row * kLatentDim + d]);
          const double want = ref[h * kLatentDim + d];
          if (std::isnan(got)) {
            ++nan_count;
            continue;
          }
          // Values' own error + weights' error (logits both ways, P rounded to BF16) + the output's
          // rounding to BF16.
          const double tolerance =
              content_error + value_max * (std::expm1(2.0 * logit_error) + std::ldexp(1.0, -8)) +
              std::ldexp(1.0, -9) * std::fabs(want) + 1e-6;
          worst_ratio = std::max(worst_ratio, std::fabs(got - want) / tolerance);
          worst_abs = std::max(worst_abs, std::fabs(got - want));
        }
        const double lse_error = std::fabs(lse[row] - ref_lse[h]);
        if (std::isnan(lse[row])) ++nan_count;
        worst_lse =
            std::max(worst_lse, lse_error / (logit_error + 1e-5 * (1.0 + std::fabs(ref_lse[h]))));
      }
    }
  }
  std::string lens;
  for (const int32_t len : test.lens) lens += (lens.empty() ? "" : ",") + std::to_string(len);
  char line[512];
  std::snprintf(line, sizeof line,
                "decode %-52s %s H=%-3d s_q=%d lens=%s split=%d blocks=%d: max|err| %.3g, "
                "err/tol %.3f, lse err/tol %.3f, NaN %d",
                test.format.c_str(), decode_kernel_name().c_str(), test.num_heads, test.s_q,
                lens.c_str(), test.pages_per_split, plan.num_blocks(), worst_abs, worst_ratio,
                worst_lse, nan_count);
  std::printf("%s\n", line);
  expect(nan_count == 0 && worst_ratio <= 1.0 && worst_lse <= 1.0, line);

  const FaithfulComparison f =
      compare_faithful(out, lse,
                       faithful_decode(cache, q, test.s_q, test.num_heads, softmax_scale,
                                       plan.blocks(), plan.keys_per_step(), Mutation::kNone,
                                       testing::Arithmetic::kExact, plan.operands()));
  std::snprintf(line, sizeof line,
                "  kernel's arithmetic: err/allowed max %.3f, RMS %.4f, lse %.3f; %d of %zu "
                "outputs bit-equal, NaN %d",
                f.worst, f.rms, f.worst_lse, f.exact, out.size(), f.nan);
  std::printf("%s\n", line);
  expect(f.nan == 0 && f.worst <= 1.0 && f.rms <= kFaithfulRms && f.worst_lse <= 1.0,
         test.format + line);
}

// Batch-invariant plans (gpu::DecodeSplit::kBatchInvariant): a token's query rows get the same
// bits, outputs and log-sum-exps, decoded alone (s_q 1), beside other sequences, and inside a
// prefill chunk of s_q 8 (beside another sequence's chunk) whose later keys are masked for it:
// what a recomputed request needs to reproduce its tokens. first_len: the first token's length;
// 505 puts the chunk across the first boundary of runs (kBatchInvariantMinRunPages pages), 13309
// across a page where the runs' length grows (13 to 14 pages: kBatchInvariantMaxRuns binds).
void run_batch_invariance_case(const std::string& spec, int first_len) {
  constexpr int kHeads = 16, kChunk = 8;
  constexpr int kTokenElements = kHeads * kKeyDim;  // one token's queries
  constexpr int kTokenOutputs = kHeads * kLatentDim;
  const CacheFormat format = CacheFormat::parse(spec);
  const int32_t other = 64 * gpu::kBatchInvariantMinRunPages + 1;  // two runs, the last short
  HostCache cache = make_cache(format, {first_len + kChunk - 1, 777, other});
  if (format.content.codec == Codec::kFP8) {
    // The chunk's last key, which only its last token sees, with every group's FP32 scale (after
    // the e4m3 codes, one a channel) 2^6 times larger: a fragment kernel whose FP16 operand's
    // exponent E counted keys that all of a block's rows mask would round the chunk's other tokens
    // unlike their decode steps (with random scales only now and then: 2 of 272 calls once).
    testing::scale_fp8_record(cache.record(0, first_len + kChunk - 2), 64.0f);
  }
  std::vector<uint16_t> q(static_cast<size_t>(3) * kChunk * kTokenElements);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint16_t& v : q) v = f32_to_bf16(normal(rng));
  const auto token = [&](int sequence, int i) {
    const auto begin = q.begin() + (static_cast<size_t>(sequence) * kChunk + i) * kTokenElements;
    return std::vector<uint16_t>(begin, begin + kTokenElements);
  };
  const float softmax_scale = 1.0f / std::sqrt(192.0f);
  // One call over the cache's first lens.size() sequences (their pages as written).
  const auto run = [&](const std::vector<int32_t>& lens, int s_q,
                       const std::vector<uint16_t>& call_q) {
    HostCache call = cache;
    call.lens = lens;
    DeviceDecode device(call, call_q, s_q, kHeads, softmax_scale);
    const size_t bytes = gpu::MlaDecodePlan::workspace_bytes(format, lens, s_q, kHeads,
                                                             gpu::DecodeSplit::kBatchInvariant);
    DeviceArray<uint8_t> workspace(bytes);
    const gpu::MlaDecodePlan plan(format, lens, s_q, kHeads, {workspace.data(), bytes}, false,
                                  nullptr, gpu::DecodeSplit::kBatchInvariant);
    return device.run(plan);
  };
  const std::vector<uint16_t> chunk_q(q.begin(), q.begin() + 2 * kChunk * kTokenElements);
  const auto [chunk_out, chunk_lse] = run({first_len + kChunk - 1, 777}, kChunk, chunk_q);
  int differing = 0, nan = 0;
  for (int i = 0; i < kChunk; ++i) {
    const auto [alone_out, alone_lse] = run({first_len + i}, 1, token(0, i));
    std::vector<uint16_t> beside_q = token(0, i);
    for (const int sequence : {1, 2}) {
      const std::vector<uint16_t> t = token(sequence, i);
      beside_q.insert(beside_q.end(), t.begin(), t.end());
    }
    const auto [beside_out, beside_lse] = run({first_len + i, 777, other}, 1, beside_q);
    const auto chunk_row = chunk_out.begin() + static_cast<size_t>(i) * kTokenOutputs;
    for (const auto* outputs : {&alone_out, &beside_out}) {
      differing += !std::equal(chunk_row, chunk_row + kTokenOutputs, outputs->begin());
    }
    for (int h = 0; h < kHeads; ++h) {
      const float in_chunk = chunk_lse[static_cast<size_t>(i) * kHeads + h];
      for (const float lse : {alone_lse[h], beside_lse[h]}) {
        differing += std::memcmp(&in_chunk, &lse, sizeof lse) != 0;
      }
    }
    for (size_t j = 0; j < kTokenOutputs; ++j) nan += std::isnan(bf16_to_f32(chunk_row[j]));
  }
  char line[256];
  std::snprintf(line, sizeof line,
                "batch-invariant decode %-44s %s lengths %d..%d: %d of %d token calls differ from "
                "the chunk's rows, NaN %d",
                spec.c_str(), decode_kernel_name().c_str(), first_len, first_len + kChunk - 1,
                differing, 2 * kChunk * (1 + kHeads), nan);
  std::printf("%s\n", line);
  expect(differing == 0 && nan == 0, line);
}

// MlaDecodeParams::pool_ready under programmatic dependent launches, as the runner launches the
// decode: q written by the kernel the decode follows (a row gather from FP32 copies of its
// values), the pool, tables and plan by copies before it, q poisoned with NaN in between; each
// 16-row kernel requests its first pages before its wait and must read q only after it. Five
// launches, each the same bits as a plain launch with q in place (a q read before the gather
// wrote it gives NaN).
void run_pool_ready_case(const std::string& spec, int s_q) {
  constexpr int kHeads = 16, kLaunches = 5;
  const CacheFormat format = CacheFormat::parse(spec);
  const std::vector<int32_t> lens = {2, 65, 300, 5000};  // each at least s_q long
  const HostCache cache = make_cache(format, lens);
  const int rows = static_cast<int>(lens.size()) * s_q * kHeads;
  std::vector<uint16_t> q(static_cast<size_t>(rows) * kKeyDim);
  std::vector<float> q_values(q.size());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] = f32_to_bf16(normal(rng));
    q_values[i] = bf16_to_f32(q[i]);  // exact: the gather's rounding gives q back
  }
  std::vector<int32_t> identity(rows);
  std::iota(identity.begin(), identity.end(), 0);
  const DeviceArray<float> q_source(q_values);
  const DeviceArray<int32_t> row_ids(identity);
  DeviceDecode device(cache, q, s_q, kHeads, 1.0f / std::sqrt(192.0f));
  const gpu::MlaDecodePlan plan(format, lens, s_q, kHeads, 0);
  const auto plain = device.run(plan);
  cudaStream_t stream = nullptr;
  QUANTMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int differing = 0;
  for (int launch = 0; launch < kLaunches; ++launch) {
    differing += device.run_after_q_kernel(plan, q_source, row_ids, stream) != plain;
  }
  QUANTMLA_CUDA_CHECK(cudaStreamDestroy(stream));
  char line[256];
  std::snprintf(line, sizeof line,
                "pool ready %-44s %s s_q=%d blocks=%d: %d of %d launches differ from the plain "
                "one",
                spec.c_str(), plan.kernel_name().c_str(), s_q, plan.num_blocks(), differing,
                kLaunches);
  std::printf("%s\n", line);
  expect(differing == 0, line);
}

// The faithful comparison must fail for each kernel bug a mutation stands for (format, heads and
// lengths chosen so that every mutation has one: s_q = 2, sequence 0 longer than a page).
void run_mutation_checks(const std::string& spec, int heads = 16) {
  const CacheFormat format = CacheFormat::parse(spec);
  const std::vector<int32_t> lens = {66, 200};
  const int s_q = 2, rows = s_q * heads;
  const float softmax_scale = 1.0f / std::sqrt(192.0f);
  HostCache cache = make_cache(format, lens);
  std::vector<uint16_t> q(lens.size() * rows * kKeyDim);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint16_t& v : q) v = f32_to_bf16(normal(rng));
  testing::aim_row0_at_mutated_keys(cache, q);
  gpu::MlaDecodePlan plan(format, lens, s_q, heads);
  const auto [out, lse] = DeviceDecode(cache, q, s_q, heads, softmax_scale).run(plan);
  const std::pair<Mutation, const char*> mutations[] = {
      {Mutation::kNone, "none (must pass)"},
      {Mutation::kGroupScale, "wrong scale in one group"},
      {Mutation::kWrongPage, "wrong page"},
      {Mutation::kDroppedKey, "dropped key"},
      {Mutation::kCausal, "causal mask off by one at s_q = 2"}};
  for (const auto& [mutation, name] : mutations) {
    if (mutation == Mutation::kGroupScale && format.content.codec == Codec::kBF16) continue;
    const FaithfulComparison f = compare_faithful(
        out, lse,
        faithful_decode(cache, q, s_q, heads, softmax_scale, plan.blocks(), plan.keys_per_step(),
                        mutation, testing::Arithmetic::kExact, plan.operands()));
    const bool passes = f.nan == 0 && f.worst <= 1.0 && f.rms <= kFaithfulRms;
    char line[256];
    std::snprintf(line, sizeof line,
                  "mutation %-36s %s %s, %d heads: err/allowed max %.3g, RMS %.3g -> %s", name,
                  spec.c_str(), decode_kernel_name().c_str(), heads, f.worst, f.rms,
                  passes ? "passes" : "fails");
    std::printf("%s\n", line);
    expect(passes == (mutation == Mutation::kNone), line);
  }
}

void run_write_case(const std::string& spec, int num_sequences, int tokens_per_sequence) {
  const CacheFormat format = CacheFormat::parse(spec);
  std::vector<int32_t> lens(num_sequences, tokens_per_sequence);
  HostCache cache = make_cache(format, lens);  // the CPU's records of the same rows
  std::vector<float> c, k_pe;
  std::vector<int32_t> ids, positions;
  for (int b = 0; b < num_sequences; ++b) {
    for (int pos = 0; pos < tokens_per_sequence; ++pos) {
      const float* row = cache.rows[b].data() + static_cast<size_t>(pos) * kKeyDim;
      c.insert(c.end(), row, row + kLatentDim);
      k_pe.insert(k_pe.end(), row + kLatentDim, row + kKeyDim);
      ids.push_back(b);
      positions.push_back(pos);
    }
  }
  // Constant and tiny groups: zero scales.
  std::fill(c.begin(), c.begin() + 128, 0.5f);
  std::fill(k_pe.begin(), k_pe.begin() + kRopeDim, 1e-9f);
  {
    uint8_t* rec = cache.record(0, 0);
    encode_path(format.content, c.data(), kLatentDim, rec);
    encode_path(format.rope, k_pe.data(), kRopeDim, rec + cache.content_bytes);
  }
  DeviceArray<float> d_c(c), d_k(k_pe);
  DeviceArray<int32_t> d_ids(ids), d_pos(positions), d_table(cache.block_table);
  DeviceArray<uint8_t> d_pool(cache.pool.size());
  d_pool.fill_bytes(0xff);  // as the host pool's unwritten slots
  gpu::MlaWriteParams params;
  params.c = d_c.data();
  params.k_pe = d_k.data();
  params.seq_ids = d_ids.data();
  params.positions = d_pos.data();
  params.pool = d_pool.data();
  params.block_table = d_table.data();
  params.block_table_stride = cache.max_pages;
  params.num_tokens = static_cast<int64_t>(ids.size());
  gpu::mla_write(format, params);
  QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> pool = d_pool.download();
  size_t mismatches = 0;
  size_t first = 0;
  for (size_t i = 0; i < pool.size(); ++i) {
    if (pool[i] != cache.pool[i] && mismatches++ == 0) first = i;
  }
  char line[256];
  std::snprintf(line, sizeof line, "write %-52s %zu tokens: %zu of %zu bytes differ (first at %zu)",
                spec.c_str(), ids.size(), mismatches, pool.size(), first);
  std::printf("%s\n", line);
  expect(mismatches == 0, line);
}

// Dequantize-on-read of a span of one sequence's rows against decode_path: every value within
// the GPU's dequantization error of the CPU's decoded value (exact for BF16 paths), the row
// padding left untouched.
void run_gather_case(const std::string& spec) {
  const CacheFormat format = CacheFormat::parse(spec);
  HostCache cache = make_cache(format, {70, 300});
  constexpr int kFirst = 37, kTokens = 250, kStride = kKeyDim + 8;
  DeviceArray<uint8_t> d_pool(cache.pool);
  DeviceArray<int32_t> d_table(cache.block_table);
  DeviceArray<uint16_t> d_out(static_cast<size_t>(kTokens) * kStride);
  d_out.fill_bytes(0xff);
  gpu::MlaGatherParams params;
  params.pool = d_pool.data();
  params.block_table = d_table.data() + cache.max_pages;  // the second sequence
  params.first = kFirst;
  params.num_tokens = kTokens;
  params.out = d_out.data();
  params.out_stride = kStride;
  gpu::mla_gather(format, params);
  QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> out = d_out.download();
  double worst_ratio = 0.0;
  int bad = 0, touched_padding = 0;
  std::vector<float> row(kKeyDim);
  for (int t = 0; t < kTokens; ++t) {
    const uint8_t* rec = cache.record(1, kFirst + t);
    decode_path(format.content, rec, kLatentDim, row.data());
    decode_path(format.rope, rec + cache.content_bytes, kRopeDim, row.data() + kLatentDim);
    for (const bool rope : {false, true}) {
      const int begin = rope ? kLatentDim : 0, end = rope ? kKeyDim : kLatentDim;
      double path_max = 0.0;
      for (int i = begin; i < end; ++i) path_max = std::max<double>(path_max, std::fabs(row[i]));
      const double bound = dequant_error_factor(rope ? format.rope : format.content) * path_max;
      for (int i = begin; i < end; ++i) {
        const double got = bf16_to_f32(out[static_cast<size_t>(t) * kStride + i]);
        const double err = std::fabs(got - row[i]);
        if (!(err <= bound)) ++bad;  // NaN counts
        if (bound > 0.0) worst_ratio = std::max(worst_ratio, err / bound);
      }
    }
    for (int i = kKeyDim; i < kStride; ++i) {
      if (out[static_cast<size_t>(t) * kStride + i] != 0xffff) ++touched_padding;
    }
  }
  char line[256];
  std::snprintf(line, sizeof line,
                "gather %-52s %d rows: %d values beyond the bound (worst %.3f of it), %d padding "
                "values written",
                spec.c_str(), kTokens, bad, worst_ratio, touched_padding);
  std::printf("%s\n", line);
  expect(bad == 0 && touched_padding == 0, line);
}

// The write that normalizes and rotates the raw kv_a_proj rows itself gives the records of
// gpu::rms_norm and gpu::rope followed by the plain write, byte for byte.
void run_fused_write_case(const std::string& spec, int num_tokens) {
  const CacheFormat format = CacheFormat::parse(spec);
  constexpr int kWidth = kKeyDim + 8;  // the raw rows' stride (a padded buffer)
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> raw(static_cast<size_t>(num_tokens) * kWidth), weight(kLatentDim),
      inv_freq(kRopeDim / 2);
  for (float& v : raw) v = 3.0f * normal(rng);
  for (float& w : weight) w = 1.0f + 0.3f * normal(rng);
  for (int i = 0; i < kRopeDim / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / kRopeDim);
  std::vector<int32_t> seq_ids(num_tokens), positions(num_tokens);
  const int max_pages = 4096;
  std::vector<int32_t> table(2 * max_pages);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  // Distinct positions per sequence (no two tokens share a record), spread to 130K and beyond.
  const int base = std::uniform_int_distribution<int>(0, 999)(rng);
  for (int t = 0; t < num_tokens; ++t) {
    seq_ids[t] = t % 2;
    positions[t] = base + (t / 2) * 523;
  }
  const int64_t record = format.record_bytes(kLatentDim, kRopeDim);
  const size_t pool_bytes = static_cast<size_t>(2 * max_pages) * kPageTokens * record;
  DeviceArray<float> d_raw(raw), d_weight(weight), d_freq(inv_freq);
  DeviceArray<float> d_c(static_cast<size_t>(num_tokens) * kLatentDim),
      d_k(static_cast<size_t>(num_tokens) * kRopeDim);
  DeviceArray<int32_t> d_seq(seq_ids), d_pos(positions), d_table(table);
  DeviceArray<uint8_t> fused(pool_bytes), separate(pool_bytes);
  fused.fill_bytes(0xff);
  separate.fill_bytes(0xff);
  const float eps = 1e-6f, factor = 1.1f;
  gpu::MlaWriteParams params;
  params.seq_ids = d_seq.data();
  params.positions = d_pos.data();
  params.block_table = d_table.data();
  params.block_table_stride = max_pages;
  params.num_tokens = num_tokens;
  // Separate: normalized c and rotated k_pe in their own buffers, then the plain write.
  gpu::rms_norm(d_raw.data(), kWidth, d_weight.data(), d_c.data(), kLatentDim, DType::kF32,
                num_tokens, kLatentDim, eps, nullptr);
  QUANTMLA_CUDA_CHECK(cudaMemcpy2D(d_k.data(), kRopeDim * 4, d_raw.data() + kLatentDim, kWidth * 4,
                                   kRopeDim * 4, num_tokens, cudaMemcpyDeviceToDevice));
  gpu::rope(d_k.data(), kRopeDim, kRopeDim, d_pos.data(), d_freq.data(), factor, num_tokens, 1,
            kRopeDim, nullptr);
  params.c = d_c.data();
  params.k_pe = d_k.data();
  params.pool = separate.data();
  gpu::mla_write(format, params);
  // Fused: the raw rows.
  params.c = d_raw.data();
  params.c_stride = kWidth;
  params.k_pe = d_raw.data() + kLatentDim;
  params.k_pe_stride = kWidth;
  params.norm_weight = d_weight.data();
  params.norm_eps = eps;
  params.inv_freq = d_freq.data();
  params.attention_factor = factor;
  params.pool = fused.data();
  gpu::mla_write(format, params);
  QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> a = fused.download(), b = separate.download();
  size_t mismatches = 0;
  for (size_t i = 0; i < a.size(); ++i) mismatches += a[i] != b[i];
  char line[200];
  std::snprintf(line, sizeof line, "fused write %-46s %d tokens: %zu bytes differ", spec.c_str(),
                num_tokens, mismatches);
  std::printf("%s\n", line);
  expect(mismatches == 0, line);
}

void run_error_cases() {
  expect_throws<InvalidArgument>(
      "q4_0 content", [] { gpu::check_gpu_format(CacheFormat::parse("content=q4_0,rope=bf16")); });
  expect_throws<InvalidArgument>("int4 g32 RoPE", [] {
    gpu::check_gpu_format(CacheFormat::parse("content=int4:g64,rope=int4:g32"));
  });
  const CacheFormat bf16 = CacheFormat::parse("content=bf16,rope=bf16");
  expect_throws<InvalidArgument>("24 heads", [&] { gpu::MlaDecodePlan plan(bf16, {100}, 1, 24); });
  expect_throws<InvalidArgument>("sequence shorter than s_q", [&] {
    gpu::MlaDecodePlan plan(bf16, {100, 1}, 2, 16);
  });
  expect_throws<InvalidArgument>("plan for q4_0", [] {
    gpu::MlaDecodePlan plan(CacheFormat::parse("content=q4_0,rope=q4_0"), {100}, 1, 16);
  });
  const auto decode_with = [&](const CacheFormat& format, int batch) {
    gpu::MlaDecodePlan plan(bf16, {100}, 1, 16);
    gpu::MlaDecodeParams params;
    params.batch = batch;
    params.s_q = 1;
    params.num_heads = 16;
    gpu::mla_decode(format, params, plan);
  };
  expect_throws<InvalidArgument>("params disagree with the plan", [&] { decode_with(bf16, 2); });
  expect_throws<InvalidArgument>("plan made for another format", [&] {
    decode_with(CacheFormat::parse("content=int4:g64,rope=int4:g64"), 1);
  });
  // A one-token write whose pointers are all set (to host memory: the calls below are refused
  // before any launch), for the cases that break one thing.
  int32_t dummy = 0;
  float value = 0.0f;
  const auto one_token_write = [&] {
    gpu::MlaWriteParams params;
    params.c = params.k_pe = &value;
    params.seq_ids = params.positions = params.block_table = &dummy;
    params.pool = reinterpret_cast<uint8_t*>(&dummy);
    params.block_table_stride = 1;
    params.num_tokens = 1;
    return params;
  };
  expect_throws<InvalidArgument>("write with a c stride below the row", [&] {
    gpu::MlaWriteParams params = one_token_write();
    params.c_stride = kLatentDim - 1;
    gpu::mla_write(bf16, params);
  });
  expect_throws<InvalidArgument>("gather from a negative position", [&] {
    gpu::MlaGatherParams params;
    params.first = -1;
    params.num_tokens = 1;
    gpu::mla_gather(bf16, params);
  });
  expect_throws<InvalidArgument>("gather into rows narrower than a record", [&] {
    gpu::MlaGatherParams params;
    params.num_tokens = 1;
    params.out_stride = kKeyDim - 1;
    gpu::mla_gather(bf16, params);
  });
  expect_throws<InvalidArgument>("gather into rows not in 16-byte pieces", [&] {
    gpu::MlaGatherParams params;
    params.num_tokens = 1;
    params.out_stride = kKeyDim + 4;
    gpu::mla_gather(bf16, params);
  });
  expect_throws<InvalidArgument>("gather without a pool", [&] {
    gpu::MlaGatherParams params;
    params.num_tokens = 1;
    gpu::mla_gather(bf16, params);
  });
  {
    // The plan's own choice (decode.cu, fragments_min_batch): the fragment kernel from 32 int4
    // sequences; below that the transposed kernel's converting form for fewer than 16 at 16
    // heads (int4 g128 and int2 g128 too), else the tiled one (half a page a step for int4 at 16
    // rows); int2 g64 takes the fragment kernel from one sequence.
    const CacheFormat int4 = CacheFormat::parse("content=int4:g64,rope=int4:g64");
    const CacheFormat int4_g128 = CacheFormat::parse("content=int4:g128,rope=bf16");
    const std::vector<int32_t> one(1, 100), many(32, 100), fifteen(15, 100), sixteen(16, 100);
    expect(gpu::MlaDecodePlan(int4, one, 1, 16).kernel_name() == "transposed" &&
               gpu::MlaDecodePlan(int4_g128, fifteen, 1, 16).kernel_name() == "transposed",
           "auto: the transposed kernel for 1 int4 g64 and 15 int4 g128 sequences at 16 heads");
    expect(gpu::MlaDecodePlan(CacheFormat::parse("content=int2:g128,rope=bf16"), fifteen, 1, 16)
                   .kernel_name() == "transposed",
           "auto: the transposed kernel for 15 int2 g128 sequences at 16 heads");
    expect(gpu::MlaDecodePlan(int4, sixteen, 1, 16).kernel_name() == "tiled" &&
               gpu::MlaDecodePlan(int4_g128, many, 1, 16).kernel_name() == "tiled",
           "auto: the tiled kernel for 16 int4 g64 and 32 int4 g128 sequences at 16 heads");
    expect(gpu::MlaDecodePlan(int4, one, 1, 32).kernel_name() == "tiled",
           "auto: the tiled kernel for one int4 sequence at 32 heads");
    expect(gpu::MlaDecodePlan(int4, many, 1, 16).kernel_name() == "fragments",
           "auto: the fragment kernel for 32 int4 sequences");
    // Past 256 pages (decode_long_context): its three-block form for int4 from 16 sequences, for
    // int2 from 64, never in a batch-invariant plan.
    const std::vector<int32_t> long16(16, 20000);
    const CacheFormat int2 = CacheFormat::parse("content=int2:g64,rope=int4:g64");
    const auto int2_plan_kernel = [&](const std::vector<int32_t>& lens, int s_q = 1) {
      return gpu::MlaDecodePlan(int2, lens, s_q, 16).kernel_name();
    };
    expect(gpu::MlaDecodePlan(int4, long16, 1, 16).kernel_name() == "fragments3",
           "auto: the fragment kernel's three-block form for 16 int4 sequences of 20000 tokens");
    expect(int2_plan_kernel(long16) == "fragments",
           "auto: the two-block fragment kernel for 16 int2 sequences of 20000 tokens");
    expect(int2_plan_kernel(std::vector<int32_t>(64, 20000)) == "fragments3",
           "auto: the fragment kernel's three-block form for 64 int2 sequences of 20000 tokens");
    {
      // Not where its plan keeps at most two blocks an SM anyway (more_blocks_fill_more): at
      // s_q = 2, sms - 4 sequences are 2 sms - 8 tiles of 16 rows, a run each (on 132 SMs, the
      // 128 x 2 tiles where the two-block form was measured faster); at s_q = 1, three runs each.
      int device = 0, sms = 0;
      QUANTMLA_CUDA_CHECK(cudaGetDevice(&device));
      QUANTMLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      if (sms - 4 >= 64) {  // int2's three-block form starts at 64 sequences
        const std::vector<int32_t> lens(sms - 4, 20000);
        const std::string what = std::to_string(sms - 4) + " sequences of 20000 tokens on " +
                                 std::to_string(sms) + " SMs";
        expect(gpu::MlaDecodePlan(int4, lens, 2, 16).kernel_name() == "fragments",
               "auto: the two-block fragment kernel for int4 at s_q = 2, " + what);
        expect(gpu::MlaDecodePlan(int4, lens, 1, 16).kernel_name() == "fragments3",
               "auto: the three-block form for int4 at s_q = 1, " + what);
        expect(int2_plan_kernel(lens) == "fragments3",
               "auto: the three-block form for int2 at s_q = 1, " + what);
        expect(int2_plan_kernel(lens, 2) == "fragments",
               "auto: the two-block fragment kernel for int2 at s_q = 2, " + what);
      }
    }
    {
      const size_t bytes = gpu::MlaDecodePlan::workspace_bytes(int4, long16, 1, 16,
                                                               gpu::DecodeSplit::kBatchInvariant);
      DeviceArray<uint8_t> space(bytes);
      const gpu::MlaDecodeWorkspace workspace{space.data(), bytes};
      expect(gpu::MlaDecodePlan(int4, long16, 1, 16, workspace, false, nullptr,
                                gpu::DecodeSplit::kBatchInvariant)
                     .kernel_name() == "fragments",
             "auto: the two-block fragment kernel in a batch-invariant plan");
    }
    expect(gpu::MlaDecodePlan(int2, one, 1, 16).keys_per_step() == 64,
           "auto: the fragment kernel for one int2 g64 sequence");
    expect(gpu::MlaDecodePlan(int2, many, 1, 16).keys_per_step() == 64,
           "auto: the fragment kernel for 32 int2 g64 sequences");
    expect(gpu::MlaDecodePlan(CacheFormat::parse("content=int2:g128,rope=int4:g64"), many, 1, 16)
                   .keys_per_step() != 64,
           "auto: the tiled kernel for int2 g128");
    // BF16 from 64 heads: the warpgroup kernel, 64 rows a block, for one long sequence too; one
    // sequence of one token up to kLongContextPages pages takes the transposed kernel's 16-row
    // blocks.
    const auto first_block_rows = [&](const std::vector<int32_t>& lens, int s_q, int heads) {
      return gpu::MlaDecodePlan(bf16, lens, s_q, heads).blocks().front().rows;
    };
    const std::vector<int32_t> one_long(1, (gpu::kLongContextPages + 1) * gpu::kPageTokens);
    expect(first_block_rows(many, 1, 64) == 64 && first_block_rows(many, 1, 128) == 64 &&
               first_block_rows(one_long, 1, 128) == 64 && first_block_rows(one, 2, 128) == 64,
           "auto: the warpgroup kernel's 64-row blocks for a BF16 cache at 64 and 128 heads (32 "
           "sequences, one past 256 pages, one at s_q = 2)");
    expect(gpu::MlaDecodePlan(bf16, one, 1, 128).kernel_name() == "transposed" &&
               gpu::MlaDecodePlan(bf16, one, 1, 64).kernel_name() == "transposed",
           "auto: the transposed kernel for one BF16 sequence of 100 tokens at 64 and 128 heads");
    expect(first_block_rows(one, 1, 16) == 16, "auto: 16-row blocks for a BF16 cache at 16 heads");
    // At s_q = 2: the two-tile form's 32-row blocks (both tokens a block) for 16 long sequences,
    // not for one.
    const gpu::MlaDecodePlan long_bf16(bf16, std::vector<int32_t>(16, 20000), 2, 16);
    expect(long_bf16.kernel_name() == "transposed32" && long_bf16.blocks().front().rows == 32,
           "auto: 32-row blocks for 16 BF16 sequences of 20000 tokens at 16 heads, s_q = 2");
    const gpu::MlaDecodePlan one_bf16(bf16, one, 2, 16);
    expect(one_bf16.kernel_name() == "transposed" && one_bf16.blocks().front().rows == 16,
           "auto: 16-row blocks for one BF16 sequence at 16 heads, s_q = 2");
    // Quantized caches from 64 heads: the warpgroup kernel from two sequences, not for one.
    expect(gpu::MlaDecodePlan(int4, many, 1, 128).blocks().front().rows == 64 &&
               gpu::MlaDecodePlan(int2, many, 1, 64).blocks().front().rows == 64,
           "auto: the warpgroup kernel for 32 int4 / int2 sequences at 64 or more heads");
    expect(gpu::MlaDecodePlan(int4, one, 1, 128).blocks().front().rows != 64,
           "auto: not the warpgroup kernel for one short int4 sequence");
    expect(gpu::MlaDecodePlan(int4, one_long, 1, 128).kernel_name() == "warpgroup" &&
               gpu::MlaDecodePlan(int2, one_long, 1, 64).kernel_name() == "warpgroup",
           "auto: the warpgroup kernel for one long int4 / int2 sequence at 64 or more heads");
  }
  setenv("QUANTMLA_DECODE_KERNEL", "fragments", 1);
  expect_throws<InvalidArgument>("the fragment kernel forced on a BF16 cache",
                                 [&] { gpu::MlaDecodePlan plan(bf16, {100}, 1, 16); });
  setenv("QUANTMLA_DECODE_KERNEL", "fragments3", 1);
  expect_throws<InvalidArgument>("the three-block fragment kernel forced on an fp8 cache", [&] {
    gpu::MlaDecodePlan plan(CacheFormat::parse("content=fp8,rope=bf16"), {100}, 1, 16);
  });
  setenv("QUANTMLA_DECODE_KERNEL", "transposed", 1);
  expect_throws<InvalidArgument>("the transposed kernel forced on an fp8 cache", [&] {
    gpu::MlaDecodePlan plan(CacheFormat::parse("content=fp8,rope=bf16"), {100}, 1, 16);
  });
  expect_throws<InvalidArgument>(
      "the transposed kernel forced on BF16 content with an int4 RoPE key", [&] {
        gpu::MlaDecodePlan plan(CacheFormat::parse("content=bf16,rope=int4:g64"), {100}, 1, 16);
      });
  setenv("QUANTMLA_DECODE_KERNEL", "warpgroup", 1);
  expect_throws<InvalidArgument>(
      "the warpgroup kernel forced on BF16 content with an int4 RoPE key", [&] {
        gpu::MlaDecodePlan plan(CacheFormat::parse("content=bf16,rope=int4:g64"), {100}, 1, 64);
      });
  expect_throws<InvalidArgument>(
      "the warpgroup kernel forced on FP8 content with a BF16 RoPE key",
      [&] { gpu::MlaDecodePlan plan(CacheFormat::parse("content=fp8,rope=bf16"), {100}, 1, 64); });
  expect_throws<InvalidArgument>(
      "the warpgroup kernel forced on a format without GPU kernels",
      [&] { gpu::MlaDecodePlan plan(CacheFormat::parse("content=f32,rope=f32"), {100}, 1, 64); });
  setenv("QUANTMLA_DECODE_KERNEL", "fastest", 1);
  expect_throws<InvalidArgument>("an unknown QUANTMLA_DECODE_KERNEL", [&] {
    gpu::MlaDecodePlan plan(CacheFormat::parse("content=int4:g64,rope=int4:g64"), {100}, 1, 16);
  });
  unsetenv("QUANTMLA_DECODE_KERNEL");
  expect_throws<InvalidArgument>("write with q8_0", [&] {
    gpu::mla_write(CacheFormat::parse("content=q8_0,rope=bf16"), one_token_write());
  });
}

const std::vector<std::string> kFormats = {
    "content=bf16,rope=bf16",
    "content=fp8,rope=bf16",
    "content=int4:g64,rope=int4:g64",
    "content=int4:g128,rope=int4:g64",
    "content=int2:g64,rope=int4:g64",
    "content=int2:g128,rope=int4:g64",
    "content=int4:g64:clip0.95,rope=int4:g64:bf16pairs=0+21",
    "content=int2:g64:clip0.8,rope=int4:g64:bf16pairs=0+21",
    "content=int2:g128,rope=bf16",
    "content=bf16,rope=int4:g64:clip0.9:bf16pairs=1+5+21+31",
};

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;  // --quick: a smaller set of cases, for compute-sanitizer
  return gpu_checks::run(
      argc, argv,
      [&quick] {
        run_error_cases();
        for (const char* spec :
             {"content=int4:g64,rope=int4:g64", "content=int2:g64,rope=int4:g64"}) {
          for_each_decode_kernel(spec, [spec] { run_mutation_checks(spec); });
        }
        run_mutation_checks("content=fp8,rope=bf16");
        for (const char* spec : {"content=bf16,rope=bf16", "content=int4:g64,rope=int4:g64",
                                 "content=int2:g64,rope=bf16", "content=fp8,rope=bf16"}) {
          for_each_decode_kernel(spec, [spec] {
            run_pool_ready_case(spec, 1);
            run_pool_ready_case(spec, 2);
          });
        }
        for_each_decode_kernel("content=bf16,rope=bf16",
                               [] { run_mutation_checks("content=bf16,rope=bf16"); });
        for (const std::string& spec : kFormats) {
          for_each_decode_kernel(spec, [&] {
            for (const int first_len : {1, 505, 13309}) run_batch_invariance_case(spec, first_len);
          });
        }
        for (const std::string& spec : kFormats) run_write_case(spec, 3, quick ? 70 : 300);
        for (const std::string& spec : kFormats) run_gather_case(spec);
        for (const std::string& spec : kFormats) run_fused_write_case(spec, 500);
        const int heads[] = {16, 32, 64, 128};
        int n = 0;
        for (const std::string& spec : kFormats) {
          // Lengths 1, around a page, and not multiples of the page size, in one batch.
          const int h = heads[n++ % 4];
          for_each_decode_kernel(spec, [&] {
            run_decode_case({spec, h, 1, {1, 63, 64, 65, 300}, 0});
            if (quick) return;
            run_decode_case({spec, h, 2, {2, 130, 1000}, 0});
            run_decode_case({spec, 16, 1, {5000, 37}, 3});  // split into runs of 3 pages + combine
          });
        }
        if (!quick) {
          for_each_decode_kernel("content=int4:g64,rope=int4:g64", [] {
            run_decode_case({"content=int4:g64,rope=int4:g64", 128, 2, {4097, 70, 2}, 0});
            run_decode_case({"content=int4:g64,rope=bf16", 16, 1, {20000, 3, 64}, 0});
          });
          for_each_decode_kernel("content=int2:g64,rope=bf16", [] {
            run_decode_case({"content=int2:g64,rope=int4:g64", 16, 1, {20000}, 0});
            run_decode_case({"content=int2:g64,rope=bf16", 128, 2, {4097, 70, 2}, 0});
          });
          run_decode_case({"content=bf16,rope=bf16", 64, 1, {20000, 1}, 0});
          // The transposed kernel on long sequences (its two page stages cycled many times), at
          // 128 heads (eight 16-row blocks a token, or four of 32) and split and combined at
          // s_q = 2 (32-row blocks in its two-tile form).
          for_each_decode_kernel("content=bf16,rope=bf16", [] {
            run_decode_case({"content=bf16,rope=bf16", 16, 1, {20000, 3, 64}, 0});
            run_decode_case({"content=bf16,rope=bf16", 128, 2, {4097, 70, 2}, 0});
            run_decode_case({"content=bf16,rope=bf16", 16, 2, {5000, 37}, 3});
          });
        }
        // The warpgroup kernels (64 rows a block; a BF16 cache on the seesaw schedule), forced:
        // every format they read at 64 or 128 heads, lengths around a page, s_q 1 and 2; padded
        // blocks (16, 32 and 48 heads), splits with their combine; their mutations, padded and
        // not, BF16 and dequantized.
        setenv("QUANTMLA_DECODE_KERNEL", "warpgroup", 1);
        for (const char* spec : {"content=bf16,rope=bf16", "content=int4:g64,rope=int4:g64",
                                 "content=int2:g64,rope=int4:g64"}) {
          run_mutation_checks(spec, 64);
        }
        run_mutation_checks("content=bf16,rope=bf16", 16);
        int warpgroup_case = 0;
        for (const std::string& spec : kFormats) {
          if (!gpu::warpgroup_kernel_reads(CacheFormat::parse(spec))) continue;
          const int h = warpgroup_case++ % 2 == 0 ? 128 : 64;
          run_decode_case({spec, h, 1, {1, 63, 64, 65, 300}, 0});
          if (!quick) run_decode_case({spec, h, 2, {2, 130, 1000}, 0});
        }
        run_decode_case({"content=bf16,rope=bf16", 16, 1, {1, 63, 64, 65, 300}, 0});
        run_decode_case({"content=int4:g64,rope=int4:g64", 32, 2, {2, 130, 1000}, 0});
        if (!quick) {
          run_decode_case({"content=bf16,rope=bf16", 16, 1, {5000, 37}, 3});
          // The seesaw schedule's pairs of pages: runs of 4 (whole pairs) and 5 (a last page
          // alone), a sequence's last page whole and partly filled.
          run_decode_case({"content=bf16,rope=bf16", 128, 1, {5000, 4096, 37}, 4});
          run_decode_case({"content=bf16,rope=bf16", 64, 2, {4160, 321, 2}, 5});
          // The seesaw with its L2 prefetch: every run at least kSeesawL2PrefetchMinPages pages
          // (one a sequence), a sequence's last page whole and partly filled.
          {
            const DecodeCase prefetched{"content=bf16,rope=bf16", 64, 1, {20000, 8193, 8256}, 400};
            const gpu::MlaDecodePlan plan(CacheFormat::parse(prefetched.format), prefetched.lens,
                                          prefetched.s_q, prefetched.num_heads,
                                          prefetched.pages_per_split);
            expect(plan.kernel_name() == "warpgroup" &&
                       plan.run_pages().shortest >= gpu::kSeesawL2PrefetchMinPages,
                   "the seesaw's L2-prefetch case: kernel " + plan.kernel_name() +
                       ", shortest run " + std::to_string(plan.run_pages().shortest) + " pages");
            run_decode_case(prefetched);
          }
          run_decode_case({"content=int2:g64,rope=int4:g64", 128, 1, {5000, 37}, 3});
          run_decode_case({"content=bf16,rope=bf16", 48, 2, {4097, 70, 2}, 0});
          run_decode_case({"content=int4:g64,rope=int4:g64", 128, 2, {4097, 70, 2}, 0});
          run_decode_case({"content=fp8,rope=int4:g64", 64, 1, {20000, 1}, 0});
          run_decode_case({"content=int4:g64,rope=bf16", 128, 2, {2, 130, 1000}, 0});
        }
        unsetenv("QUANTMLA_DECODE_KERNEL");
      },
      {{"--quick", &quick}});
}
