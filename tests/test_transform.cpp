// Folded content transforms are exact in full precision: the folded model gives the original
// logits (max |diff| <= 1e-4), while its cache holds the transformed latent A c.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "quantmla/error.h"
#include "quantmla/model.h"
#include "quantmla/safetensors.h"
#include "quantmla/transform.h"
#include "test_paths.h"
#include "test_seed.h"

namespace quantmla {
namespace {

using testing::bundled_model;
using testing::shared_dir;

std::vector<int32_t> reference_prompt(size_t length) {
  const auto reference =
      SafetensorsFile::open(shared_dir() / "reference/mla-tiny-short-reference.safetensors");
  std::vector<int32_t> ids = to_i32(*reference->find("input_ids"));
  ids.resize(length);
  return ids;
}

std::vector<float> logits_of(const Model& model, const std::vector<int32_t>& ids,
                             std::unique_ptr<MlaCache>* keep_cache = nullptr) {
  auto cache = model.make_cache(static_cast<int64_t>(ids.size()));
  std::vector<float> logits(ids.size() * model.config().vocab_size);
  model.forward(ids, *cache, logits);
  if (keep_cache != nullptr) *keep_cache = std::move(cache);
  return logits;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float diff = 0.0f;
  for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::abs(a[i] - b[i]));
  return diff;
}

// A random orthogonal matrix: a random-sign Hadamard times a product of random Givens rotations.
ContentTransform random_transform(int64_t n, std::mt19937_64& rng) {
  ContentTransform t = random_hadamard(n, rng());
  std::uniform_int_distribution<int64_t> index(0, n - 1);
  std::uniform_real_distribution<float> angle(0.0f, 6.2831853f), scale(0.5f, 2.0f);
  for (int g = 0; g < 4 * n; ++g) {
    const int64_t a = index(rng), b = index(rng);
    if (a == b) continue;
    const float theta = angle(rng);
    const float c = std::cos(theta), s = std::sin(theta);
    for (int64_t col = 0; col < n; ++col) {
      const float x = t.rotation[a * n + col], y = t.rotation[b * n + col];
      t.rotation[a * n + col] = c * x - s * y;
      t.rotation[b * n + col] = s * x + c * y;
    }
  }
  for (float& d : t.delta) d = scale(rng);
  return t;
}

TEST(Transform, RandomHadamardIsOrthogonal) {
  const ContentTransform t = random_hadamard(64, 3);
  for (int64_t i = 0; i < 64; ++i) {
    for (int64_t j = 0; j < 64; ++j) {
      double dot = 0.0;
      for (int64_t k = 0; k < 64; ++k) dot += t.rotation[i * 64 + k] * t.rotation[j * 64 + k];
      ASSERT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-6) << i << "," << j;
    }
  }
  EXPECT_NE(random_hadamard(64, 3).rotation, random_hadamard(64, 4).rotation);
  EXPECT_THROW(random_hadamard(48, 0), InvalidArgument);
}

TEST(Transform, FoldedHadamardKeepsLogitsAndRotatesTheCache) {
  const std::vector<int32_t> ids = reference_prompt(64);
  const Model original = Model::load(bundled_model());
  Model folded = Model::load(bundled_model());
  fold_random_hadamard(folded, 11);
  std::unique_ptr<MlaCache> original_cache, folded_cache;
  const float diff = max_abs_diff(logits_of(original, ids, &original_cache),
                                  logits_of(folded, ids, &folded_cache));
  EXPECT_LE(diff, 1e-4f);
  std::printf("[ hadamard fold ] max |logit diff| = %.3g\n", diff);

  // The cached latent of the folded model is R diag(gamma)^-1 c (delta = 1).
  const int64_t r = original.config().kv_lora_rank;
  const ContentTransform t = random_hadamard(r, 11 + 2);
  std::vector<float> c(r), c_folded(r), k_pe(64), k_pe_folded(64);
  original_cache->read_row(2, 10, c.data(), k_pe.data());
  folded_cache->read_row(2, 10, c_folded.data(), k_pe_folded.data());
  const auto gamma = to_f32(
      TensorStore::open_dir(bundled_model()).get("model.layers.2.self_attn.kv_a_layernorm.weight"));
  for (int64_t i = 0; i < r; ++i) {
    double expected = 0.0;
    for (int64_t k = 0; k < r; ++k) expected += t.rotation[i * r + k] * c[k] / gamma[k];
    ASSERT_NEAR(c_folded[i], expected, 1e-3 * (1.0 + std::abs(expected))) << i;
  }
  // The RoPE path is untouched (its inputs differ only by FP32 rounding of the earlier layers).
  for (size_t i = 0; i < k_pe.size(); ++i) EXPECT_NEAR(k_pe_folded[i], k_pe[i], 1e-4f) << i;
}

TEST(Transform, FoldedRandomOrthogonalWithScalesKeepsLogits) {
  std::mt19937_64 rng(testing::test_seed("FoldedRandomOrthogonalWithScalesKeepsLogits"));
  for (const auto& dir : {bundled_model(), shared_dir() / "models/mla-tiny-moe"}) {
    const Model original = Model::load(dir);
    Model folded = Model::load(dir);
    for (int64_t layer = 0; layer < original.config().num_layers; ++layer) {
      fold_content_transform(folded, layer, random_transform(original.config().kv_lora_rank, rng));
    }
    const std::vector<int32_t> ids = reference_prompt(48);
    const float diff = max_abs_diff(logits_of(original, ids), logits_of(folded, ids));
    EXPECT_LE(diff, 1e-4f) << dir;
  }
}

RopeTransform random_rope_transform(int64_t pairs, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> log_scale(std::log(0.5f), std::log(2.0f));
  std::uniform_real_distribution<float> angle(-3.14159265f, 3.14159265f);
  RopeTransform transform;
  for (int64_t i = 0; i < pairs; ++i) {
    transform.scales.push_back(std::exp(log_scale(rng)));
    transform.angles.push_back(angle(rng));
  }
  return transform;
}

// Per-pair scales and angles on the RoPE path (and, for mla-tiny, a content transform on top)
// leave the logits unchanged, on q_lora (V3, MoE) and q_proj (V2) models alike, while the cache
// holds M k_pe.
TEST(Transform, FoldedRopeTransformKeepsLogitsAndTransformsTheCache) {
  std::mt19937_64 rng(testing::test_seed("FoldedRopeTransformKeepsLogitsAndTransformsTheCache"));
  for (const auto& dir : {bundled_model(), shared_dir() / "models/mla-tiny-moe",
                          shared_dir() / "models/mla-tiny-v2-4k"}) {
    const Model original = Model::load(dir);
    Model folded = Model::load(dir);
    const int64_t pairs = original.config().qk_rope_head_dim / 2;
    std::vector<RopeTransform> transforms;
    for (int64_t layer = 0; layer < original.config().num_layers; ++layer) {
      transforms.push_back(random_rope_transform(pairs, rng));
      fold_rope_transform(folded, layer, transforms.back());
    }
    const bool with_content = dir == bundled_model();
    if (with_content) fold_random_hadamard(folded, 3);
    const std::vector<int32_t> ids = reference_prompt(48);
    std::unique_ptr<MlaCache> original_cache, folded_cache;
    const float diff = max_abs_diff(logits_of(original, ids, &original_cache),
                                    logits_of(folded, ids, &folded_cache));
    EXPECT_LE(diff, 1e-4f) << dir;

    const int64_t layer = original.config().num_layers - 1;
    const int64_t r = original.config().kv_lora_rank;
    std::vector<float> c(r), k_pe(2 * pairs), c_folded(r), k_pe_folded(2 * pairs);
    original_cache->read_row(layer, 20, c.data(), k_pe.data());
    folded_cache->read_row(layer, 20, c_folded.data(), k_pe_folded.data());
    for (int64_t i = 0; i < pairs; ++i) {
      const float scale = transforms[layer].scales[i], angle = transforms[layer].angles[i];
      const float a = k_pe[2 * i], b = k_pe[2 * i + 1];
      const float even = scale * (std::cos(angle) * a - std::sin(angle) * b);
      const float odd = scale * (std::sin(angle) * a + std::cos(angle) * b);
      EXPECT_NEAR(k_pe_folded[2 * i], even, 1e-3f * (1.0f + std::abs(even))) << dir << " " << i;
      EXPECT_NEAR(k_pe_folded[2 * i + 1], odd, 1e-3f * (1.0f + std::abs(odd))) << dir << " " << i;
    }
  }
}

TEST(Transform, BadRopeTransformIsRefused) {
  Model model = Model::load(shared_dir() / "models/mla-tiny-moe");
  const int64_t pairs = model.config().qk_rope_head_dim / 2;
  RopeTransform good{std::vector<float>(pairs, 1.0f), std::vector<float>(pairs, 0.0f)};
  RopeTransform short_one{std::vector<float>(pairs - 1, 1.0f), std::vector<float>(pairs - 1, 0.0f)};
  EXPECT_THROW(fold_rope_transform(model, 0, short_one), ShapeError);
  RopeTransform zero_scale = good;
  zero_scale.scales[3] = 0.0f;
  EXPECT_THROW(fold_rope_transform(model, 0, zero_scale), InvalidArgument);
  RopeTransform nan_angle = good;
  nan_angle.angles[1] = std::nanf("");
  EXPECT_THROW(fold_rope_transform(model, 0, nan_angle), InvalidArgument);
  EXPECT_THROW(fold_rope_transform(model, model.config().num_layers, good), InvalidArgument);
}

TEST(Transform, WrongSizeIsAShapeError) {
  Model model = Model::load(shared_dir() / "models/mla-tiny-moe");
  EXPECT_THROW(fold_content_transform(model, 0, random_hadamard(128, 0)), ShapeError);
  EXPECT_THROW(fold_content_transform(model, 7, random_hadamard(64, 0)), InvalidArgument);
}

}  // namespace
}  // namespace quantmla
