#include "calib/content_objective.h"

#include <algorithm>

#include "kernels/cpu/ops.h"

namespace quantmla::calib {
namespace {

double squared_norm(const float* x, int64_t n) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(x[i]) * x[i];
  return total;
}

// outputs[t, h, :] = W_UV,h (P_h latents)_t for every head.
void attention_outputs(const LayerWindow& window, const LayerGeometry& geometry,
                       const float* latents, const float* rope_keys, float* outputs) {
  const int64_t n = window.length, r = geometry.rank, v = geometry.v_dim, heads = geometry.heads;
  std::vector<float> probs(static_cast<size_t>(n * n)), mixed(static_cast<size_t>(n * r));
  for (int64_t h = 0; h < heads; ++h) {
    head_probabilities(window, geometry, h, latents, rope_keys, probs.data());
    cpu::matmul_nn(probs.data(), n, latents, r, mixed.data(), r, n, r, n);
    cpu::matmul_nt(mixed.data(), r, geometry.w_uv.data() + h * v * r, r, outputs + h * v, heads * v,
                   n, v, r);
  }
}

}  // namespace

const char* to_string(ContentObjective objective) {
  return objective == ContentObjective::kOutput ? "output" : "mse";
}

ContentTarget make_content_target(ContentObjective objective, const LayerWindow& window,
                                  const LayerGeometry& geometry, const float* quantized_rope_keys) {
  const int64_t n = window.length;
  ContentTarget target;
  target.rope_keys.assign(quantized_rope_keys, quantized_rope_keys + n * geometry.rope_dim);
  if (objective == ContentObjective::kMse) {
    target.signal = squared_norm(window.latents.data(), n * geometry.rank);
    return target;
  }
  target.outputs.resize(static_cast<size_t>(n * geometry.heads * geometry.v_dim));
  attention_outputs(window, geometry, window.latents.data(), window.rope_keys.data(),
                    target.outputs.data());
  target.signal = squared_norm(target.outputs.data(), static_cast<int64_t>(target.outputs.size()));
  return target;
}

double content_loss(ContentObjective objective, const LayerWindow& window,
                    const LayerGeometry& geometry, const ContentTarget& target,
                    const float* latents, float* grad) {
  const int64_t n = window.length, r = geometry.rank, v = geometry.v_dim, heads = geometry.heads;
  if (objective == ContentObjective::kMse) {
    double loss = 0.0;
    for (int64_t i = 0; i < n * r; ++i) {
      const float diff = latents[i] - window.latents[i];
      loss += static_cast<double>(diff) * diff;
      if (grad != nullptr) grad[i] += 2.0f * diff;
    }
    return loss;
  }
  std::vector<float> probs(static_cast<size_t>(n * n)), mixed(static_cast<size_t>(n * r));
  std::vector<float> residual(static_cast<size_t>(n * v)), back(static_cast<size_t>(n * r));
  std::vector<float> dprobs(grad != nullptr ? static_cast<size_t>(n * n) : 0);
  double loss = 0.0;
  for (int64_t h = 0; h < heads; ++h) {
    const float* w_uv = geometry.w_uv.data() + h * v * r;
    head_probabilities(window, geometry, h, latents, target.rope_keys.data(), probs.data());
    cpu::matmul_nn(probs.data(), n, latents, r, mixed.data(), r, n, r, n);
    cpu::matmul_nt(mixed.data(), r, w_uv, r, residual.data(), v, n, v, r);
    for (int64_t t = 0; t < n; ++t) {
      const float* reference = target.outputs.data() + (t * heads + h) * v;
      for (int64_t i = 0; i < v; ++i) {
        const float diff = residual[t * v + i] - reference[i];
        residual[t * v + i] = 2.0f * diff;  // from here on: dL/do
        loss += static_cast<double>(diff) * diff;
      }
    }
    if (grad == nullptr) continue;
    // dL/d(P c~) = dL/do W_UV; the value path gives P^T of it, the key path goes through P.
    cpu::matmul_nn(residual.data(), v, w_uv, r, back.data(), r, n, r, v);
    cpu::matmul_tn(probs.data(), n, back.data(), r, grad, r, n, r, n, /*accumulate=*/true);
    cpu::matmul_nt(back.data(), r, latents, r, dprobs.data(), n, n, n, r);
    for (int64_t t = 0; t < n; ++t) {
      const float* p = probs.data() + t * n;
      float* d = dprobs.data() + t * n;
      double expected = 0.0;
      for (int64_t j = 0; j <= t; ++j) expected += static_cast<double>(p[j]) * d[j];
      for (int64_t j = 0; j <= t; ++j) {
        d[j] = geometry.softmax_scale * p[j] * (d[j] - static_cast<float>(expected));
      }
      std::fill(d + t + 1, d + n, 0.0f);
    }
    // dL/dc~_j += sum_t dL/ds(t, j) q_c,h(t).
    const float* q = window.queries.data() + h * geometry.query_width();
    cpu::matmul_tn(dprobs.data(), n, q, geometry.query_stride(), grad, r, n, r, n,
                   /*accumulate=*/true);
  }
  return loss;
}

}  // namespace quantmla::calib
