// Fast absorbed attention against the scalar reference on fresh random inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "quantmla/attention.h"
#include "test_seed.h"

namespace quantmla {
namespace {

struct Case {
  int64_t n_q, num_heads, kv_lora_rank, rope_dim, q_pos0;
};

// Keys handed out tile by tile, as a compressed cache does; here the "decoding" is a copy.
struct KeyTable {
  const float* rows;
  int64_t width;
};
void copy_keys(const void* context, int64_t first, int64_t count, float* rows) {
  const auto* table = static_cast<const KeyTable*>(context);
  std::copy_n(table->rows + first * table->width, count * table->width, rows);
}

class AttentionVsReference : public ::testing::TestWithParam<std::tuple<Case, bool>> {};

TEST_P(AttentionVsReference, SameOutputAndLse) {
  const auto [c, tiled_keys] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(quantmla::testing::test_seed(
      ::testing::UnitTest::GetInstance()->current_test_info()->name())));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t width = c.kv_lora_rank + c.rope_dim;
  const int64_t num_keys = c.q_pos0 + c.n_q;
  std::vector<float> q(c.n_q * c.num_heads * width), kv(num_keys * width);
  for (float& v : q) v = normal(rng);
  for (float& v : kv) v = normal(rng);

  const size_t out_size = c.n_q * c.num_heads * c.kv_lora_rank;
  std::vector<float> out_fast(out_size, NAN), out_ref(out_size, NAN);
  std::vector<float> lse_fast(c.n_q * c.num_heads, NAN), lse_ref(c.n_q * c.num_heads, NAN);
  AttentionParams p;
  p.q = q.data();
  p.q_head_stride = width;
  p.q_row_stride = c.num_heads * width;
  p.kv = kv.data();
  p.kv_row_stride = width;
  p.out_head_stride = c.kv_lora_rank;
  p.out_row_stride = c.num_heads * c.kv_lora_rank;
  p.n_q = c.n_q;
  p.num_heads = c.num_heads;
  p.kv_lora_rank = c.kv_lora_rank;
  p.rope_dim = c.rope_dim;
  p.q_pos0 = c.q_pos0;
  p.softmax_scale = 1.0f / std::sqrt(static_cast<float>(width));
  const KeyTable table{kv.data(), width};
  if (tiled_keys) {
    p.kv = nullptr;
    p.decode_keys = copy_keys;
    p.decode_context = &table;
  }

  p.out = out_ref.data();
  p.lse = lse_ref.data();
  attention_reference(p);
  p.out = out_fast.data();
  p.lse = lse_fast.data();
  attention_f32(p);

  // FP32 accumulation over `width` products of N(0,1) values: relative error ~ sqrt(width) * eps
  // on logits of size ~sqrt(width) * scale; outputs are convex combinations of N(0,1) values.
  const float tolerance = 2e-5f * std::sqrt(static_cast<float>(width));
  float max_out_diff = 0.0f, max_lse_diff = 0.0f;
  for (size_t i = 0; i < out_size; ++i) {
    ASSERT_EQ(std::isnan(out_fast[i]), std::isnan(out_ref[i])) << "index " << i;
    max_out_diff = std::max(max_out_diff, std::abs(out_fast[i] - out_ref[i]));
  }
  for (size_t i = 0; i < lse_ref.size(); ++i) {
    max_lse_diff = std::max(max_lse_diff, std::abs(lse_fast[i] - lse_ref[i]));
  }
  EXPECT_LE(max_out_diff, tolerance);
  EXPECT_LE(max_lse_diff, tolerance);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionVsReference,
    ::testing::Combine(::testing::Values(Case{1, 8, 512, 64, 0},     // first decode step
                                         Case{1, 16, 512, 64, 700},  // decode, long cache
                                         Case{130, 8, 512, 64, 0},   // prefill, 3 blocks
                                         Case{37, 4, 64, 32, 91},    // chunked prefill
                                         Case{300, 2, 64, 32, 250},  // key spans across blocks
                                         Case{5, 3, 32, 8, 2},
                                         Case{3, 6, 64, 16, 40},      // decode kernel, 4 + 2 heads
                                         Case{2, 128, 512, 64, 300},  // production head count
                                         Case{1, 3, 32, 16, 10},      // odd head group
                                         Case{1, 1, 512, 64, 0}),
                       ::testing::Bool()));

}  // namespace
}  // namespace quantmla
