// Expanded-form prefill attention (prefill_attention.h): the up-projection, then per query tile
// S = Q_nope K_nope^T + Q_pe K_pe^T (cuBLASLt, FP32), the causal softmax (here), O = P V.
#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/prefill_attention.h"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

constexpr int kSoftmaxThreads = 256;
constexpr int64_t kMaxQueryTile = 512;  // smaller tiles skip more of the causal mask's zeros
constexpr int64_t kMinQueryTile = 64;
constexpr int64_t kMinScoreElements = int64_t{1} << 25;  // 192 MiB of scores and probabilities

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Running (max, sum of exp(x - max)) pairs, merged: one pass over the scores finds both.
struct MaxSum {
  float max;
  float sum;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.sum * exp2f(a.max - m) + b.sum * exp2f(b.max - m)};
}

__device__ __forceinline__ MaxSum block_merge(MaxSum v, MaxSum* partial) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.max, offset),
                  __shfl_xor_sync(0xffffffffu, v.sum, offset)});
  }
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  MaxSum total = partial[0];
  for (int w = 1; w < kSoftmaxThreads / 32; ++w) total = merge(total, partial[w]);
  return total;
}

// One block per score row: a pass for the maximum and the sum (online, in the log2 domain of the
// scaled scores), a pass that writes the probabilities.
__global__ void __launch_bounds__(kSoftmaxThreads)
    causal_softmax_kernel(const __grid_constant__ CausalSoftmaxParams p) {
  wait_for_previous_kernel();
  __shared__ MaxSum partial[kSoftmaxThreads / 32];
  const int64_t row = blockIdx.x;
  const int64_t visible = min(p.first_visible + row / p.heads + 1, p.keys);
  const float* s = p.scores + row * p.ld;
  uint16_t* out = p.probs + row * p.ld;
  constexpr float kLog2e = 1.4426950408889634f;
  const float scale = p.scale * kLog2e;
  MaxSum mine{-INFINITY, 0.0f};
  for (int64_t j = threadIdx.x; j < visible; j += kSoftmaxThreads) {
    const float x = s[j] * scale;
    if (x > mine.max) {
      mine.sum = mine.sum * exp2f(mine.max - x) + 1.0f;
      mine.max = x;
    } else {
      mine.sum += exp2f(x - mine.max);
    }
  }
  const MaxSum total = block_merge(mine, partial);
  const float inv = 1.0f / total.sum;
  for (int64_t j = threadIdx.x; j < p.keys; j += kSoftmaxThreads) {
    const float prob = j < visible ? exp2f(fmaf(s[j], scale, -total.max)) * inv : 0.0f;
    out[j] = __bfloat16_as_ushort(__float2bfloat16_rn(prob));
  }
}

std::string str(int64_t v) { return std::to_string(v); }

}  // namespace

int64_t prefill_score_elements(int heads, int64_t max_context) {
  return std::max(heads * kMinQueryTile * round_up(max_context, 8), kMinScoreElements);
}

int64_t prefill_query_tile(int heads, int64_t tokens, int64_t context, int64_t max_context) {
  const int64_t fits = prefill_score_elements(heads, max_context) / (heads * round_up(context, 8));
  int64_t tile = std::min(kMaxQueryTile, fits);
  if (tile >= kMinQueryTile) tile = tile / kMinQueryTile * kMinQueryTile;
  return std::min(tile, tokens);
}

size_t PrefillAttentionWorkspace::bytes_for(int heads, int nope, int v, int64_t max_context) {
  const int64_t ctx = round_up(max_context, 8);
  const int64_t elements = prefill_score_elements(heads, max_context);
  return align256(static_cast<size_t>(ctx * heads * (nope + v)) * 2) +
         align256(static_cast<size_t>(elements) * 4) + align256(static_cast<size_t>(elements) * 2);
}

void causal_softmax(const CausalSoftmaxParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.heads < 1 || p.keys < 1 || p.ld < p.keys || p.first_visible < 0) {
    throw ShapeError("causal_softmax: rows " + str(p.rows) + ", heads " + str(p.heads) + ", keys " +
                     str(p.keys) + ", ld " + str(p.ld) + ", first_visible " + str(p.first_visible) +
                     " (need rows >= 0, heads, keys >= 1, ld >= keys)");
  }
  if (p.rows == 0) return;
  if (p.scores == nullptr || p.probs == nullptr) {
    throw InvalidArgument("causal_softmax: scores and probs must be device pointers, got null");
  }
  launch_kernel(causal_softmax_kernel, static_cast<unsigned>(p.rows * p.heads), kSoftmaxThreads, 0,
                stream, p);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

void prefill_attention(GemmRunner& gemm, const PrefillAttentionParams& p,
                       const PrefillAttentionWorkspace& workspace, cudaStream_t stream) {
  const int64_t qk = p.nope + p.rope, kv = p.nope + p.v;
  if (p.heads < 1 || p.nope < 1 || p.rope < 1 || p.v < 1 || p.rank < 1 || p.tokens < 0 ||
      p.context < p.tokens || p.keys_stride < p.rank + p.rope || p.out_stride < p.heads * p.v) {
    throw ShapeError("prefill_attention: heads " + str(p.heads) + ", nope " + str(p.nope) +
                     ", rope " + str(p.rope) + ", v " + str(p.v) + ", rank " + str(p.rank) +
                     ", tokens " + str(p.tokens) + ", context " + str(p.context) +
                     ", keys_stride " + str(p.keys_stride) + ", out_stride " + str(p.out_stride) +
                     " (need positive dimensions, context >= tokens, keys_stride >= rank + rope, "
                     "out_stride >= heads * v)");
  }
  if (p.context > workspace.max_context ||
      workspace.bytes <
          PrefillAttentionWorkspace::bytes_for(p.heads, p.nope, p.v, workspace.max_context)) {
    throw ShapeError("prefill_attention: context " + str(p.context) + " with a workspace of " +
                     str(static_cast<int64_t>(workspace.bytes)) + " bytes for contexts up to " +
                     str(workspace.max_context));
  }
  if (p.tokens == 0) return;
  if (p.q == nullptr || p.keys == nullptr || p.kv_b == nullptr || p.out == nullptr ||
      workspace.device == nullptr) {
    throw InvalidArgument("prefill_attention: q, keys, kv_b, out and the workspace must be set");
  }
  const int64_t ld = round_up(p.context, 8);
  auto* expanded = static_cast<uint16_t*>(workspace.device);
  const int64_t elements = prefill_score_elements(p.heads, workspace.max_context);
  auto* scores = reinterpret_cast<float*>(
      static_cast<uint8_t*>(workspace.device) +
      align256(static_cast<size_t>(round_up(workspace.max_context, 8) * p.heads * kv) * 2));
  auto* probs = reinterpret_cast<uint16_t*>(reinterpret_cast<uint8_t*>(scores) +
                                            align256(static_cast<size_t>(elements) * 4));

  // expanded[j, h] = [k_nope ; v] of key j for head h.
  gemm.linear(p.context, p.heads * kv, p.rank, p.keys, p.keys_stride, p.kv_b, p.rank, expanded,
              p.heads * kv, DType::kBF16, 0.0f, stream);

  const int64_t tile = prefill_query_tile(p.heads, p.tokens, p.context, workspace.max_context);
  const int64_t first_position = p.context - p.tokens;
  for (int64_t t0 = 0; t0 < p.tokens; t0 += tile) {
    const int64_t rows = std::min(tile, p.tokens - t0);
    const int64_t keys = first_position + t0 + rows;  // the last query's visible keys
    const uint16_t* q = p.q + t0 * p.heads * qk;
    BatchedGemmParams nope;  // scores[r, h, j] = q_nope[r, h] . k_nope[j, h]
    nope.batch = p.heads;
    nope.m = rows;
    nope.n = keys;
    nope.k = p.nope;
    nope.x = q;
    nope.ldx = p.heads * qk;
    nope.stride_x = qk;
    nope.w = expanded;
    nope.ldw = p.heads * kv;
    nope.stride_w = kv;
    nope.op_w = GemmOp::kT;
    nope.y = scores;
    nope.ldy = p.heads * ld;
    nope.stride_y = ld;
    nope.out_dtype = DType::kF32;
    gemm.batched(nope, stream);
    // + q_pe[r, h] . k_pe[j]: k_pe is shared by the heads, so every (r, h) is one row of a single
    // product (q contiguous: row (r, h) at (r * heads + h) * qk).
    gemm.linear(rows * p.heads, keys, p.rope, q + p.nope, qk, p.keys + p.rank, p.keys_stride,
                scores, ld, DType::kF32, 1.0f, stream);
    CausalSoftmaxParams softmax;
    softmax.scores = scores;
    softmax.probs = probs;
    softmax.ld = ld;
    softmax.rows = rows;
    softmax.keys = keys;
    softmax.first_visible = first_position + t0;
    softmax.heads = p.heads;
    softmax.scale = p.softmax_scale;
    causal_softmax(softmax, stream);
    BatchedGemmParams values;  // out[r, h] = sum_j probs[r, h, j] v[j, h]
    values.batch = p.heads;
    values.m = rows;
    values.n = p.v;
    values.k = keys;
    values.x = probs;
    values.ldx = p.heads * ld;
    values.stride_x = ld;
    values.w = expanded + p.nope;
    values.ldw = p.heads * kv;
    values.stride_w = kv;
    values.op_w = GemmOp::kN;
    values.y = p.out + t0 * p.out_stride;
    values.ldy = p.out_stride;
    values.stride_y = p.v;
    values.out_dtype = DType::kBF16;
    gemm.batched(values, stream);
  }
}

}  // namespace quantmla::gpu
