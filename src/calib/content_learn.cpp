#include "calib/content_learn.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/cpu/ops.h"

namespace quantmla::calib {
namespace {

// Per-channel importance of the rotated latent R (gamma * c) with delta = 1: how strongly the
// content logits (query energy) and the head outputs (W_UV column energy) read each channel.
struct ChannelImportance {
  std::vector<double> query, value;  // [r]
};

ChannelImportance channel_importance(const LayerGeometry& geometry,
                                     const std::vector<float>& rotation,
                                     const ContentWindows& data) {
  const int64_t r = geometry.rank, heads = geometry.heads, v = geometry.v_dim;
  ChannelImportance importance{std::vector<double>(r), std::vector<double>(r)};
  // Queries: q' = A^-T q = R (gamma * q) with delta = 1.
  std::vector<float> scaled, rotated;
  for (const LayerWindow& window : data.windows) {
    const int64_t rows = window.length * heads;
    scaled.resize(static_cast<size_t>(rows * r));
    rotated.resize(static_cast<size_t>(rows * r));
    for (int64_t row = 0; row < rows; ++row) {
      const float* q = window.queries.data() + row * geometry.query_width();
      for (int64_t i = 0; i < r; ++i) scaled[row * r + i] = q[i] * geometry.gamma[i];
    }
    cpu::matmul_nt(scaled.data(), r, rotation.data(), r, rotated.data(), r, rows, r, r);
    for (int64_t row = 0; row < rows; ++row) {
      for (int64_t i = 0; i < r; ++i) {
        importance.query[i] += static_cast<double>(rotated[row * r + i]) * rotated[row * r + i];
      }
    }
  }
  // Values: W' = W_UV A^-1 = (W_UV * gamma) R^T.
  const int64_t rows = heads * v;
  scaled.resize(static_cast<size_t>(rows * r));
  rotated.resize(static_cast<size_t>(rows * r));
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t i = 0; i < r; ++i) {
      scaled[row * r + i] = geometry.w_uv[row * r + i] * geometry.gamma[i];
    }
  }
  cpu::matmul_nt(scaled.data(), r, rotation.data(), r, rotated.data(), r, rows, r, r);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t i = 0; i < r; ++i) {
      importance.value[i] += static_cast<double>(rotated[row * r + i]) * rotated[row * r + i];
    }
  }
  return importance;
}

// delta_i = (query_i / mean)^a (value_i / mean)^b, normalized to geometric mean 1.
std::vector<float> importance_delta(const ChannelImportance& importance, float a, float b) {
  const size_t r = importance.query.size();
  double mean_q = 0.0, mean_v = 0.0;
  for (size_t i = 0; i < r; ++i) mean_q += importance.query[i], mean_v += importance.value[i];
  mean_q /= static_cast<double>(r), mean_v /= static_cast<double>(r);
  std::vector<double> log_delta(r);
  double mean_log = 0.0;
  for (size_t i = 0; i < r; ++i) {
    const double q = std::max(importance.query[i] / mean_q, 1e-6);
    const double v = std::max(importance.value[i] / mean_v, 1e-6);
    log_delta[i] = a * std::log(q) + b * std::log(v);
    mean_log += log_delta[i];
  }
  mean_log /= static_cast<double>(r);
  std::vector<float> delta(r);
  for (size_t i = 0; i < r; ++i) delta[i] = static_cast<float>(std::exp(log_delta[i] - mean_log));
  return delta;
}

}  // namespace

void quantize_latents(const PathFormat& format, const LayerGeometry& geometry,
                      const ContentTransform& transform, const float* latents, int64_t rows,
                      float* quantized, float* step_error) {
  const int64_t r = geometry.rank;
  const std::vector<float>& gamma = geometry.gamma;
  const std::vector<float>& delta = transform.delta;
  std::vector<float> normalized(static_cast<size_t>(rows * r)), rotated(normalized.size());
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t i = 0; i < r; ++i) {
      normalized[j * r + i] = gamma[i] != 0.0f ? latents[j * r + i] / gamma[i] : 0.0f;
    }
  }
  // z_j = delta * (R v_j): rows of V R^T.
  cpu::matmul_nt(normalized.data(), r, transform.rotation.data(), r, rotated.data(), r, rows, r, r);
  std::vector<uint8_t> encoded(static_cast<size_t>(format.encoded_bytes(r)));
  std::vector<float> decoded(static_cast<size_t>(r));
  for (int64_t j = 0; j < rows; ++j) {
    float* z = rotated.data() + j * r;
    for (int64_t i = 0; i < r; ++i) z[i] *= delta[i];
    encode_path(format, z, r, encoded.data());
    decode_path(format, encoded.data(), r, decoded.data());
    for (int64_t i = 0; i < r; ++i) {
      if (step_error != nullptr) step_error[j * r + i] = (decoded[i] - z[i]) / delta[i];
      z[i] = decoded[i] / delta[i];  // reused as u_j = Q(z_j) / delta
    }
  }
  // c~_j = gamma * R^T u_j: rows of U R.
  cpu::matmul_nn(rotated.data(), r, transform.rotation.data(), r, quantized, r, rows, r, r);
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t i = 0; i < r; ++i) quantized[j * r + i] *= gamma[i];
  }
}

void rotation_gradient(const LayerGeometry& geometry, const float* step_error,
                       const float* grad_latents, int64_t rows, float* grad_rotation) {
  const int64_t r = geometry.rank;
  std::vector<float> scaled(static_cast<size_t>(rows * r));
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t i = 0; i < r; ++i) scaled[j * r + i] = grad_latents[j * r + i] * geometry.gamma[i];
  }
  cpu::matmul_tn(step_error, r, scaled.data(), r, grad_rotation, r, r, r, rows,
                 /*accumulate=*/true);
}

void cayley_step(std::vector<float>& rotation, const std::vector<float>& skew, float step,
                 int64_t n) {
  const size_t size = static_cast<size_t>(n * n);
  const float half = 0.5f * step;
  std::vector<float> w_r(size), next(size), sum(size), w_sum(size);
  // (I + h W) Y = (I - h W) R  <=>  Y = R - h W (R + Y); start from the first-order Y = R - 2h W R.
  cpu::matmul_nn(skew.data(), n, rotation.data(), n, w_r.data(), n, n, n, n);
  for (size_t i = 0; i < size; ++i) next[i] = rotation[i] - step * w_r[i];
  for (int iteration = 0; iteration < 4; ++iteration) {
    for (size_t i = 0; i < size; ++i) sum[i] = rotation[i] + next[i];
    cpu::matmul_nn(skew.data(), n, sum.data(), n, w_sum.data(), n, n, n, n);
    for (size_t i = 0; i < size; ++i) next[i] = rotation[i] - half * w_sum[i];
  }
  // Newton-Schulz towards the nearest orthogonal matrix: Y <- Y (3 I - Y^T Y) / 2.
  std::vector<float> gram(size), product(size);
  for (int iteration = 0; iteration < 2; ++iteration) {
    cpu::matmul_tn(next.data(), n, next.data(), n, gram.data(), n, n, n, n);
    cpu::matmul_nn(next.data(), n, gram.data(), n, product.data(), n, n, n, n);
    for (size_t i = 0; i < size; ++i) next[i] = 1.5f * next[i] - 0.5f * product[i];
  }
  rotation = std::move(next);
}

float orthogonality_error(const std::vector<float>& rotation, int64_t n) {
  std::vector<float> gram(static_cast<size_t>(n * n));
  cpu::matmul_tn(rotation.data(), n, rotation.data(), n, gram.data(), n, n, n, n);
  float worst = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      worst = std::max(worst, std::abs(gram[i * n + j] - (i == j ? 1.0f : 0.0f)));
    }
  }
  return worst;
}

double content_transform_loss(ContentObjective objective, const PathFormat& format,
                              const LayerGeometry& geometry, const ContentTransform& transform,
                              const ContentWindows& data) {
  double loss = 0.0, signal = 0.0;
  std::vector<float> quantized;
  for (size_t w = 0; w < data.windows.size(); ++w) {
    const LayerWindow& window = data.windows[w];
    quantized.resize(static_cast<size_t>(window.length * geometry.rank));
    quantize_latents(format, geometry, transform, window.latents.data(), window.length,
                     quantized.data(), nullptr);
    loss += content_loss(objective, window, geometry, data.targets[w], quantized.data(), nullptr);
    signal += data.targets[w].signal;
  }
  return loss / signal;
}

ContentLearnResult learn_content_transform(const PathFormat& format, const LayerGeometry& geometry,
                                           const ContentTransform& start,
                                           const ContentWindows& train,
                                           const ContentWindows& held_out,
                                           const ContentLearnOptions& options,
                                           const std::function<void(int64_t, int64_t)>& progress) {
  const int64_t r = geometry.rank;
  const auto held_loss = [&](const ContentTransform& transform) {
    return content_transform_loss(options.objective, format, geometry, transform, held_out);
  };
  ContentLearnResult result;
  ContentTransform identity{std::vector<float>(static_cast<size_t>(r * r)),
                            std::vector<float>(static_cast<size_t>(r), 1.0f)};
  for (int64_t i = 0; i < r; ++i) identity.rotation[i * r + i] = 1.0f;
  ContentLayerReport& report = result.report;
  report.calibrated = true;
  report.loss_identity = held_loss(identity);
  report.loss_start = held_loss(start);

  // delta: a coordinate search over the two exponents, for the given rotation.
  const auto search_delta = [&](ContentTransform& transform, double& loss, float& a, float& b) {
    const ChannelImportance importance = channel_importance(geometry, transform.rotation, train);
    const std::vector<float> grid = {0.0f, 0.125f, 0.25f, 0.375f, 0.5f};
    for (int axis = 0; axis < 2; ++axis) {
      for (float value : grid) {
        const float ca = axis == 0 ? value : a, cb = axis == 1 ? value : b;
        if (ca == a && cb == b) continue;
        ContentTransform candidate{transform.rotation, importance_delta(importance, ca, cb)};
        const double candidate_loss = held_loss(candidate);
        if (candidate_loss < loss) {
          loss = candidate_loss;
          transform.delta = std::move(candidate.delta);
          a = ca, b = cb;
        }
      }
    }
  };

  ContentTransform best = start;
  double best_loss = report.loss_start;
  float a = 0.0f, b = 0.0f;
  search_delta(best, best_loss, a, b);

  // Riemannian SGD with momentum on R (delta fixed), Cayley retraction, cosine-decayed step.
  ContentTransform current = best;
  std::vector<float> momentum(static_cast<size_t>(r * r)), grad(static_cast<size_t>(r * r));
  std::vector<float> skew(static_cast<size_t>(r * r)), g_rt(static_cast<size_t>(r * r));
  std::vector<float> quantized, step_error, grad_latents;
  const int64_t windows = static_cast<int64_t>(train.windows.size());
  for (int64_t step = 0; step < options.steps && windows > 0; ++step) {
    std::fill(grad.begin(), grad.end(), 0.0f);
    for (int64_t k = 0; k < options.batch; ++k) {
      const int64_t w = (step * options.batch + k) % windows;
      const LayerWindow& window = train.windows[w];
      const size_t size = static_cast<size_t>(window.length * r);
      quantized.resize(size), step_error.resize(size);
      grad_latents.assign(size, 0.0f);
      quantize_latents(format, geometry, current, window.latents.data(), window.length,
                       quantized.data(), step_error.data());
      content_loss(options.objective, window, geometry, train.targets[w], quantized.data(),
                   grad_latents.data());
      rotation_gradient(geometry, step_error.data(), grad_latents.data(), window.length,
                        grad.data());
    }
    // Riemannian direction W = G R^T - R G^T (skew); moving along -W R lowers the loss.
    cpu::matmul_nt(grad.data(), r, current.rotation.data(), r, g_rt.data(), r, r, r, r);
    double norm = 0.0;
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < r; ++j) {
        const float w = g_rt[i * r + j] - g_rt[j * r + i];
        momentum[i * r + j] = options.momentum * momentum[i * r + j] + w;
        norm += static_cast<double>(momentum[i * r + j]) * momentum[i * r + j];
      }
    }
    if (norm > 0.0) {
      const float inv = static_cast<float>(1.0 / std::sqrt(norm));
      for (size_t i = 0; i < skew.size(); ++i) skew[i] = momentum[i] * inv;
      const double progress_ratio = static_cast<double>(step) / static_cast<double>(options.steps);
      const float rate = options.learning_rate * 0.5f *
                         static_cast<float>(1.0 + std::cos(std::numbers::pi * progress_ratio));
      cayley_step(current.rotation, skew, rate, r);
    }
    const bool last = step + 1 == options.steps;
    if (last || (options.evaluate_every > 0 && (step + 1) % options.evaluate_every == 0)) {
      const double loss = held_loss(current);
      if (loss < best_loss) {
        best_loss = loss;
        best = current;
      }
    }
    if (progress) progress(step + 1, options.steps);
  }
  if (options.steps > 0) search_delta(best, best_loss, a, b);
  result.transform = std::move(best);
  report.loss_final = best_loss;
  report.delta_exponent_query = a;
  report.delta_exponent_value = b;
  return result;
}

}  // namespace quantmla::calib
