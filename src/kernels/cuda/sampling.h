// Next-token choice on the GPU for a batch of logit rows: greedy at temperature 0, otherwise
// temperature + top-p (nucleus) sampling driven by a counter-based draw, so that a (seed, step)
// pair always gives the same token for the same logits, whatever the batch. The draw and the
// order in which it is spent are the CPU's (sample_token / counter_uniform in
// quantmla/sampler.h), so the two agree except where FP32 and double probabilities put the draw
// on different sides of a boundary, or at ties. No sort, no workspace: one thread block per row.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace quantmla::gpu {

// Per row, on the device (an array of `rows`).
struct SampleParams {
  float temperature = 0.0f;  // <= 0 (or NaN): greedy
  float top_p = 1.0f;        // (0, 1]; >= 1: the whole distribution; <= 0 (or NaN): greedy
  uint64_t seed = 0;
  uint64_t step = 0;  // the draw's counter: the CPU runners use the sampled token's position
};
static_assert(sizeof(SampleParams) == 24);

// The uniform draw of (seed, step): u = (h >> 11) * 2^-53 in [0, 1) with
// h = splitmix64(splitmix64(seed) ^ step) (the standard splitmix64 finalizer), the same value as
// counter_uniform(seed, step) of quantmla/sampler.h. Here so that the host can reproduce a draw.
constexpr uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
constexpr double sample_uniform(uint64_t seed, uint64_t step) {
  return static_cast<double>(splitmix64(splitmix64(seed) ^ step) >> 11) * 0x1.0p-53;
}

// out[r] = the token of row r.
//   logits: [rows, vocab] FP32, row stride ld_logits >= vocab; params: [rows] SampleParams
//   (device); out: [rows] int32.
// Greedy: the arg-max, the lowest index on ties (std::max_element, as the CPU).
// Sampling: p_i = exp2f((l_i - max) * log2(e) / temperature) in FP32 (the largest is exactly 1),
// S = their sum (sums in double). The nucleus is {i : p_i >= tau}, tau the largest FP32 value with
// sum_{p_i >= tau} p_i >= top_p * S, found exactly by bisection on the bits of tau. Unlike the
// CPU's sorted prefix, a tie at the threshold keeps every tied token, so the nucleus does not
// depend on an order among equal probabilities. The draw u = sample_uniform(seed, step) * (kept
// mass) is spent in descending probability, as the CPU does: the token is the first, in that
// order, whose running sum exceeds u (found by a second bisection, no sort); equal probabilities
// go in index order (the CPU's std::sort leaves their order unspecified).
// NaN logits, or a row whose logits are all -inf, give an unspecified in-range token.
// Throws ShapeError for rows < 0, vocab < 1 or ld_logits < vocab; InvalidArgument for null
// pointers.
void sample_tokens(const float* logits, int64_t ld_logits, int64_t rows, int64_t vocab,
                   const SampleParams* params, int32_t* out, cudaStream_t stream);

}  // namespace quantmla::gpu
