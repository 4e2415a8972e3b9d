#include <bit>
#include <cmath>
#include <random>
#include <string>

#include "kernels/cpu/ops.h"
#include "model/weights.h"
#include "quantmla/error.h"
#include "quantmla/model.h"
#include "quantmla/transform.h"

namespace quantmla {

ContentTransform random_hadamard(int64_t n, uint64_t seed) {
  if (n <= 0 || (n & (n - 1)) != 0) {
    throw InvalidArgument("a Hadamard rotation needs a power-of-two size, got " +
                          std::to_string(n));
  }
  std::mt19937_64 rng(seed);
  std::vector<float> signs(static_cast<size_t>(n));
  for (float& s : signs) s = (rng() & 1) ? 1.0f : -1.0f;
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  ContentTransform transform;
  transform.rotation.resize(static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      // Sylvester construction: H[i][j] = (-1)^popcount(i & j).
      const float h = (std::popcount(static_cast<uint64_t>(i & j)) & 1) ? -1.0f : 1.0f;
      transform.rotation[i * n + j] = h * signs[j] * norm;
    }
  }
  transform.delta.assign(static_cast<size_t>(n), 1.0f);
  return transform;
}

void fold_content_transform(Model& model, int64_t layer, const ContentTransform& transform) {
  const ModelConfig& config = model.config();
  const int64_t r = config.kv_lora_rank;
  if (static_cast<int64_t>(transform.rotation.size()) != r * r ||
      static_cast<int64_t>(transform.delta.size()) != r) {
    throw ShapeError("content transform of " + std::to_string(transform.delta.size()) +
                     " channels (rotation " + std::to_string(transform.rotation.size()) +
                     " values) for kv_lora_rank " + std::to_string(r));
  }
  if (layer < 0 || layer >= config.num_layers) {
    throw InvalidArgument("layer " + std::to_string(layer) + " outside [0, " +
                          std::to_string(config.num_layers) + ")");
  }
  AttentionWeights& attention = model.mutable_weights().layers[layer].attention;
  const std::vector<float>& rotation = transform.rotation;

  // kv_a_proj rows [0, r) <- R * rows (rms is invariant under R, so kv_a_layernorm sees R u).
  Linear& kv_a = attention.kv_a;
  std::vector<float> rotated(static_cast<size_t>(r * kv_a.in));
  cpu::matmul_nn(rotation.data(), r, kv_a.weight.data(), kv_a.in, rotated.data(), kv_a.in, r,
                 kv_a.in, r);
  std::copy(rotated.begin(), rotated.end(), kv_a.weight.begin());

  // W_h <- W_h A^-1 with A^-1 = diag(gamma) R^T diag(delta)^-1, for W_UK_h and W_UV_h alike: every
  // row of kv_b_proj is one such row vector w, and w A^-1 = ((w * gamma) R^T) / delta.
  const std::vector<float> gamma = attention.kv_a_norm;
  Linear& kv_b = attention.kv_b;
  std::vector<float> scaled(kv_b.weight.size());
  for (int64_t row = 0; row < kv_b.out; ++row) {
    for (int64_t i = 0; i < r; ++i) scaled[row * r + i] = kv_b.weight[row * r + i] * gamma[i];
  }
  cpu::matmul_nt(scaled.data(), r, rotation.data(), r, kv_b.weight.data(), r, kv_b.out, r, r);
  for (int64_t row = 0; row < kv_b.out; ++row) {
    for (int64_t i = 0; i < r; ++i) kv_b.weight[row * r + i] /= transform.delta[i];
  }
  attention.kv_a_norm = transform.delta;

  // The original BF16 bits no longer describe these matrices; decode falls back to FP32.
  kv_a.weight_bf16.clear();
  kv_b.weight_bf16.clear();
}

void fold_random_hadamard(Model& model, uint64_t seed) {
  for (int64_t layer = 0; layer < model.config().num_layers; ++layer) {
    fold_content_transform(model, layer,
                           random_hadamard(model.config().kv_lora_rank, seed + layer));
  }
}

}  // namespace quantmla
