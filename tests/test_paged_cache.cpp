// Paged low-bit caches: page/slot index math, bad writes, and attention through the encoded
// records against the scalar reference on the same decoded rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <random>
#include <utility>
#include <vector>

#include "quantmla/attention.h"
#include "quantmla/cache.h"
#include "quantmla/dtype.h"
#include "quantmla/error.h"
#include "test_seed.h"

namespace quantmla {
namespace {

const CacheShape kShape{3, 512, 64};

std::vector<float> random_rows(int64_t count, int64_t width, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(count * width));
  for (float& v : values) v = normal(rng);
  return values;
}

class PagedCacheFormats : public ::testing::TestWithParam<const char*> {};

// Every position of every layer lands in its own record and reads back as decode(encode(row)),
// including a capacity that is not a multiple of the page size.
TEST_P(PagedCacheFormats, EveryPositionReadsBackItsOwnRow) {
  const CacheFormat format = CacheFormat::parse(GetParam());
  constexpr int64_t kCapacity = 3 * kPageTokens + 17;
  std::mt19937 rng(static_cast<uint32_t>(quantmla::testing::test_seed(GetParam())));
  auto cache = make_cache(kShape, format, kCapacity);
  EXPECT_EQ(cache->bytes_per_token_per_layer(),
            format.record_bytes(kShape.kv_lora_rank, kShape.rope_dim));

  std::vector<std::vector<float>> c(kShape.num_layers), k_pe(kShape.num_layers);
  for (int64_t layer = 0; layer < kShape.num_layers; ++layer) {
    c[layer] = random_rows(kCapacity, kShape.kv_lora_rank, rng);
    k_pe[layer] = random_rows(kCapacity, kShape.rope_dim, rng);
  }
  // Written in uneven chunks, layer by layer, as prefill and decode steps do.
  for (int64_t pos = 0; pos < kCapacity;) {
    const int64_t n = std::min<int64_t>(kCapacity - pos, 1 + pos % 70);
    for (int64_t layer = 0; layer < kShape.num_layers; ++layer) {
      cache->write(layer, pos, n, c[layer].data() + pos * kShape.kv_lora_rank,
                   k_pe[layer].data() + pos * kShape.rope_dim);
    }
    pos += n;
    cache->set_length(pos);
  }

  std::vector<float> expected_c(kShape.kv_lora_rank), expected_pe(kShape.rope_dim);
  std::vector<uint8_t> scratch(static_cast<size_t>(cache->bytes_per_token_per_layer()));
  std::vector<float> got_c(kShape.kv_lora_rank), got_pe(kShape.rope_dim);
  for (int64_t layer = 0; layer < kShape.num_layers; ++layer) {
    for (int64_t pos = 0; pos < kCapacity; ++pos) {
      encode_path(format.content, c[layer].data() + pos * kShape.kv_lora_rank, kShape.kv_lora_rank,
                  scratch.data());
      decode_path(format.content, scratch.data(), kShape.kv_lora_rank, expected_c.data());
      encode_path(format.rope, k_pe[layer].data() + pos * kShape.rope_dim, kShape.rope_dim,
                  scratch.data());
      decode_path(format.rope, scratch.data(), kShape.rope_dim, expected_pe.data());
      cache->read_row(layer, pos, got_c.data(), got_pe.data());
      ASSERT_EQ(got_c, expected_c) << "layer " << layer << " position " << pos;
      ASSERT_EQ(got_pe, expected_pe) << "layer " << layer << " position " << pos;
    }
  }
}

// The fast kernels (decode and tiled prefill) on the encoded records against the scalar reference
// over the same decoded rows.
TEST_P(PagedCacheFormats, AttentionMatchesReferenceOnDecodedRows) {
  const CacheFormat format = CacheFormat::parse(GetParam());
  std::mt19937 rng(static_cast<uint32_t>(quantmla::testing::test_seed(GetParam())));
  const int64_t width = kShape.row_width();
  // 1 and 3 queries take the decode kernel, 70 the prefill one; 100 from position 230 make the
  // prefill decode spans of several pages, the last one partial.
  for (const auto [n_q, pos0] :
       {std::pair<int64_t, int64_t>{1, 150}, {3, 150}, {70, 150}, {100, 230}}) {
    const int64_t keys = pos0 + n_q;
    const int64_t heads = 8;
    auto cache = make_cache(kShape, format, keys);
    const auto c = random_rows(keys, kShape.kv_lora_rank, rng);
    const auto k_pe = random_rows(keys, kShape.rope_dim, rng);
    cache->write(1, 0, keys, c.data(), k_pe.data());
    std::vector<float> decoded(static_cast<size_t>(keys * width));
    for (int64_t j = 0; j < keys; ++j) {
      cache->read_row(1, j, decoded.data() + j * width, decoded.data() + j * width + 512);
    }
    const auto q = random_rows(n_q * heads, width, rng);
    std::vector<float> out(static_cast<size_t>(n_q * heads * 512), NAN);
    std::vector<float> lse(static_cast<size_t>(n_q * heads), NAN);
    const float scale = 1.0f / std::sqrt(192.0f);
    cache->attend(1, CacheQuery{q.data(), n_q, heads, pos0, scale}, out.data(), lse.data());

    AttentionParams p;
    p.q = q.data();
    p.q_head_stride = width;
    p.q_row_stride = heads * width;
    p.kv = decoded.data();
    p.kv_row_stride = width;
    std::vector<float> out_ref(out.size()), lse_ref(lse.size());
    p.out = out_ref.data();
    p.out_head_stride = 512;
    p.out_row_stride = heads * 512;
    p.lse = lse_ref.data();
    p.n_q = n_q;
    p.num_heads = heads;
    p.kv_lora_rank = 512;
    p.rope_dim = 64;
    p.q_pos0 = pos0;
    p.softmax_scale = scale;
    attention_reference(p);
    // Same FP32-accumulation budget as test_attention: 2e-5 * sqrt(576).
    const float tolerance = 2e-5f * std::sqrt(static_cast<float>(width));
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_FALSE(std::isnan(out[i])) << i;
      ASSERT_NEAR(out[i], out_ref[i], tolerance) << "n_q " << n_q << " index " << i;
    }
    for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], lse_ref[i], tolerance) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, PagedCacheFormats,
    ::testing::Values("bf16", "content=fp8,rope=bf16", "content=int8:g64,rope=int8:g32",
                      "content=int4:g64,rope=int4:g64", "content=int4:g128:clip0.9,rope=int4:g32",
                      "content=int2:g64,rope=int4:g64", "content=q8_0,rope=q8_0",
                      "content=q4_0,rope=q4_0", "content=int4:g64,rope=int4:g64:bf16pairs=5+21",
                      "content=int2:g32:bf16pairs=3+100+255,"
                      "rope=int8:g32:clip0.9:bf16pairs=0+1+31"));

// RoPE pairs kept in BF16 come back as their BF16 roundings however large, and leave the other
// RoPE channels the int4 step of their own range.
TEST(PagedCache, KeptRopePairsReadBackAsBf16) {
  const CacheFormat format = CacheFormat::parse("content=int4:g64,rope=int4:g64:bf16pairs=5+21");
  constexpr int64_t kTokens = kPageTokens + 6;
  const int64_t kept[] = {10, 11, 42, 43};
  std::mt19937 rng(
      static_cast<uint32_t>(quantmla::testing::test_seed("KeptRopePairsReadBackAsBf16")));
  auto cache = make_cache(kShape, format, kTokens);
  const auto c = random_rows(kTokens, kShape.kv_lora_rank, rng);
  auto k_pe = random_rows(kTokens, kShape.rope_dim, rng);
  for (int64_t t = 0; t < kTokens; ++t) {
    for (const int64_t channel : kept) k_pe[static_cast<size_t>(t * 64 + channel)] *= 1000.0f;
  }
  cache->write(2, 0, kTokens, c.data(), k_pe.data());
  cache->set_length(kTokens);
  std::vector<float> got_c(512), got_pe(64);
  for (int64_t t = 0; t < kTokens; ++t) {
    cache->read_row(2, t, got_c.data(), got_pe.data());
    const float* row = k_pe.data() + t * 64;
    float low = INFINITY, high = -INFINITY;
    for (int64_t channel = 0; channel < 64; ++channel) {
      if (std::find(std::begin(kept), std::end(kept), channel) != std::end(kept)) continue;
      low = std::min(low, row[channel]);
      high = std::max(high, row[channel]);
    }
    const float half_step = 0.5f * (high - low) / 15.0f;
    for (int64_t channel = 0; channel < 64; ++channel) {
      if (std::find(std::begin(kept), std::end(kept), channel) != std::end(kept)) {
        ASSERT_EQ(got_pe[channel], bf16_to_f32(f32_to_bf16(row[channel]))) << t << " " << channel;
      } else {
        // FP16 scale and min add a few parts in 2^11 of the range.
        ASSERT_LE(std::abs(got_pe[channel] - row[channel]),
                  1.01f * half_step + 1e-3f * (high - low))
            << "token " << t << " channel " << channel;
      }
    }
  }
}

TEST(PagedCache, FullCacheAndGapsAreErrors) {
  auto cache = make_cache(kShape, CacheFormat::parse("content=int4:g64,rope=int4:g64"), 10);
  std::vector<float> c(11 * 512, 0.5f), k_pe(11 * 64, 0.25f);
  EXPECT_THROW(cache->write(0, 0, 11, c.data(), k_pe.data()), CapacityError);
  EXPECT_THROW(cache->write(0, 3, 1, c.data(), k_pe.data()), InvalidArgument);  // gap after 0
  EXPECT_THROW(cache->write(3, 0, 1, c.data(), k_pe.data()), InvalidArgument);  // no layer 3
  EXPECT_THROW(cache->set_length(11), CapacityError);
  cache->write(0, 0, 10, c.data(), k_pe.data());
  EXPECT_EQ(cache->length(), 0);  // rows are committed by set_length only
  EXPECT_THROW(make_cache(kShape, CacheFormat::f32(), 0), InvalidArgument);
}

TEST(PagedCache, PhysicalBytesCountPagesAndBlockTable) {
  const CacheFormat int4 = CacheFormat::parse("content=int4:g64,rope=int4:g64");
  // 100 tokens -> 2 pages of 64 records of 324 bytes per layer, plus 2 block-table entries.
  EXPECT_EQ(cache_physical_bytes(kShape, int4, 100), 3 * 2 * 64 * 324 + 2 * 4);
  EXPECT_EQ(cache_physical_bytes(kShape, CacheFormat::f32(), 100), 3 * 100 * 576 * 4);
  // Two kept RoPE pairs: 8 more bytes per record.
  const CacheFormat kept = CacheFormat::parse("content=int4:g64,rope=int4:g64:bf16pairs=5+21");
  EXPECT_EQ(cache_physical_bytes(kShape, kept, 100), 3 * 2 * 64 * 332 + 2 * 4);
}

}  // namespace
}  // namespace quantmla
