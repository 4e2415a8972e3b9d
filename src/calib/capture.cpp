#include <algorithm>
#include <cmath>
#include <limits>

#include "calib/layer_data.h"
#include "kernels/cpu/ops.h"
#include "model/weights.h"

namespace quantmla::calib {

LayerGeometry layer_geometry(const Model& model, int64_t layer) {
  const ModelConfig& config = model.config();
  const AttentionWeights& attention = model.weights().layers[layer].attention;
  LayerGeometry geometry;
  geometry.heads = config.num_heads;
  geometry.rank = config.kv_lora_rank;
  geometry.rope_dim = config.qk_rope_head_dim;
  geometry.v_dim = config.v_head_dim;
  geometry.softmax_scale = static_cast<float>(config.softmax_scale());
  geometry.gamma = attention.kv_a_norm;
  const int64_t r = geometry.rank, nope = config.qk_nope_head_dim;
  geometry.w_uv.resize(static_cast<size_t>(geometry.heads * geometry.v_dim * r));
  for (int64_t h = 0; h < geometry.heads; ++h) {
    const float* rows = attention.kv_b.weight.data() + (h * (nope + geometry.v_dim) + nope) * r;
    std::copy_n(rows, geometry.v_dim * r, geometry.w_uv.data() + h * geometry.v_dim * r);
  }
  return geometry;
}

std::vector<std::vector<LayerWindow>> capture_windows(
    const Model& model, std::span<const std::vector<int32_t>> windows,
    const std::function<void(int64_t, int64_t)>& progress) {
  const int64_t layers = model.config().num_layers;
  std::vector<std::vector<LayerWindow>> captured(static_cast<size_t>(layers));
  const int64_t total = static_cast<int64_t>(windows.size());
  for (int64_t w = 0; w < total; ++w) {
    const std::vector<int32_t>& tokens = windows[w];
    const int64_t length = static_cast<int64_t>(tokens.size());
    auto cache = model.make_cache(length);
    std::vector<float> logits(static_cast<size_t>(model.config().vocab_size));
    AttentionTrace trace;
    trace.record_queries = true;
    trace.record_cache_rows = true;
    model.forward(tokens, *cache, logits, /*all_logits=*/false, &trace);
    for (int64_t l = 0; l < layers; ++l) {
      captured[l].push_back(LayerWindow{length, std::move(trace.queries[l]),
                                        std::move(trace.latents[l]),
                                        std::move(trace.rope_keys[l])});
    }
    if (progress) progress(w + 1, total);
  }
  return captured;
}

void query_probabilities(const LayerGeometry& geometry, int64_t head, const float* queries,
                         const int64_t* positions, int64_t m, int64_t length, const float* latents,
                         const float* rope_keys, float* probs) {
  const int64_t n = length, r = geometry.rank, ld = geometry.query_stride();
  const float* q = queries + head * geometry.query_width();
  cpu::matmul_nt(q, ld, latents, r, probs, n, m, n, r);
  cpu::matmul_nt(q + r, ld, rope_keys, geometry.rope_dim, probs, n, m, n, geometry.rope_dim,
                 /*accumulate=*/true);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = positions != nullptr ? positions[i] : i;
    float* row = probs + i * n;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j <= t; ++j) {
      row[j] *= geometry.softmax_scale;
      peak = std::max(peak, row[j]);
    }
    double sum = 0.0;
    for (int64_t j = 0; j <= t; ++j) {
      row[j] = std::exp(row[j] - peak);
      sum += row[j];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j <= t; ++j) row[j] *= inv;
    std::fill(row + t + 1, row + n, 0.0f);
  }
}

void head_probabilities(const LayerWindow& window, const LayerGeometry& geometry, int64_t head,
                        const float* latents, const float* rope_keys, float* probs) {
  query_probabilities(geometry, head, window.queries.data(), nullptr, window.length, window.length,
                      latents, rope_keys, probs);
}

}  // namespace quantmla::calib
