// RoPE path calibration (DESIGN §5-§6): per frequency pair a scale and an angle, chosen to minimize
// the positional QK reconstruction error of the quantized RoPE key.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "calib/layer_data.h"
#include "quantmla/cache_format.h"
#include "quantmla/transform.h"

namespace quantmla::calib {

// How the logit errors of query/key pairs are weighted.
enum class RopeObjective {
  kMse,        // ablation: plain MSE of k_pe, every query ignored (G_j = I)
  kUniform,    // every (head, query t >= j) pair alike
  kAttention,  // each pair by the attention probability p_h(t, j) of the exact model
};
const char* to_string(RopeObjective objective);

// Sampled RoPE keys k_j and per key G_j = sum_h sum_{t >= j} w_h(t, j) q_pe,h(t) q_pe,h(t)^T, so
// that a transform M costs sum_j e_j^T G_j e_j with e_j = k_j - M^-1 Q(M k_j): the squared logit
// error sum w (q . e)^2 of DESIGN §6 without revisiting the queries.
struct RopeProblem {
  int64_t rope_dim = 0;
  std::vector<float> keys;     // [K, d_r]
  std::vector<float> weights;  // [K, d_r, d_r]; empty for kMse
  double signal = 0.0;         // sum_j k_j^T G_j k_j: the loss of a zero key, for normalization
  int64_t key_count() const { return static_cast<int64_t>(keys.size()) / rope_dim; }
};

// Keys at `keys_per_window` evenly spaced positions of every window (all when 0).
RopeProblem build_rope_problem(std::span<const LayerWindow> windows, const LayerGeometry& geometry,
                               RopeObjective objective, int64_t keys_per_window);

// Identity: s = 1, phi = 0 for every pair.
RopeTransform identity_rope_transform(int64_t rope_dim);

// The problem's loss for `transform` with keys stored in `format`, relative to `signal`.
double rope_loss(const RopeProblem& problem, const PathFormat& format,
                 const RopeTransform& transform);

// Coordinate descent from the identity: per pair, scales on a shrinking log grid, then angles.
// Never returns a transform worse than the identity on the problem. progress(done, total).
RopeTransform search_rope_transform(const RopeProblem& problem, const PathFormat& format,
                                    const std::function<void(int64_t, int64_t)>& progress);

// out_j = M^-1 Q(M k_j): the keys as attention sees them through the folded, quantized cache,
// in the original coordinates. keys, out: [rows, d_r].
void quantize_rope_keys(const PathFormat& format, const RopeTransform& transform, const float* keys,
                        int64_t rows, int64_t rope_dim, float* out);

}  // namespace quantmla::calib
