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

// The QuaRot-style baseline: an independent random Hadamard rotation per layer (seed + layer).
void fold_random_hadamard(Model& model, uint64_t seed);

}  // namespace quantmla
