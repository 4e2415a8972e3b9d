// The GPU decode kernel's host reference (tests/gpu/decode_reference.h) tested without a GPU: its
// tile values against the CPU decoder, its exact arithmetic against the scalar attention
// reference, its allowances against an FP32 stand-in for the kernel, and every mutation caught.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gpu/decode_reference.h"
#include "quantmla/attention.h"
#include "quantmla/cache_format.h"
#include "quantmla/dtype.h"
#include "quantmla/gpu_mla.h"
#include "test_seed.h"

namespace quantmla::testing {
namespace {

using gpu::kKeyDim;
using gpu::kLatentDim;
using gpu::kPageTokens;
using gpu::kRopeDim;
using Block = gpu::MlaDecodePlan::Block;

const std::vector<std::string> kGpuFormats = {
    "content=bf16,rope=bf16",
    "content=fp8,rope=bf16",
    "content=int4:g64,rope=int4:g64",
    "content=int4:g128,rope=int4:g64",
    "content=int2:g64,rope=int4:g64",
    "content=int2:g128,rope=bf16",
    "content=int4:g64:clip0.95,rope=int4:g64:bf16pairs=0+21",
};

struct Fixture {
  PagedRecords cache;
  std::vector<uint16_t> q;
};

// Records as the CPU cache writes them (random_paged_records) and random BF16 queries.
Fixture make_fixture(const std::string& spec, const std::vector<int32_t>& lens, int s_q, int heads,
                     std::mt19937_64& rng) {
  Fixture f;
  f.cache = random_paged_records(CacheFormat::parse(spec), lens, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  f.q.resize(lens.size() * s_q * heads * kKeyDim);
  for (uint16_t& v : f.q) v = f32_to_bf16(normal(rng));
  return f;
}

// The blocks of a plan: 16-row tiles of s_q x heads, each sequence's pages in runs of
// `pages_per_run` (0: one run), partial when a sequence has more than one run, each block's steps
// dealt to `chains` online-softmax chains.
std::vector<Block> make_blocks(const std::vector<int32_t>& lens, int s_q, int heads,
                               int pages_per_run, int chains = 1) {
  std::vector<Block> blocks;
  for (size_t b = 0; b < lens.size(); ++b) {
    const int pages = (lens[b] + kPageTokens - 1) / kPageTokens;
    const int run = pages_per_run == 0 ? pages : pages_per_run;
    for (int row = 0; row < s_q * heads; row += 16) {
      for (int first = 0; first < pages; first += run) {
        blocks.push_back({static_cast<int>(b), row, 16, first, std::min(first + run, pages),
                          run < pages, chains});
      }
    }
  }
  return blocks;
}

std::vector<uint16_t> to_bf16(const std::vector<double>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) bits[i] = f32_to_bf16(static_cast<float>(v[i]));
  return bits;
}
std::vector<float> to_f32(const std::vector<double>& v) { return {v.begin(), v.end()}; }

std::mt19937_64 seeded(const char* test) { return std::mt19937_64(test_seed(test)); }

TEST(DecodeReference, KernelValuesAreTheDecodedValuesInBf16) {
  std::mt19937_64 rng = seeded("KernelValuesAreTheDecodedValuesInBf16");
  for (const std::string& spec : kGpuFormats) {
    const Fixture f = make_fixture(spec, {200}, 1, 16, rng);
    double worst = 0.0;
    for (int pos = 0; pos < 200; ++pos) {
      const uint8_t* rec = f.cache.record(0, pos);
      for (const bool rope : {false, true}) {
        const PathFormat& path = rope ? f.cache.format.rope : f.cache.format.content;
        const int width = rope ? kRopeDim : kLatentDim;
        const uint8_t* at = rope ? rec + f.cache.content_bytes : rec;
        std::vector<float> kernel(width), cpu(width);
        kernel_path_values(path, at, width, kernel.data());
        decode_path(path, at, width, cpu.data());
        double largest = 0.0;
        for (const float v : cpu) largest = std::max<double>(largest, std::fabs(v));
        // BF16 scale and min (a unit each of |range| <= 2 max and |min| <= max) and the result.
        const double bound = path.codec == Codec::kBF16  ? 0.0
                             : path.codec == Codec::kFP8 ? 0x1.0p-8 * largest
                                                         : 4 * 0x1.0p-8 * largest;
        for (int i = 0; i < width; ++i) {
          const double err = std::fabs(static_cast<double>(kernel[i]) - cpu[i]);
          ASSERT_LE(err, bound) << spec << (rope ? " rope" : " content") << " channel " << i;
          if (bound > 0.0) worst = std::max(worst, err / bound);
          ASSERT_EQ(static_cast<double>(bf16_to_f32(f32_to_bf16(kernel[i]))), kernel[i])
              << "not a BF16 value";
        }
      }
    }
    std::printf("%-56s worst err / bound %.3f\n", spec.c_str(), worst);
  }
}

// The seesaw schedule's roundings (kBf16TileScaledPairs) against the page schedule's: the left
// half of the channels and the log-sum-exps are the same to the bit; the right half differs (a
// pair's first page's P rounded after the rescale to the second's maximum) by no more than a
// BF16 rounding of each such P, and not at all in runs of one page, whose pages have no pair.
TEST(DecodeReference, ScaledPairsMoveOnlyTheRightHalfOfPairedRuns) {
  std::mt19937_64 rng = seeded("ScaledPairsMoveOnlyTheRightHalfOfPairedRuns");
  const int s_q = 1, heads = 64;
  const std::vector<int32_t> lens = {640, 130, 1};
  const float scale = 1.0f / std::sqrt(192.0f);
  const Fixture f = make_fixture("content=bf16,rope=bf16", lens, s_q, heads, rng);
  for (const int pages_per_run : {0, 1, 3}) {
    const std::vector<Block> blocks = make_blocks(lens, s_q, heads, pages_per_run);
    const FaithfulResult pages =
        faithful_decode(f.cache, f.q, s_q, heads, scale, blocks, 64, Mutation::kNone,
                        Arithmetic::kExact, Operands::kBf16Tile);
    const FaithfulResult pairs =
        faithful_decode(f.cache, f.q, s_q, heads, scale, blocks, 64, Mutation::kNone,
                        Arithmetic::kExact, Operands::kBf16TileScaledPairs);
    ASSERT_EQ(pages.out.size(), pairs.out.size());
    int moved = 0;
    for (size_t i = 0; i < pages.out.size(); ++i) {
      const bool right = i % kLatentDim >= kLatentDim / 2;
      if (!right || pages_per_run == 1) {
        ASSERT_EQ(pages.out[i], pairs.out[i]) << "runs of " << pages_per_run << ", output " << i;
        continue;
      }
      // Each weight moves by at most half a BF16 ulp of the rescaled P over the rescale: 2^-8
      // of it, and |out| <= max |v| with weights summing to 1.
      EXPECT_LE(std::fabs(pages.out[i] - pairs.out[i]), 0x1.0p-8 * 8.0)
          << "runs of " << pages_per_run << ", output " << i;
      moved += pages.out[i] != pairs.out[i];
    }
    for (size_t r = 0; r < pages.lse.size(); ++r) ASSERT_EQ(pages.lse[r], pairs.lse[r]);
    std::printf("runs of %d pages: %d of %zu outputs moved\n", pages_per_run, moved,
                pages.out.size());
    if (pages_per_run != 1) EXPECT_GT(moved, 0) << "no paired run moved";
  }
}

// A block's chains (the transposed kernel's converting form: its two warpgroups take every other
// page) are runs of every other step merged as the combine merges runs: with at most two pages a
// sequence they are the runs of one page each, to the bit; with more they move each output by no
// more than a BF16 rounding of each P (taken against another running maximum) and the
// log-sum-exps (sums of the unrounded P, FP32 values) by FP32 roundings only.
TEST(DecodeReference, ChainsAreRunsOfEveryOtherStep) {
  std::mt19937_64 rng = seeded("ChainsAreRunsOfEveryOtherStep");
  const int s_q = 1, heads = 16;
  const float scale = 1.0f / std::sqrt(192.0f);
  const auto decode = [&](const Fixture& f, const std::vector<int32_t>& lens, int pages_per_run,
                          int chains) {
    return faithful_decode(f.cache, f.q, s_q, heads, scale,
                           make_blocks(lens, s_q, heads, pages_per_run, chains), 64);
  };
  const std::vector<int32_t> short_lens = {1, 64, 100, 128};
  const Fixture short_fixture =
      make_fixture("content=int4:g64,rope=int4:g64", short_lens, s_q, heads, rng);
  const FaithfulResult chained = decode(short_fixture, short_lens, 0, 2);
  const FaithfulResult pages = decode(short_fixture, short_lens, 1, 1);
  ASSERT_EQ(chained.out, pages.out);
  ASSERT_EQ(chained.lse, pages.lse);

  const std::vector<int32_t> lens = {700, 300};
  const Fixture f = make_fixture("content=int4:g64,rope=int4:g64", lens, s_q, heads, rng);
  const FaithfulResult two = decode(f, lens, 0, 2), one = decode(f, lens, 0, 1);
  ASSERT_EQ(two.out.size(), one.out.size());
  int moved = 0;
  for (size_t i = 0; i < one.out.size(); ++i) {
    EXPECT_LE(std::fabs(two.out[i] - one.out[i]), 0x1.0p-8 * 8.0) << "output " << i;
    moved += two.out[i] != one.out[i];
  }
  for (size_t r = 0; r < one.lse.size(); ++r) EXPECT_NEAR(two.lse[r], one.lse[r], 1e-6);
  std::printf("two chains: %d of %zu outputs moved\n", moved, one.out.size());
  EXPECT_GT(moved, 0) << "the chains took the steps of one";
}

// The exact reference against attention_reference over the same key values (the tile's BF16
// values; for FP16 code operands the decoded values, which the kernel uses unrounded): only the
// rounding of P (a relative 2^-8 per weight in BF16, 2^-11 in FP16) parts them.
TEST(DecodeReference, ExactArithmeticIsAttentionWithProbabilitiesRounded) {
  std::mt19937_64 rng = seeded("ExactArithmeticIsAttentionWithProbabilitiesRounded");
  const int s_q = 2, heads = 16;
  const std::vector<int32_t> lens = {2, 65, 300};
  const float scale = 1.0f / std::sqrt(192.0f);
  const std::pair<const char*, Operands> cases[] = {
      {"content=int4:g64,rope=int4:g64", Operands::kBf16Tile},
      {"content=int4:g64,rope=int4:g64", Operands::kFp16Codes},
      {"content=fp8,rope=bf16", Operands::kFp16Codes}};
  for (const auto& [spec, operands] : cases) {
    const Fixture f = make_fixture(spec, lens, s_q, heads, rng);
    const bool codes = operands == Operands::kFp16Codes;
    const FaithfulResult ref =
        faithful_decode(f.cache, f.q, s_q, heads, scale, make_blocks(lens, s_q, heads, 2),
                        codes ? 64 : 32, Mutation::kNone, Arithmetic::kExact, operands);
    for (size_t b = 0; b < lens.size(); ++b) {
      std::vector<float> keys(static_cast<size_t>(lens[b]) * kKeyDim);
      double largest = 0.0;
      for (int pos = 0; pos < lens[b]; ++pos) {
        float* row = keys.data() + static_cast<size_t>(pos) * kKeyDim;
        const uint8_t* rec = f.cache.record(static_cast<int>(b), pos);
        if (codes) {
          decode_path(f.cache.format.content, rec, kLatentDim, row);
        } else {
          kernel_path_values(f.cache.format.content, rec, kLatentDim, row);
        }
        kernel_path_values(f.cache.format.rope, rec + f.cache.content_bytes, kRopeDim,
                           row + kLatentDim);
        for (int d = 0; d < kLatentDim; ++d) largest = std::max<double>(largest, std::fabs(row[d]));
      }
      std::vector<float> q(static_cast<size_t>(s_q) * heads * kKeyDim);
      for (size_t i = 0; i < q.size(); ++i) q[i] = bf16_to_f32(f.q[b * q.size() + i]);
      std::vector<float> out(static_cast<size_t>(s_q) * heads * kLatentDim), lse(s_q * heads);
      AttentionParams p;
      p.q = q.data(), p.q_row_stride = heads * kKeyDim, p.q_head_stride = kKeyDim;
      p.kv = keys.data(), p.kv_row_stride = kKeyDim;
      p.out = out.data(), p.out_row_stride = heads * kLatentDim, p.out_head_stride = kLatentDim;
      p.lse = lse.data();
      p.n_q = s_q, p.num_heads = heads, p.kv_lora_rank = kLatentDim, p.rope_dim = kRopeDim;
      p.q_pos0 = lens[b] - s_q, p.softmax_scale = scale;
      attention_reference(p);
      const size_t first = b * s_q * heads;
      for (size_t r = 0; r < static_cast<size_t>(s_q * heads); ++r) {
        // FP16 code operands: the sum adds the rounded P (2^-11 of each weight at most).
        EXPECT_NEAR(ref.lse[first + r], lse[r],
                    codes ? 0x1.0p-11 : 1e-5 * (1.0 + std::fabs(lse[r])));
        for (int d = 0; d < kLatentDim; ++d) {
          ASSERT_NEAR(ref.out[(first + r) * kLatentDim + d], out[r * kLatentDim + d],
                      0x1.0p-8 * largest + 1e-6)
              << "sequence " << b << " row " << r << " channel " << d << " operands "
              << static_cast<int>(operands);
        }
      }
    }
  }
}

// An FP32 stand-in for the kernel (every sum rounded to FP32 after each addition, exp2f) must sit
// within the allowances, with split runs, half-page and whole-page steps, 16 and 32 rows.
TEST(DecodeReference, AnFp32KernelPassesTheComparison) {
  std::mt19937_64 rng = seeded("AnFp32KernelPassesTheComparison");
  struct Case {
    std::string spec;
    int s_q, heads;
    std::vector<int32_t> lens;
    int pages_per_run, step_keys;
    Operands operands = Operands::kBf16Tile;
    int chains = 1;
  };
  const Case cases[] = {
      {"content=int4:g64,rope=int4:g64", 1, 16, {1, 63, 65, 300}, 0, 32},
      {"content=int4:g128,rope=bf16", 1, 16, {1, 65, 130, 700}, 0, 64, Operands::kBf16Tile, 2},
      {"content=int4:g64,rope=int4:g64", 1, 16, {200, 700}, 3, 64, Operands::kBf16Tile, 2},
      {"content=int2:g64,rope=int4:g64", 2, 16, {2, 130, 700}, 3, 32},
      {"content=fp8,rope=bf16", 1, 32, {64, 500}, 2, 64},
      {"content=bf16,rope=bf16", 2, 16, {1000}, 0, 64},
      {"content=bf16,rope=bf16", 1, 64, {1, 300, 640}, 3, 64, Operands::kBf16TileScaledPairs},
      {"content=int4:g64,rope=int4:g64", 1, 16, {1, 63, 65, 300}, 0, 64, Operands::kFp16Codes},
      {"content=int2:g64,rope=bf16", 2, 16, {2, 130, 700}, 3, 64, Operands::kFp16Codes},
      {"content=int4:g64:clip0.95,rope=int4:g64:bf16pairs=0+21",
       1,
       16,
       {500},
       2,
       64,
       Operands::kFp16Codes},
      {"content=fp8,rope=bf16", 2, 16, {2, 130, 700}, 3, 64, Operands::kFp16Codes},
      {"content=fp8,rope=int4:g64:bf16pairs=21",
       1,
       16,
       {1, 63, 65, 300},
       0,
       64,
       Operands::kFp16Codes},
  };
  for (const Case& c : cases) {
    const Fixture f = make_fixture(c.spec, c.lens, c.s_q, c.heads, rng);
    const std::vector<Block> blocks =
        make_blocks(c.lens, c.s_q, c.heads, c.pages_per_run, c.chains);
    const float scale = 1.0f / std::sqrt(192.0f);
    const FaithfulResult exact =
        faithful_decode(f.cache, f.q, c.s_q, c.heads, scale, blocks, c.step_keys, Mutation::kNone,
                        Arithmetic::kExact, c.operands);
    const FaithfulResult fp32 =
        faithful_decode(f.cache, f.q, c.s_q, c.heads, scale, blocks, c.step_keys, Mutation::kNone,
                        Arithmetic::kFp32, c.operands);
    const FaithfulComparison cmp = compare_faithful(to_bf16(fp32.out), to_f32(fp32.lse), exact);
    std::printf(
        "%-40s s_q %d H %d operands %d chains %d: err/allowed max %.3f RMS %.4f lse %.3f, %d "
        "of %zu equal\n",
        c.spec.c_str(), c.s_q, c.heads, static_cast<int>(c.operands), c.chains, cmp.worst, cmp.rms,
        cmp.worst_lse, cmp.exact, exact.out.size());
    EXPECT_EQ(cmp.nan, 0);
    EXPECT_LE(cmp.worst, 1.0) << c.spec;
    EXPECT_LE(cmp.rms, kFaithfulRms) << c.spec;
    EXPECT_LE(cmp.worst_lse, 1.0) << c.spec;
  }
}

// Each mutation (a kernel bug the reference plays) must fail the comparison with the unmutated
// reference; no mutation passes it.
TEST(DecodeReference, EveryMutationFailsTheComparison) {
  std::mt19937_64 rng = seeded("EveryMutationFailsTheComparison");
  const std::vector<int32_t> lens = {66, 200};
  const int s_q = 2, heads = 16;
  const float scale = 1.0f / std::sqrt(192.0f);
  const std::vector<Block> blocks = make_blocks(lens, s_q, heads, 0);
  const std::pair<const char*, Operands> cases[] = {
      {"content=int4:g64,rope=int4:g64", Operands::kBf16Tile},
      {"content=fp8,rope=bf16", Operands::kBf16Tile},
      {"content=bf16,rope=bf16", Operands::kBf16Tile},
      {"content=int4:g64,rope=int4:g64", Operands::kFp16Codes},
      {"content=int2:g64,rope=bf16", Operands::kFp16Codes},
      {"content=fp8,rope=int4:g64", Operands::kFp16Codes}};
  for (const auto& [spec, operands] : cases) {
    Fixture f = make_fixture(spec, lens, s_q, heads, rng);
    aim_row0_at_mutated_keys(f.cache, f.q);
    const int step = operands == Operands::kFp16Codes ? 64 : 32;
    const FaithfulResult ref = faithful_decode(f.cache, f.q, s_q, heads, scale, blocks, step,
                                               Mutation::kNone, Arithmetic::kExact, operands);
    for (const Mutation m : {Mutation::kNone, Mutation::kGroupScale, Mutation::kWrongPage,
                             Mutation::kDroppedKey, Mutation::kCausal}) {
      if (m == Mutation::kGroupScale && f.cache.format.content.codec == Codec::kBF16) continue;
      const FaithfulResult mutated = faithful_decode(f.cache, f.q, s_q, heads, scale, blocks, step,
                                                     m, Arithmetic::kExact, operands);
      const FaithfulComparison cmp =
          compare_faithful(to_bf16(mutated.out), to_f32(mutated.lse), ref);
      const bool passes = cmp.nan == 0 && cmp.worst <= 1.0 && cmp.rms <= kFaithfulRms;
      std::printf("%-40s operands %d mutation %d: err/allowed max %.3g RMS %.3g\n", spec,
                  static_cast<int>(operands), static_cast<int>(m), cmp.worst, cmp.rms);
      EXPECT_EQ(passes, m == Mutation::kNone) << spec << " mutation " << static_cast<int>(m);
    }
  }
}

// Fp8 code operands: a token's outputs in a prefill chunk are its decode steps' to the bit, even
// where a key that only the chunk's last token sees has far the largest scales: E, the FP16
// operand's exponent, counts only the keys that some row of the 16-row tile (one token's heads)
// sees. Counted over the sequence's keys, E would shift the other tokens' P scale products into
// FP16's subnormals and round them differently (what the GPU kernel did until 2026-12-06).
TEST(DecodeReference, Fp8ChunkRowsAreTheirDecodeSteps) {
  std::mt19937_64 rng = seeded("Fp8ChunkRowsAreTheirDecodeSteps");
  const int heads = 16, chunk = 8;
  const float scale = 1.0f / std::sqrt(192.0f);
  for (const int first_len : {1, 60}) {  // 60: the chunk across a page boundary
    const int len = first_len + chunk - 1;
    Fixture f = make_fixture("content=fp8,rope=bf16", {len}, chunk, heads, rng);
    scale_fp8_record(f.cache.record(0, len - 1), 1024.0f);  // the last key's scales 2^10 larger
    const FaithfulResult in_chunk =
        faithful_decode(f.cache, f.q, chunk, heads, scale, make_blocks({len}, chunk, heads, 0), 64,
                        Mutation::kNone, Arithmetic::kExact, Operands::kFp16Codes);
    const size_t token_outputs = static_cast<size_t>(heads) * kLatentDim;
    for (int i = 0; i < chunk; ++i) {
      PagedRecords alone = f.cache;
      alone.lens = {first_len + i};
      const auto q_begin = f.q.begin() + static_cast<ptrdiff_t>(i) * heads * kKeyDim;
      const std::vector<uint16_t> q(q_begin, q_begin + heads * kKeyDim);
      const FaithfulResult step =
          faithful_decode(alone, q, 1, heads, scale, make_blocks(alone.lens, 1, heads, 0), 64,
                          Mutation::kNone, Arithmetic::kExact, Operands::kFp16Codes);
      int differing = 0;
      for (size_t j = 0; j < token_outputs; ++j) {
        differing += in_chunk.out[i * token_outputs + j] != step.out[j];
      }
      EXPECT_EQ(differing, 0) << "length " << first_len + i << ": outputs differ from the chunk's";
      for (int h = 0; h < heads; ++h) EXPECT_EQ(in_chunk.lse[i * heads + h], step.lse[h]);
    }
  }
}

}  // namespace
}  // namespace quantmla::testing
