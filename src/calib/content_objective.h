// Content path objectives (DESIGN §6) on one calibration window, with their gradients with
// respect to the dequantized latents c~ that attention reads.
#pragma once

#include <cstdint>
#include <vector>

#include "calib/layer_data.h"

namespace quantmla::calib {

enum class ContentObjective {
  kOutput,  // sum_h sum_t ||o_h(t; c~) - o_h(t; c)||^2 through the real softmax attention
  kMse,     // ablation: sum_j ||c~_j - c_j||^2
};
const char* to_string(ContentObjective objective);

// What the output objective compares against, fixed for the whole calibration of a layer. The
// output objective sums over m query positions t_i: every position of a short window, evenly
// spaced ones of a long one (each still attends to all its keys, so long-range attention is
// kept while the cost falls from L^2 to m L).
struct ContentTarget {
  std::vector<int64_t> positions;  // [m] ascending; empty: every position (m = L)
  std::vector<float> queries;      // [m, H, r + d_r]: those positions' queries (when sampled)
  std::vector<float> rope_keys;    // [L, d_r]: RoPE keys in their quantized state, M^-1 Q(M k)
  std::vector<float> outputs;      // [m, H, v_dim]: o_h(t_i) with the exact cache rows
  double signal = 0.0;             // sum ||o||^2 (kOutput) or sum ||c||^2 (kMse), to normalize
};

// The m query positions of a window of `length` tokens when at most `max_queries` are used:
// empty (all) when max_queries is 0 or not below the length, else evenly spaced, the last
// position (the longest context) included.
std::vector<int64_t> objective_positions(int64_t length, int64_t max_queries);

// quantized_rope_keys: [L, d_r] (the window's own keys when the RoPE path is not quantized).
// max_queries: see objective_positions (the kMse objective always uses every latent).
ContentTarget make_content_target(ContentObjective objective, const LayerWindow& window,
                                  const LayerGeometry& geometry, const float* quantized_rope_keys,
                                  int64_t max_queries = 0);

// The objective for latents c~ ([L, r]); when grad is non-null, dL/dc~ is added to it ([L, r]).
double content_loss(ContentObjective objective, const LayerWindow& window,
                    const LayerGeometry& geometry, const ContentTarget& target,
                    const float* latents, float* grad);

}  // namespace quantmla::calib
