// BF16 matrix-vector kernels (AVX2 where available) against their scalar references.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/gemv_bf16.h"
#include "quantmla/dtype.h"
#include "test_seed.h"

namespace quantmla {
namespace {

struct Shape {
  int64_t rows, cols, ld;
};

std::vector<uint16_t> random_bf16(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> values(count);
  for (uint16_t& v : values) v = f32_to_bf16(normal(rng));
  return values;
}

std::vector<float> random_f32(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

// FP32 accumulation of k products of N(0,1) values: the sum has magnitude ~sqrt(k) and rounding
// error ~sqrt(k) * sqrt(k) * eps = k * 6e-8. 4e-7 * k (with a floor) is a wide margin that still
// catches a wrong index or a dropped tail element (errors of order 1).
float tolerance(int64_t k) { return std::max(1e-5f, 4e-7f * static_cast<float>(k)); }

class GemvBf16 : public ::testing::TestWithParam<Shape> {};

TEST_P(GemvBf16, RowsMatchReference) {
  const Shape s = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(quantmla::testing::test_seed(
      ::testing::UnitTest::GetInstance()->current_test_info()->name())));
  const auto w = random_bf16(static_cast<size_t>(s.rows * s.ld), rng);
  const auto x = random_f32(static_cast<size_t>(s.cols), rng);
  for (bool accumulate : {false, true}) {
    auto y_fast = random_f32(static_cast<size_t>(s.rows), rng);
    auto y_ref = y_fast;
    cpu::gemv_bf16(w.data(), s.ld, x.data(), y_fast.data(), s.rows, s.cols, accumulate);
    cpu::gemv_bf16_reference(w.data(), s.ld, x.data(), y_ref.data(), s.rows, s.cols, accumulate);
    for (int64_t r = 0; r < s.rows; ++r) {
      ASSERT_EQ(std::isnan(y_fast[r]), std::isnan(y_ref[r]));
      ASSERT_NEAR(y_fast[r], y_ref[r], tolerance(s.cols)) << "row " << r;
    }
  }
}

TEST_P(GemvBf16, TransposedMatchesReference) {
  const Shape s = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(quantmla::testing::test_seed(
      ::testing::UnitTest::GetInstance()->current_test_info()->name())));
  const auto w = random_bf16(static_cast<size_t>(s.rows * s.ld), rng);
  const auto x = random_f32(static_cast<size_t>(s.rows), rng);
  for (bool accumulate : {false, true}) {
    auto y_fast = random_f32(static_cast<size_t>(s.cols), rng);
    auto y_ref = y_fast;
    cpu::gemv_t_bf16(w.data(), s.ld, x.data(), y_fast.data(), s.rows, s.cols, accumulate);
    cpu::gemv_t_bf16_reference(w.data(), s.ld, x.data(), y_ref.data(), s.rows, s.cols, accumulate);
    for (int64_t c = 0; c < s.cols; ++c) {
      ASSERT_EQ(std::isnan(y_fast[c]), std::isnan(y_ref[c]));
      ASSERT_NEAR(y_fast[c], y_ref[c], tolerance(s.rows)) << "col " << c;
    }
  }
}

TEST(GemvBf16, NanPropagatesToItsRowOnly) {
  std::vector<uint16_t> w(8 * 16, f32_to_bf16(1.0f));
  w[3 * 16 + 5] = f32_to_bf16(NAN);
  std::vector<float> x(16, 1.0f), y(8, 0.0f);
  cpu::gemv_bf16(w.data(), 16, x.data(), y.data(), 8, 16, false);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(std::isnan(y[r]), r == 3) << r;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemvBf16,
                         ::testing::Values(Shape{1408, 512, 512},   // MLP gate/up
                                           Shape{512, 1408, 1408},  // MLP down
                                           Shape{64, 512, 512},     // one head of kv_b
                                           Shape{7, 13, 21},        // odd sizes, padded rows
                                           Shape{4096, 512, 512},   // lm_head
                                           Shape{1, 1, 1}));

}  // namespace
}  // namespace quantmla
