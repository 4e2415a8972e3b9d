// Mixture-of-experts steps of the CUDA model runner: routing (route_token's semantics, one warp
// per token), a stable sort of the (token, choice) pairs by expert, the gather of the hidden rows
// in expert order, the experts' MLPs as one GEMM per expert and projection, and the weighted
// combine back into the residual stream. Every pointer is a device pointer unless it says host;
// strides are in elements; BF16 tensors are passed as their uint16_t bits. Nothing here allocates
// or synchronizes; every result is deterministic (no floating-point atomics).
//
// One MoE layer (n tokens, k = top_k, slots = n * k):
//   gemm.linear(router)                     -> router_logits [n, E] FP32
//   moe_route                               -> experts [n, k], weights [n, k]
//   moe_sort                                -> counts, offsets [E + 1], slot_of, token_of_slot
//   (moe_route_sort: both, one kernel when the n * k choices fit one block)
//   cudaMemcpyAsync(offsets -> pinned host) + an event, waited for after the shared experts are
//   queued                                  (the one host wait of the layer)
//   moe_gather(h, token_of_slot)            -> sorted [slots, d] BF16
//   moe_expert_mlps(host offsets)           -> expert_out [slots, d] FP32
//   moe_combine                             -> x += sum_j w[t, j] expert_out[slot_of[t, j]]
//   (shared experts: an ordinary MLP with beta = 1 into x)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cuda/gemm.h"
#include "quantmla/config.h"

namespace quantmla::gpu {

inline constexpr int kMaxRoutedExperts = 256;  // E of one router (DeepSeek-V3: 256)
inline constexpr int kMaxExpertsPerToken = 8;  // top_k (V3: 8)
inline constexpr int kMaxExpertGroups = 8;     // n_group (V3: 8)

enum class MoeScoring { kSoftmax, kSigmoid };                         // scoring_func
enum class MoeTopkMethod { kGreedy, kGroupLimitedGreedy, kNoauxTc };  // topk_method

struct MoeRouteParams {
  int num_experts = 0;  // E, 1..kMaxRoutedExperts
  int top_k = 0;        // 1..min(kMaxExpertsPerToken, E)
  MoeScoring scoring = MoeScoring::kSoftmax;
  MoeTopkMethod method = MoeTopkMethod::kGreedy;
  int n_group = 1;     // group methods: 1..kMaxExpertGroups, divides E
  int topk_group = 1;  // group methods: 1..n_group
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
};

// The router parameters of a config (scoring_func, topk_method, ...). Throws InvalidArgument for
// an unknown scoring function or top-k method, as route_token does.
MoeRouteParams moe_route_params(const ModelConfig& config);

// Per token t, exactly route_token (src/model/moe_router.cpp): scores = sigmoid(logits) or
// softmax(logits) (the sum in index order, in FP32); choice = scores (+ correction_bias for
// noaux_tc); group methods keep the topk_group best groups (group score: its best choice, or for
// noaux_tc the sum of its two best) and set the other experts' choice to 0 (not -inf); experts =
// the top_k choices, descending, ties to the lower index; weights = the unbiased scores of those,
// divided by (their sum in j order + 1e-20) when norm_topk_prob and (noaux_tc or top_k > 1),
// times routed_scaling_factor when noaux_tc or not norm_topk_prob.
//   router_logits: [n, E] FP32, row stride ld_logits >= E;
//   correction_bias: [E] FP32 or null (noaux_tc only; ignored by the V2 methods);
//   out_experts: [n, top_k] int32; out_weights: [n, top_k] FP32 (both contiguous).
// Throws InvalidArgument for parameters outside the limits above (with their values).
void moe_route(const float* router_logits, int64_t ld_logits, const float* correction_bias,
               int32_t* out_experts, float* out_weights, int64_t n, const MoeRouteParams& params,
               cudaStream_t stream);

// Outputs of moe_sort (all device, int32):
struct MoeSortBuffers {
  int32_t* counts = nullptr;         // [E] slots of each expert
  int32_t* offsets = nullptr;        // [S + E + 1] exclusive prefix sum; offsets[S + E] = rows
  int32_t* slot_of = nullptr;        // [n * k] slot (row) of entry (t, j) = experts[t * k + j]
  int32_t* token_of_slot = nullptr;  // [S * n + n * k] token of each row
  void* workspace = nullptr;         // moe_sort_workspace_bytes(n, k, E) bytes, 4-byte aligned
  // S = shared_groups > 0 (decode steps, where one grouped product runs the shared and the routed
  // experts): S groups of n rows each come first, one per shared expert's slice (group i owns
  // rows [i n, (i + 1) n), row i n + t reads token t), and the routed slots follow from row S n,
  // which offsets, slot_of and token_of_slot then count in. counts stay the routed experts'.
  int shared_groups = 0;
};

// Bytes of MoeSortBuffers::workspace: 4 * E * ceil(n * k / 256).
size_t moe_sort_workspace_bytes(int64_t n, int k, int num_experts);

// Counting sort of the n * k (token, j) entries by expert, stable: within an expert the slots are
// in increasing (t, j) order, so the result depends on the choices only. An entry whose expert is
// outside [0, E) (not produced by moe_route) gets no slot: slot_of = -1, it is not counted, and
// the slots past offsets[E] have token_of_slot = -1. Three kernels, no host synchronization.
//   experts: [n, k] int32 (moe_route's out_experts).
// Throws InvalidArgument for num_experts outside [1, 4096], k < 1, or missing buffers.
void moe_sort(const int32_t* experts, int64_t n, int k, int num_experts,
              const MoeSortBuffers& buffers, cudaStream_t stream);

// moe_route then moe_sort (the same outputs, bit for bit), in one kernel when the n * top_k
// entries fit one block (decode steps; two launches otherwise). Throws as moe_route and moe_sort.
void moe_route_sort(const float* router_logits, int64_t ld_logits, const float* correction_bias,
                    int32_t* out_experts, float* out_weights, int64_t n,
                    const MoeRouteParams& params, const MoeSortBuffers& buffers,
                    cudaStream_t stream);

// sorted[s, :] = h[token_of_slot[s], :] for s in [0, slots) (a token of -1 or outside [0, n):
// zeros).
//   h: [n, d] BF16 bits, row stride ld_h; token_of_slot: [slots] int32;
//   sorted: [slots, d] BF16 bits, row stride ld_sorted.
void moe_gather(const uint16_t* h, int64_t ld_h, int64_t n, const int32_t* token_of_slot,
                int64_t slots, uint16_t* sorted, int64_t ld_sorted, int64_t d, cudaStream_t stream);

// x[t, :] += s, s = sum over j in [0, k), in j order, of weights[t, j] * expert_out[slot_of[t, j],
// :] (s starts at 0, each term one fused multiply-add; entries with slot_of < 0 are skipped), then
// plus expert_out[i * n + t, :] for each of the shared_groups shared experts' row blocks in order
// (MoeSortBuffers::shared_groups). One thread per output element: deterministic, no atomics (the
// arithmetic of moe_combine.cuh, which the skinny product's combining tail shares).
//   expert_out: [slots, d] FP32 (or BF16 bits: the second form) in slot order, row stride
//   ld_expert_out; slot_of: [n, k] int32; weights: [n, k] FP32; x: [n, d] FP32, row stride ld_x.
void moe_combine(const float* expert_out, int64_t ld_expert_out, const int32_t* slot_of,
                 const float* weights, float* x, int64_t ld_x, int64_t n, int k, int64_t d,
                 cudaStream_t stream, int shared_groups = 0);
void moe_combine(const uint16_t* expert_out, int64_t ld_expert_out, const int32_t* slot_of,
                 const float* weights, float* x, int64_t ld_x, int64_t n, int k, int64_t d,
                 cudaStream_t stream, int shared_groups = 0);

// The layout of the routed experts as one strided-batched GEMM, on the host: the reference of
// moe_pad_layout (the runner's, on the device) in the tests: expert x's slots [offsets[x],
// offsets[x + 1]) become rows [x * rows, x * rows + their count); the rest of each block of `rows`
// is padding.
//   offsets: [E + 1]; token_of_slot: [offsets[E]];
//   token_of_row (out): [E * rows], the token each row gathers, -1 for padding (moe_gather gives
//   such rows zeros);
//   slot_of (in, out): [n * k] moe_sort's slots, rewritten as rows (-1 stays -1).
// Throws InvalidArgument when rows is less than an expert's count or the offsets are not a
// prefix sum.
void pad_expert_layout(const int32_t* offsets, int num_experts, const int32_t* token_of_slot,
                       int64_t rows, std::vector<int32_t>& token_of_row,
                       std::vector<int32_t>& slot_of);

// pad_expert_layout on the device, from moe_sort's buffers where they are, so that the layout
// costs no copy back and no host synchronization (pad_expert_layout is its reference):
//   offsets: [E + 1]; token_of_slot: [offsets[E]]; experts: [entries] moe_route's choices (the
//   entries moe_sort sorted); slot_of: [entries] moe_sort's slots;
//   token_of_row (out): [E * rows]; padded_slot_of (out): [entries], slot_of in the padded layout.
// Requires rows >= every expert's count (the busiest count, from the offsets read back): not
// checked on the device. Throws ShapeError for E < 1, rows < 1 or sizes past 2^31 - 1,
// InvalidArgument for a null buffer.
void moe_pad_layout(const int32_t* offsets, int num_experts, const int32_t* token_of_slot,
                    const int32_t* experts, const int32_t* slot_of, int64_t entries, int64_t rows,
                    int32_t* token_of_row, int32_t* padded_slot_of, cudaStream_t stream);

// The routed experts' weights: host arrays of E device pointers (an expert that gets no slot may
// be null). Separate gate and up matrices, so the checkpoint's tensors are used as they are.
struct MoeExpertWeights {
  const uint16_t* const* gate = nullptr;  // [E] -> [inner, d] BF16 bits
  const uint16_t* const* up = nullptr;    // [E] -> [inner, d] BF16 bits
  const uint16_t* const* down = nullptr;  // [E] -> [d, inner] BF16 bits
};

// For every expert e with rows [offsets[e], offsets[e + 1]) of `sorted`:
//   gate_up[rows, 0:inner]         = sorted[rows] gate_e^T     (FP32)
//   gate_up[rows, inner:2 inner]   = sorted[rows] up_e^T       (FP32)
//   act[rows]                      = bf16(silu(gate) * up)     (one silu_mul over all slots)
//   out[rows]                      = act[rows] down_e^T        (FP32)
// i.e. 3 GEMMs per non-empty expert and one silu_mul; experts without rows cost nothing.
//   host_offsets: HOST [E + 1], moe_sort's offsets copied back (non-decreasing from 0);
//   sorted: [slots, d] BF16 bits, row stride ld_sorted (moe_gather's output);
//   gate_up: workspace [host_offsets[E], 2 * inner] FP32 (contiguous);
//   act: workspace [host_offsets[E], inner] BF16 bits (contiguous);
//   out: [host_offsets[E], d] FP32 in slot order, row stride ld_out (moe_combine's expert_out).
// Throws InvalidArgument for offsets that are not a prefix sum or a missing weight of an expert
// that has rows; GemmRunner's errors otherwise.
void moe_expert_mlps(GemmRunner& gemm, const int32_t* host_offsets, int num_experts,
                     const uint16_t* sorted, int64_t ld_sorted, const MoeExpertWeights& weights,
                     int64_t d, int64_t inner, float* gate_up, uint16_t* act, float* out,
                     int64_t ld_out, cudaStream_t stream);

}  // namespace quantmla::gpu
