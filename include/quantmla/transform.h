// Exact transforms of the MLA cache paths, folded into a model's weights (DESIGN §5). In full
// precision a folded model computes the same function; only what the cache stores changes.
#pragma once

#include <cstdint>
#include <vector>

namespace quantmla {

class Model;

// Content path: the cache stores c' = A c with A = diag(delta) R diag(gamma)^-1, R orthogonal.
struct ContentTransform {
  std::vector<float> rotation;  // R: [kv_lora_rank, kv_lora_rank], row-major, orthogonal
  std::vector<float> delta;     // [kv_lora_rank], > 0: the new kv_a_layernorm weight
};

// R = H diag(s) / sqrt(n): a Sylvester Walsh-Hadamard matrix times random signs s drawn from
// `seed`; delta = 1. n must be a power of two (InvalidArgument otherwise).
ContentTransform random_hadamard(int64_t n, uint64_t seed);

// Folds `transform` into `layer`: kv_a_proj rows [0, r) <- R rows, kv_a_layernorm <- delta,
// every head's W_UK_h and W_UV_h <- W_h diag(gamma) R^T diag(delta)^-1. Throws ShapeError when the
// transform's size is not kv_lora_rank.
void fold_content_transform(Model& model, int64_t layer, const ContentTransform& transform);

// RoPE path: M = (+)_i s_i Rot(phi_i), one 2x2 block per frequency pair i, i.e. rows (2i, 2i+1)
// of k_pe in the checkpoint's interleaved layout. Each block commutes with RoPE_t, so the cache
// stores k_pe' = M RoPE_t(k) and q_pe' = M^-T q_pe keeps every attention logit exact.
struct RopeTransform {
  std::vector<float> scales;  // [rope_dim / 2], s_i > 0
  std::vector<float> angles;  // [rope_dim / 2], phi_i in radians
};

// Folds `transform` into `layer`: kv_a_proj rows [r, r + d_r) <- M rows, every head's q_pe rows
// (q_b_proj, or q_proj without q_lora_rank) <- M^-T rows. Throws ShapeError when the transform
// does not have rope_dim / 2 pairs and InvalidArgument for a scale that is not positive and
// finite.
void fold_rope_transform(Model& model, int64_t layer, const RopeTransform& transform);

// The QuaRot-style baseline: an independent random Hadamard rotation per layer (seed + layer).
void fold_random_hadamard(Model& model, uint64_t seed);

}  // namespace quantmla
