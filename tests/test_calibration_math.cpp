// Calibration's hand-derived gradients against finite differences, the Cayley retraction, and the
// RoPE problem against a direct evaluation of its defining sum, on small random layers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "calib/content_learn.h"
#include "calib/content_objective.h"
#include "calib/layer_data.h"
#include "calib/rope_search.h"
#include "kernels/cpu/ops.h"

namespace quantmla::calib {
namespace {

struct RandomLayer {
  LayerGeometry geometry;
  LayerWindow window;
};

std::vector<float> random_vector(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

RandomLayer make_layer(uint32_t seed, int64_t length = 24) {
  std::mt19937 rng(seed);
  RandomLayer layer;
  LayerGeometry& g = layer.geometry;
  g.heads = 3, g.rank = 32, g.rope_dim = 32, g.v_dim = 4, g.softmax_scale = 0.35f;
  g.w_uv = random_vector(rng, g.heads * g.v_dim * g.rank, 0.3f);
  g.gamma = random_vector(rng, g.rank, 1.0f);
  for (float& x : g.gamma) x = 0.5f + std::abs(x);
  LayerWindow& w = layer.window;
  w.length = length;
  w.queries = random_vector(rng, length * g.query_stride(), 0.4f);
  w.latents = random_vector(rng, length * g.rank, 1.0f);
  w.rope_keys = random_vector(rng, length * g.rope_dim, 1.0f);
  return layer;
}

TEST(ContentObjective, GradientMatchesFiniteDifferences) {
  struct Case {
    ContentObjective objective;
    int64_t max_queries;  // 0: every position; 7 of 24: sampled query rows
  };
  for (const Case& c : {Case{ContentObjective::kOutput, 0}, Case{ContentObjective::kOutput, 7},
                        Case{ContentObjective::kMse, 0}}) {
    const ContentObjective objective = c.objective;
    RandomLayer layer = make_layer(3);
    const LayerGeometry& g = layer.geometry;
    std::mt19937 rng(11);
    // The rope keys attention reads are perturbed (the RoPE path in a quantized state).
    std::vector<float> rope_keys = layer.window.rope_keys;
    for (float& x : rope_keys) x += 0.05f * std::normal_distribution<float>()(rng);
    const ContentTarget target =
        make_content_target(objective, layer.window, g, rope_keys.data(), c.max_queries);
    std::vector<float> latents = layer.window.latents;
    for (float& x : latents) x += 0.1f * std::normal_distribution<float>()(rng);

    std::vector<float> grad(latents.size());
    content_loss(objective, layer.window, g, target, latents.data(), grad.data());
    for (int trial = 0; trial < 6; ++trial) {
      const std::vector<float> direction = random_vector(rng, latents.size(), 1.0f);
      double predicted = 0.0;
      for (size_t i = 0; i < latents.size(); ++i) predicted += grad[i] * direction[i];
      const auto loss_at = [&](float t) {
        std::vector<float> moved = latents;
        for (size_t i = 0; i < moved.size(); ++i) moved[i] += t * direction[i];
        return content_loss(objective, layer.window, g, target, moved.data(), nullptr);
      };
      // Central differences at h and h/2 with Richardson extrapolation: O(h^4) truncation.
      const auto central = [&](float h) { return (loss_at(h) - loss_at(-h)) / (2.0 * h); };
      const float h = 1e-2f;
      const double measured = (4.0 * central(h / 2) - central(h)) / 3.0;
      EXPECT_NEAR(measured, predicted, 2e-3 * std::abs(predicted) + 1e-4)
          << to_string(objective) << " queries " << c.max_queries << " trial " << trial;
    }
  }
}

TEST(ContentObjective, PositionsAreEvenlySpacedAndEndAtTheLastToken) {
  for (int64_t length = 1; length <= 200; ++length) {
    EXPECT_TRUE(objective_positions(length, 0).empty());
    EXPECT_TRUE(objective_positions(length, length).empty());
    EXPECT_TRUE(objective_positions(length, length + 5).empty());
    for (int64_t m = 1; m < length; ++m) {
      const std::vector<int64_t> positions = objective_positions(length, m);
      ASSERT_EQ(static_cast<int64_t>(positions.size()), m) << length;
      EXPECT_EQ(positions.back(), length - 1);
      EXPECT_GE(positions.front(), 0);
      const int64_t widest = (length + m - 1) / m;  // gaps are floor or ceil of L / m
      for (size_t i = 1; i < positions.size(); ++i) {
        const int64_t gap = positions[i] - positions[i - 1];
        ASSERT_GE(gap, length / m) << length << " " << m;
        ASSERT_LE(gap, widest) << length << " " << m;
      }
    }
  }
}

// The sampled output objective is the defining sum over the chosen rows: softmax attention of
// each sampled query over all keys up to it, through W_UV, against the exact cache's outputs.
TEST(ContentObjective, SampledOutputLossEqualsTheDefiningSum) {
  RandomLayer layer = make_layer(5, 40);
  const LayerGeometry& g = layer.geometry;
  const LayerWindow& w = layer.window;
  std::mt19937 rng(17);
  std::vector<float> latents = w.latents;
  for (float& x : latents) x += 0.1f * std::normal_distribution<float>()(rng);
  const ContentTarget target =
      make_content_target(ContentObjective::kOutput, w, g, w.rope_keys.data(), 9);
  ASSERT_EQ(target.positions.size(), 9u);

  const auto output = [&](const std::vector<float>& c, int64_t t, int64_t h, int64_t e) {
    const float* q = w.queries.data() + t * g.query_stride() + h * g.query_width();
    std::vector<double> scores(static_cast<size_t>(t + 1));
    double peak = -1e300, sum = 0.0, out = 0.0;
    for (int64_t j = 0; j <= t; ++j) {
      double s = 0.0;
      for (int64_t i = 0; i < g.rank; ++i) s += static_cast<double>(q[i]) * c[j * g.rank + i];
      for (int64_t i = 0; i < g.rope_dim; ++i) {
        s += static_cast<double>(q[g.rank + i]) * w.rope_keys[j * g.rope_dim + i];
      }
      scores[j] = g.softmax_scale * s;
      peak = std::max(peak, scores[j]);
    }
    for (int64_t j = 0; j <= t; ++j) sum += std::exp(scores[j] - peak);
    for (int64_t j = 0; j <= t; ++j) {
      double value = 0.0;  // (W_UV,h c_j)_e
      for (int64_t i = 0; i < g.rank; ++i) {
        value += static_cast<double>(g.w_uv[(h * g.v_dim + e) * g.rank + i]) * c[j * g.rank + i];
      }
      out += std::exp(scores[j] - peak) / sum * value;
    }
    return out;
  };
  double expected = 0.0;
  for (int64_t t : target.positions) {
    for (int64_t h = 0; h < g.heads; ++h) {
      for (int64_t e = 0; e < g.v_dim; ++e) {
        const double diff = output(latents, t, h, e) - output(w.latents, t, h, e);
        expected += diff * diff;
      }
    }
  }
  const double measured =
      content_loss(ContentObjective::kOutput, w, g, target, latents.data(), nullptr);
  EXPECT_NEAR(measured, expected, 1e-3 * expected);  // FP32 outputs against FP64
}

std::vector<float> random_skew(std::mt19937& rng, int64_t n, float scale) {
  std::vector<float> a = random_vector(rng, static_cast<size_t>(n * n), scale);
  std::vector<float> skew(a.size());
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) skew[i * n + j] = a[i * n + j] - a[j * n + i];
  }
  return skew;
}

TEST(ContentLearn, CayleyStepStaysOrthogonalAndMovesAlongMinusWR) {
  std::mt19937 rng(5);
  const int64_t n = 32;
  std::vector<float> rotation = random_hadamard(n, 9).rotation;
  const std::vector<float> skew = random_skew(rng, n, 0.1f);
  std::vector<float> w_r(static_cast<size_t>(n * n));
  cpu::matmul_nn(skew.data(), n, rotation.data(), n, w_r.data(), n, n, n, n);
  const float step = 1e-3f;
  std::vector<float> moved = rotation;
  cayley_step(moved, skew, step, n);
  for (size_t i = 0; i < moved.size(); ++i) {
    // First order: R(a) = R - a W R + O(a^2).
    EXPECT_NEAR((moved[i] - rotation[i]) / step, -w_r[i], 2e-3f) << i;
  }
  for (int i = 0; i < 50; ++i) cayley_step(moved, skew, 0.3f, n);
  EXPECT_LT(orthogonality_error(moved, n), 1e-5f);
}

TEST(ContentLearn, StraightThroughRotationGradientMatchesFiniteDifferences) {
  RandomLayer layer = make_layer(8);
  const LayerGeometry& g = layer.geometry;
  const int64_t r = g.rank, n = layer.window.length;
  const PathFormat format = PathFormat::parse("int4:g32");
  const ContentTarget target = make_content_target(ContentObjective::kOutput, layer.window, g,
                                                   layer.window.rope_keys.data());
  ContentTransform transform = random_hadamard(r, 4);
  std::mt19937 rng(2);
  for (float& d : transform.delta) d = std::exp(0.3f * std::normal_distribution<float>()(rng));

  std::vector<float> quantized(static_cast<size_t>(n * r)), step_error(quantized.size());
  quantize_latents(format, g, transform, layer.window.latents.data(), n, quantized.data(),
                   step_error.data());
  std::vector<float> grad_latents(quantized.size()), grad_rotation(static_cast<size_t>(r * r));
  content_loss(ContentObjective::kOutput, layer.window, g, target, quantized.data(),
               grad_latents.data());
  rotation_gradient(g, step_error.data(), grad_latents.data(), n, grad_rotation.data());

  // The surrogate the estimator differentiates: the rounding error eps held fixed,
  // c~(R) = c + gamma * R^T eps, along the curve R(t) on the orthogonal group with R'(0) = W R.
  const auto surrogate = [&](const std::vector<float>& rotation) {
    std::vector<float> latents(quantized.size());
    cpu::matmul_nn(step_error.data(), r, rotation.data(), r, latents.data(), r, n, r, r);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t i = 0; i < r; ++i) {
        latents[j * r + i] = layer.window.latents[j * r + i] + g.gamma[i] * latents[j * r + i];
      }
    }
    return content_loss(ContentObjective::kOutput, layer.window, g, target, latents.data(),
                        nullptr);
  };
  for (int trial = 0; trial < 4; ++trial) {
    const std::vector<float> skew = random_skew(rng, r, 1.0f);
    std::vector<float> w_r(static_cast<size_t>(r * r));
    cpu::matmul_nn(skew.data(), r, transform.rotation.data(), r, w_r.data(), r, r, r, r);
    double predicted = 0.0;
    for (size_t i = 0; i < w_r.size(); ++i) predicted += grad_rotation[i] * w_r[i];
    const float h = 1e-3f;
    std::vector<float> forward = transform.rotation, backward = transform.rotation;
    cayley_step(forward, skew, -h, r);  // derivative -(-W) R = W R
    cayley_step(backward, skew, h, r);
    const double measured = (surrogate(forward) - surrogate(backward)) / (2.0 * h);
    EXPECT_NEAR(measured, predicted, 5e-3 * std::abs(predicted) + 1e-4) << "trial " << trial;
  }
}

TEST(ContentLearn, IdentityTransformIsTheCodecRoundTrip) {
  RandomLayer layer = make_layer(4);
  const LayerGeometry& g = layer.geometry;
  const int64_t r = g.rank, n = layer.window.length;
  const PathFormat format = PathFormat::parse("int2:g32");
  ContentTransform identity{std::vector<float>(static_cast<size_t>(r * r)),
                            std::vector<float>(static_cast<size_t>(r), 1.0f)};
  for (int64_t i = 0; i < r; ++i) identity.rotation[i * r + i] = 1.0f;
  std::vector<float> quantized(static_cast<size_t>(n * r));
  quantize_latents(format, g, identity, layer.window.latents.data(), n, quantized.data(), nullptr);
  std::vector<uint8_t> encoded(static_cast<size_t>(format.encoded_bytes(r)));
  std::vector<float> expected(static_cast<size_t>(r));
  for (int64_t j = 0; j < n; ++j) {
    // c / gamma * gamma is not always c in float; the codec sees v = c / gamma scaled back.
    std::vector<float> v(static_cast<size_t>(r));
    for (int64_t i = 0; i < r; ++i) v[i] = layer.window.latents[j * r + i] / g.gamma[i];
    encode_path(format, v.data(), r, encoded.data());
    decode_path(format, encoded.data(), r, expected.data());
    for (int64_t i = 0; i < r; ++i) {
      EXPECT_FLOAT_EQ(quantized[j * r + i], expected[i] * g.gamma[i]) << j << "," << i;
    }
  }
}

// sum_h sum_{t >= j} w (q_pe,h(t) . e_j)^2 summed directly, for the problem's own keys.
double direct_rope_loss(const RandomLayer& layer, RopeObjective objective, const PathFormat& format,
                        const RopeTransform& transform) {
  const LayerGeometry& g = layer.geometry;
  const LayerWindow& w = layer.window;
  const int64_t n = w.length, dr = g.rope_dim;
  std::vector<float> probs(static_cast<size_t>(g.heads * n * n));
  for (int64_t h = 0; h < g.heads; ++h) {
    head_probabilities(w, g, h, w.latents.data(), w.rope_keys.data(), probs.data() + h * n * n);
  }
  std::vector<float> quantized(static_cast<size_t>(n * dr));
  quantize_rope_keys(format, transform, w.rope_keys.data(), n, dr, quantized.data());
  double loss = 0.0, signal = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t t = j; t < n; ++t) {
      for (int64_t h = 0; h < g.heads; ++h) {
        const float* q = w.queries.data() + t * g.query_stride() + h * g.query_width() + g.rank;
        double error = 0.0, exact = 0.0;
        for (int64_t a = 0; a < dr; ++a) {
          error += static_cast<double>(q[a]) * (w.rope_keys[j * dr + a] - quantized[j * dr + a]);
          exact += static_cast<double>(q[a]) * w.rope_keys[j * dr + a];
        }
        const double weight =
            objective == RopeObjective::kAttention ? probs[(h * n + t) * n + j] : 1.0;
        loss += weight * error * error;
        signal += weight * exact * exact;
      }
    }
  }
  return loss / signal;
}

TEST(RopeSearch, ProblemLossEqualsTheDefiningSum) {
  RandomLayer layer = make_layer(6);
  const PathFormat format = PathFormat::parse("int4:g32");
  std::mt19937 rng(1);
  RopeTransform transform = identity_rope_transform(layer.geometry.rope_dim);
  for (size_t i = 0; i < transform.scales.size(); ++i) {
    transform.scales[i] = std::exp(0.5f * std::normal_distribution<float>()(rng));
    transform.angles[i] = std::normal_distribution<float>()(rng);
  }
  const std::span<const LayerWindow> windows(&layer.window, 1);
  for (RopeObjective objective : {RopeObjective::kUniform, RopeObjective::kAttention}) {
    const RopeProblem problem = build_rope_problem(windows, layer.geometry, objective, 0);
    const double direct = direct_rope_loss(layer, objective, format, transform);
    EXPECT_NEAR(rope_loss(problem, format, transform), direct, 1e-4 * direct)
        << to_string(objective);
  }
}

TEST(RopeSearch, SearchNeverEndsAboveTheIdentity) {
  RandomLayer layer = make_layer(7, 40);
  // One high-energy pair in the keys, as in the fixture (DESIGN §8): scales have something to do.
  for (int64_t j = 0; j < layer.window.length; ++j) {
    layer.window.rope_keys[j * layer.geometry.rope_dim + 2] *= 6.0f;
  }
  const PathFormat format = PathFormat::parse("int4:g32");
  const std::span<const LayerWindow> windows(&layer.window, 1);
  const RopeProblem problem =
      build_rope_problem(windows, layer.geometry, RopeObjective::kAttention, 0);
  const RopeTransform identity = identity_rope_transform(layer.geometry.rope_dim);
  const RopeTransform found = search_rope_transform(problem, format, {});
  EXPECT_LT(rope_loss(problem, format, found), 0.9 * rope_loss(problem, format, identity));
}

}  // namespace
}  // namespace quantmla::calib
