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

// What the output objective compares against, fixed for the whole calibration of a layer.
struct ContentTarget {
  std::vector<float> rope_keys;  // [L, d_r]: RoPE keys in their quantized state, M^-1 Q(M k)
  std::vector<float> outputs;    // [L, H, v_dim]: o_h(t) with the exact cache rows
  double signal = 0.0;           // sum ||o||^2 (kOutput) or sum ||c||^2 (kMse), to normalize
};

// quantized_rope_keys: [L, d_r] (the window's own keys when the RoPE path is not quantized).
ContentTarget make_content_target(ContentObjective objective, const LayerWindow& window,
                                  const LayerGeometry& geometry, const float* quantized_rope_keys);

// The objective for latents c~ ([L, r]); when grad is non-null, dL/dc~ is added to it ([L, r]).
double content_loss(ContentObjective objective, const LayerWindow& window,
                    const LayerGeometry& geometry, const ContentTarget& target,
                    const float* latents, float* grad);

}  // namespace quantmla::calib
