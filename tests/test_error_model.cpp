// The error model and the layered cache it runs on, on the bundled model.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "model_fixtures.h"
#include "quantmla/error.h"
#include "quantmla/error_model.h"
#include "quantmla/eval.h"
#include "quantmla/io.h"

namespace quantmla {
namespace {

using testing::mla_tiny;

std::vector<int32_t> wikitext_ids() {
  return read_ids_file(testing::shared_dir() / "reference/wikitext2-test.ids.i32");
}

// Per-layer caches that all have one format compute exactly what one cache of that format does.
TEST(LayeredCache, SameFormatEverywhereEqualsOneCache) {
  const Model& model = mla_tiny();
  const CacheFormat format = CacheFormat::parse("content=int4:g64,rope=int2:g32");
  const std::vector<int32_t> ids = wikitext_ids();
  const std::vector<int32_t> tokens(ids.begin(), ids.begin() + 70);
  const int64_t vocab = model.config().vocab_size;
  std::vector<float> expected(tokens.size() * vocab), actual(tokens.size() * vocab);
  auto one = model.make_cache(80, format);
  model.forward(tokens, *one, expected);
  auto layered = make_layered_cache(
      model.cache_shape(), std::vector<CacheFormat>(model.cache_shape().num_layers, format), 80);
  model.forward(tokens, *layered, actual);
  EXPECT_EQ(expected, actual);
  EXPECT_EQ(layered->bytes_per_token_per_layer(), one->bytes_per_token_per_layer());
  EXPECT_EQ(layered->length(), 70);
  EXPECT_THROW(make_layered_cache(model.cache_shape(), {format}, 80), InvalidArgument);
}

TEST(ErrorModel, ExactFormatInjectsNoError) {
  ErrorModelOptions options;
  options.ctx = 48;
  options.max_windows = 1;
  options.format = PathFormat{Codec::kF32};
  const std::vector<Injection> rows = measure_error_model(mla_tiny(), wikitext_ids(), options);
  ASSERT_EQ(rows.size(), 2u * 6 + 2);
  for (const Injection& r : rows) {
    EXPECT_EQ(r.cache_rel_error, 0.0);
    EXPECT_EQ(r.score_rms_error, 0.0);
    EXPECT_EQ(r.attention_rel_error, 0.0);
    EXPECT_EQ(r.kld_mean, 0.0);
    EXPECT_EQ(r.logit_rms_error, 0.0);
  }
}

// The every-layer rows are the plain cache-format experiment: the same KLD as evaluate_kld of
// that format against the FP32 cache on the same windows.
TEST(ErrorModel, EveryLayerRowsMatchEvaluateKld) {
  const Model& model = mla_tiny();
  const std::vector<int32_t> ids = wikitext_ids();
  ErrorModelOptions options;
  options.ctx = 64;
  options.max_windows = 2;
  options.format = PathFormat::parse("int4:g64");
  const std::vector<Injection> rows = measure_error_model(model, ids, options);
  ASSERT_EQ(rows.size(), 14u);

  KldOptions kld;
  kld.ctx = 64;
  kld.max_windows = 2;
  kld.baseline = CacheFormat::f32();
  const PathFormat exact{Codec::kF32};
  const std::vector<KldResult> reference = evaluate_kld(
      model, ids, {CacheFormat{options.format, exact}, CacheFormat{exact, options.format}}, kld);
  for (int path = 0; path < 2; ++path) {
    const Injection& every = rows[12 + path];
    EXPECT_EQ(every.layer, -1);
    // The error model traces the absorbed form of attention, evaluate_kld prefills in the
    // expanded form: equal up to summation order and the rare quantization-boundary flip it moves.
    EXPECT_NEAR(every.kld_mean, reference[path].kld_mean, 1e-3 * reference[path].kld_mean);
  }
  for (const Injection& r : rows) {
    EXPECT_GT(r.cache_rel_error, 0.0);
    EXPECT_GT(r.score_rms_error, 0.0);
    EXPECT_GT(r.attention_rel_error, 0.0);
    EXPECT_TRUE(std::isfinite(r.kld_mean) && r.kld_mean > 0.0);
    // INT4 with 15 levels per group: the relative error of a row is a few percent to ~20%.
    EXPECT_LT(r.cache_rel_error, 0.3);
  }
}

}  // namespace
}  // namespace quantmla
