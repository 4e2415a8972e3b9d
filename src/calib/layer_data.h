// What calibration knows about one attention layer: the full-precision activations of each
// calibration window (captured once, DESIGN §6: layers are independent given their inputs) and
// the weights its objectives read.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "quantmla/model.h"

namespace quantmla::calib {

// One layer's view of one window, in full precision.
struct LayerWindow {
  int64_t length = 0;            // L tokens
  std::vector<float> queries;    // [L, H, r + d_r]: absorbed content query, then q_pe after RoPE
  std::vector<float> latents;    // [L, r]: c, the content latent the cache is asked to store
  std::vector<float> rope_keys;  // [L, d_r]: k_pe after RoPE
};

// Shapes, scale and weights of one layer as the model had them before any transform.
struct LayerGeometry {
  int64_t heads = 0;
  int64_t rank = 0;      // r = kv_lora_rank
  int64_t rope_dim = 0;  // d_r
  int64_t v_dim = 0;
  float softmax_scale = 1.0f;
  std::vector<float> w_uv;   // [H, v_dim, r]: the value rows of kv_b_proj
  std::vector<float> gamma;  // [r]: kv_a_layernorm.weight

  int64_t query_width() const { return rank + rope_dim; }
  int64_t query_stride() const { return heads * query_width(); }
};

LayerGeometry layer_geometry(const Model& model, int64_t layer);

// Runs every window (token ids, BOS first) through `model` with an exact FP32 cache and keeps
// each layer's queries and cache rows. Returns [layer][window]. progress(done, total) per window.
std::vector<std::vector<LayerWindow>> capture_windows(
    const Model& model, std::span<const std::vector<int32_t>> windows,
    const std::function<void(int64_t, int64_t)>& progress);

// probs[i, j] = softmax_j(scale * (q_c,h(t_i) . latents_j + q_pe,h(t_i) . rope_keys_j)) over
// j <= t_i, zero beyond: head `head`'s causal attention at query positions t_i with the given
// cache rows. queries: [m, query_stride] (rows of the window's queries), positions: [m] ascending
// (nullptr: t_i = i), latents: [L, r], rope_keys: [L, d_r], probs: [m, L].
void query_probabilities(const LayerGeometry& geometry, int64_t head, const float* queries,
                         const int64_t* positions, int64_t m, int64_t length, const float* latents,
                         const float* rope_keys, float* probs);

// query_probabilities at every position of the window: probs [L, L].
void head_probabilities(const LayerWindow& window, const LayerGeometry& geometry, int64_t head,
                        const float* latents, const float* rope_keys, float* probs);

}  // namespace quantmla::calib
