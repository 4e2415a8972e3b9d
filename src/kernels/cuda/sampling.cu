// sample_tokens: one block of 1024 threads per row. Arg-max, then for sampling rows the sum of
// the probabilities, the nucleus threshold by bisection on its FP32 bits (30 rounds, each a block
// reduction over the row), the drawn token's probability by a second bisection of the same kind,
// and its place among equal probabilities by an integer prefix sum. The probabilities are
// recomputed from the logits in every pass (the same expression, so the same values), which keeps
// the kernel free of workspace; the row stays in L2.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/sampling.h"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr uint32_t kOneBits = 0x3f800000u;  // 1.0f: the largest probability

// The one expression for a probability, used by every pass: the passes must agree bit for bit.
// exp2 of the logit difference times log2(e) / temperature (exp2f: 2 ulp, cheaper than expf).
__device__ __forceinline__ float probability(float logit, float max_logit, float scale) {
  return exp2f(__fmul_rn(__fsub_rn(logit, max_logit), scale));
}

struct Shared {
  double values[kWarps];
  float best_value[kWarps];
  int best_index[kWarps];
  double total;       // block_sum's broadcast
  float final_value;  // the arg-max's broadcast
  int final_index;
};

// Sum over the block in double, in a fixed order: every thread gets the same total. Warp sums,
// then thread 0 adds them in warp order and broadcasts the total.
__device__ double block_sum(double value, Shared& shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // the previous call's readers are done with shared
  if (lane == 0) shared.values[warp] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < kWarps; ++w) total += shared.values[w];
    shared.total = total;
  }
  __syncthreads();
  return shared.total;
}

// Sum over the block of p_i for p_i >= threshold (mass(threshold)).
__device__ double mass_from(float threshold, const float* row, int vocab, float max_logit,
                            float scale, Shared& shared) {
  double mass = 0.0;
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    const float p = probability(row[i], max_logit, scale);
    if (p >= threshold) mass += p;
  }
  return block_sum(mass, shared);
}

__device__ __forceinline__ bool better(float value, int index, float best_value, int best_index) {
  return value > best_value || (value == best_value && index < best_index);
}

__global__ void __launch_bounds__(kThreads)
    sample_kernel(const float* logits, int64_t ld_logits, int vocab, const SampleParams* params,
                  int32_t* out) {
  wait_for_previous_kernel();
  __shared__ Shared shared;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * ld_logits;
  const SampleParams param = params[blockIdx.x];

  // Arg-max, lowest index on ties; (-inf, INT_MAX) loses to every real entry.
  float best_value = -INFINITY;
  int best_index = INT_MAX;
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    const float v = row[i];
    if (better(v, i, best_value, best_index)) best_value = v, best_index = i;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, best_value, offset);
    const int i = __shfl_xor_sync(0xffffffffu, best_index, offset);
    if (better(v, i, best_value, best_index)) best_value = v, best_index = i;
  }
  if (lane == 0) {
    shared.best_value[warp] = best_value;
    shared.best_index[warp] = best_index;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      if (better(shared.best_value[w], shared.best_index[w], best_value, best_index)) {
        best_value = shared.best_value[w];
        best_index = shared.best_index[w];
      }
    }
    shared.final_value = best_value;
    shared.final_index = best_index;
  }
  __syncthreads();
  best_value = shared.final_value;
  best_index = shared.final_index;
  const int argmax = best_index < vocab ? best_index : 0;  // all NaN: index 0
  // !(x > 0) also sends NaN parameters to greedy.
  if (!(param.temperature > 0.0f) || !(param.top_p > 0.0f)) {
    if (threadIdx.x == 0) out[blockIdx.x] = argmax;
    return;
  }
  const float max_logit = best_value;
  const float scale = __fdiv_rn(1.4426950408889634f, param.temperature);  // log2(e) / T

  // mass(t) = sum_{p >= t} p is a step function of t that drops at each distinct p, and positive
  // floats order as their bits, so a bisection on the bits finds a step exactly in 30 rounds.
  const double total = mass_from(0.0f, row, vocab, max_logit, scale, shared);
  // tau: the largest t with mass(t) >= top_p * total (one of the p). Invariant: mass(lo) >=
  // target > mass(hi).
  uint32_t lo = 0;  // +0.0f: every token, mass = total
  double kept = total;
  if (param.top_p < 1.0f) {
    const double target = static_cast<double>(param.top_p) * total;
    uint32_t hi = kOneBits + 1;  // above the largest p (1.0f): mass 0 < target
    while (hi - lo > 1) {
      const uint32_t mid = lo + (hi - lo) / 2;
      const double mass = mass_from(__uint_as_float(mid), row, vocab, max_logit, scale, shared);
      if (mass >= target) {  // the same value in every thread: a uniform branch
        lo = mid;
        kept = mass;
      } else {
        hi = mid;
      }
    }
  }

  // The draw, in the CPU's order (descending probability): the token is the first whose running
  // sum of kept p exceeds u. Its probability v is the largest t >= tau with mass(t) > u; the
  // tokens before it are those with p > v (mass `above`) and the tokens with p == v before it
  // in index order. Starting at the smallest positive float keeps underflowed (p = 0) tokens out.
  // Capped just below kept: the product can round up to kept (r = 1 - 2^-53, kept = 1).
  const double u = fmin(sample_uniform(param.seed, param.step) * kept, kept - kept * 0x1.0p-52);
  uint32_t v_lo = lo > 1u ? lo : 1u;
  uint32_t v_hi = kOneBits + 1;
  double above = 0.0;  // mass(v_hi)
  while (v_hi - v_lo > 1) {
    const uint32_t mid = v_lo + (v_hi - v_lo) / 2;
    const double mass = mass_from(__uint_as_float(mid), row, vocab, max_logit, scale, shared);
    if (mass > u) {
      v_lo = mid;
    } else {
      v_hi = mid;
      above = mass;
    }
  }
  const float v = __uint_as_float(v_lo);

  // Tokens with p == v in index order: thread t owns the contiguous range [t * span, ...), so an
  // exclusive prefix sum of the per-thread counts (integers: exact) locates the wanted one.
  const int span = (vocab + kThreads - 1) / kThreads;
  const int begin = min(vocab, static_cast<int>(threadIdx.x) * span);
  const int end = min(vocab, begin + span);
  int mine = 0;
  for (int i = begin; i < end; ++i) mine += probability(row[i], max_logit, scale) == v;
  int inclusive = mine;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  __syncthreads();  // block_sum's readers are done with shared
  if (lane == 31) shared.best_index[warp] = inclusive;
  __syncthreads();
  int warp_base = 0;
  int equal = 0;  // tokens with p == v in the row
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) warp_base += shared.best_index[w];
    equal += shared.best_index[w];
  }
  if (equal == 0) {  // cannot happen for finite logits (v is one of the p); NaN rows end here
    if (threadIdx.x == 0) out[blockIdx.x] = argmax;
    return;
  }
  // u - above < (tokens with p == v) * v; rounding may put it one past the end: clamp.
  const double position = floor((u - above) / static_cast<double>(v));
  const int wanted =
      position <= 0.0 ? 0 : (position >= equal ? equal - 1 : static_cast<int>(position));
  const int first = warp_base + inclusive - mine;  // this thread's first tied token's rank
  if (wanted >= first && wanted < first + mine) {
    int rank = first;
    for (int i = begin; i < end; ++i) {
      if (probability(row[i], max_logit, scale) == v && rank++ == wanted) {
        out[blockIdx.x] = i;
        break;
      }
    }
  }
}

}  // namespace

void sample_tokens(const float* logits, int64_t ld_logits, int64_t rows, int64_t vocab,
                   const SampleParams* params, int32_t* out, cudaStream_t stream) {
  if (rows < 0 || rows > INT_MAX || vocab < 1 || vocab > INT_MAX - kThreads || ld_logits < vocab) {
    throw ShapeError("sample_tokens: rows " + std::to_string(rows) + ", vocab " +
                     std::to_string(vocab) + ", ld_logits " + std::to_string(ld_logits) +
                     " (need 0 <= rows <= 2^31 - 1, 1 <= vocab < 2^31 - 1024, ld_logits >= vocab)");
  }
  if (rows == 0) return;
  if (logits == nullptr || params == nullptr || out == nullptr) {
    throw InvalidArgument(
        "sample_tokens: logits, params and out must be device pointers, got null");
  }
  launch_kernel(sample_kernel, static_cast<unsigned>(rows), kThreads, 0, stream, logits, ld_logits,
                static_cast<int>(vocab), params, out);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

}  // namespace quantmla::gpu
