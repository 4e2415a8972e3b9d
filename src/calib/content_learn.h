// Content path calibration (DESIGN §5-§6): A = diag(delta) R diag(gamma)^-1 with R orthogonal,
// started from a random Hadamard rotation, R trained by Riemannian SGD with Cayley retractions on
// the straight-through gradient, delta searched (the straight-through gradient misleads scales).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "calib/content_objective.h"
#include "calib/layer_data.h"
#include "quantmla/cache_format.h"
#include "quantmla/calibrate.h"
#include "quantmla/transform.h"

namespace quantmla::calib {

// c~ = A^-1 Q(A c) for latents [rows, r] (the content rows as attention reads them through the
// folded, quantized cache, in the original coordinates). When step_error is non-null it receives
// eps = (Q(A c) - A c) / delta, the rounding error the straight-through gradient holds fixed.
void quantize_latents(const PathFormat& format, const LayerGeometry& geometry,
                      const ContentTransform& transform, const float* latents, int64_t rows,
                      float* quantized, float* step_error);

// Euclidean gradient of the loss with respect to R under the straight-through estimator:
// c~_j = c_j + gamma * R^T eps_j with eps_j fixed, so dL/dR += sum_j eps_j (gamma * g_j)^T where
// g_j = dL/dc~_j. eps, grad_latents: [rows, r]; grad_rotation: [r, r], accumulated.
void rotation_gradient(const LayerGeometry& geometry, const float* step_error,
                       const float* grad_latents, int64_t rows, float* grad_rotation);

// R <- (I + a/2 W)^-1 (I - a/2 W) R for a skew-symmetric W ([n, n]): the Cayley retraction, whose
// derivative at a = 0 is -W R. Solved by fixed-point iteration, then re-orthonormalized.
void cayley_step(std::vector<float>& rotation, const std::vector<float>& skew, float step,
                 int64_t n);

// max |R^T R - I|.
float orthogonality_error(const std::vector<float>& rotation, int64_t n);

struct ContentLearnOptions {
  ContentObjective objective = ContentObjective::kOutput;
  int64_t steps = 40;          // Riemannian SGD steps (0: keep the start rotation)
  int64_t batch = 2;           // windows per step
  float learning_rate = 0.5f;  // Frobenius norm of each step's rotation generator at the start
  float momentum = 0.8f;
  int64_t evaluate_every = 10;  // held-out evaluations keep the best rotation seen
};

struct ContentLearnResult {
  ContentTransform transform;
  ContentLayerReport report;  // held-back losses: identity, start, returned transform
};

// One layer's windows with their targets.
struct ContentWindows {
  std::span<const LayerWindow> windows;
  std::span<const ContentTarget> targets;
};

// Relative loss (sum of losses / sum of signals) of `transform` over `data`.
double content_transform_loss(ContentObjective objective, const PathFormat& format,
                              const LayerGeometry& geometry, const ContentTransform& transform,
                              const ContentWindows& data);

ContentLearnResult learn_content_transform(const PathFormat& format, const LayerGeometry& geometry,
                                           const ContentTransform& start,
                                           const ContentWindows& train,
                                           const ContentWindows& held_out,
                                           const ContentLearnOptions& options,
                                           const std::function<void(int64_t, int64_t)>& progress);

}  // namespace quantmla::calib
