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

// The rows the output objective sums over: m, their queries and positions (nullptr: all).
struct QueryRows {
  int64_t count;
  const float* queries;
  const int64_t* positions;
};

QueryRows query_rows(const LayerWindow& window, const ContentTarget& target) {
  if (target.positions.empty()) return {window.length, window.queries.data(), nullptr};
  return {static_cast<int64_t>(target.positions.size()), target.queries.data(),
          target.positions.data()};
}

// outputs[i, h, :] = W_UV,h (P_h latents)_i for every head.
void attention_outputs(const LayerWindow& window, const LayerGeometry& geometry,
                       const QueryRows& rows, const float* latents, const float* rope_keys,
                       float* outputs) {
  const int64_t n = window.length, m = rows.count, r = geometry.rank, v = geometry.v_dim;
  const int64_t heads = geometry.heads;
  std::vector<float> probs(static_cast<size_t>(m * n)), mixed(static_cast<size_t>(m * r));
  for (int64_t h = 0; h < heads; ++h) {
    query_probabilities(geometry, h, rows.queries, rows.positions, m, n, latents, rope_keys,
                        probs.data());
    cpu::matmul_nn(probs.data(), n, latents, r, mixed.data(), r, m, r, n);
    cpu::matmul_nt(mixed.data(), r, geometry.w_uv.data() + h * v * r, r, outputs + h * v, heads * v,
                   m, v, r);
  }
}

}  // namespace

const char* to_string(ContentObjective objective) {
  return objective == ContentObjective::kOutput ? "output" : "mse";
}

std::vector<int64_t> objective_positions(int64_t length, int64_t max_queries) {
  if (max_queries <= 0 || max_queries >= length) return {};
  std::vector<int64_t> positions(static_cast<size_t>(max_queries));
  for (int64_t k = 0; k < max_queries; ++k) {
    positions[max_queries - 1 - k] = length - 1 - k * length / max_queries;
  }
  return positions;
}

ContentTarget make_content_target(ContentObjective objective, const LayerWindow& window,
                                  const LayerGeometry& geometry, const float* quantized_rope_keys,
                                  int64_t max_queries) {
  const int64_t n = window.length, stride = geometry.query_stride();
  ContentTarget target;
  target.rope_keys.assign(quantized_rope_keys, quantized_rope_keys + n * geometry.rope_dim);
  if (objective == ContentObjective::kMse) {
    target.signal = squared_norm(window.latents.data(), n * geometry.rank);
    return target;
  }
  target.positions = objective_positions(n, max_queries);
  for (int64_t t : target.positions) {
    const float* row = window.queries.data() + t * stride;
    target.queries.insert(target.queries.end(), row, row + stride);
  }
  const QueryRows rows = query_rows(window, target);
  target.outputs.resize(static_cast<size_t>(rows.count * geometry.heads * geometry.v_dim));
  attention_outputs(window, geometry, rows, window.latents.data(), window.rope_keys.data(),
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
  const QueryRows rows = query_rows(window, target);
  const int64_t m = rows.count;
  std::vector<float> probs(static_cast<size_t>(m * n)), mixed(static_cast<size_t>(m * r));
  std::vector<float> residual(static_cast<size_t>(m * v)), back(static_cast<size_t>(m * r));
  std::vector<float> dprobs(grad != nullptr ? static_cast<size_t>(m * n) : 0);
  double loss = 0.0;
  for (int64_t h = 0; h < heads; ++h) {
    const float* w_uv = geometry.w_uv.data() + h * v * r;
    query_probabilities(geometry, h, rows.queries, rows.positions, m, n, latents,
                        target.rope_keys.data(), probs.data());
    cpu::matmul_nn(probs.data(), n, latents, r, mixed.data(), r, m, r, n);
    cpu::matmul_nt(mixed.data(), r, w_uv, r, residual.data(), v, m, v, r);
    for (int64_t i = 0; i < m; ++i) {
      const float* reference = target.outputs.data() + (i * heads + h) * v;
      for (int64_t e = 0; e < v; ++e) {
        const float diff = residual[i * v + e] - reference[e];
        residual[i * v + e] = 2.0f * diff;  // from here on: dL/do
        loss += static_cast<double>(diff) * diff;
      }
    }
    if (grad == nullptr) continue;
    // dL/d(P c~) = dL/do W_UV; the value path gives P^T of it, the key path goes through P.
    cpu::matmul_nn(residual.data(), v, w_uv, r, back.data(), r, m, r, v);
    cpu::matmul_tn(probs.data(), n, back.data(), r, grad, r, n, r, m, /*accumulate=*/true);
    cpu::matmul_nt(back.data(), r, latents, r, dprobs.data(), n, m, n, r);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t t = rows.positions != nullptr ? rows.positions[i] : i;
      const float* p = probs.data() + i * n;
      float* d = dprobs.data() + i * n;
      double expected = 0.0;
      for (int64_t j = 0; j <= t; ++j) expected += static_cast<double>(p[j]) * d[j];
      for (int64_t j = 0; j <= t; ++j) {
        d[j] = geometry.softmax_scale * p[j] * (d[j] - static_cast<float>(expected));
      }
      std::fill(d + t + 1, d + n, 0.0f);
    }
    // dL/dc~_j += sum_i dL/ds(i, j) q_c,h(t_i).
    const float* q = rows.queries + h * geometry.query_width();
    cpu::matmul_tn(dprobs.data(), n, q, geometry.query_stride(), grad, r, n, r, m,
                   /*accumulate=*/true);
  }
  return loss;
}

}  // namespace quantmla::calib
