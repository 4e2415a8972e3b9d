// Kernels of moe_ops.h. Routing is one warp per token with the token's scores in shared memory;
// the top-k selections are rounds of warp-wide arg-max with the lower index winning ties, which is
// what route_token's stable sort on "greater" produces. The sort is a chunked counting sort whose
// ranks come from each chunk's own order, so it is stable and needs no atomics beyond the integer
// histogram (whose counts do not depend on the order of the increments).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/model_ops.h"
#include "kernels/cuda/moe_ops.h"
#include "kernels/cuda/sort_scan_runs.h"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

constexpr int kRouteWarps = 4;
constexpr int kExpertsPerLane = kMaxRoutedExperts / 32;

struct RouteKernelParams {
  const float* logits;  // [n, E], row stride ld_logits
  int64_t ld_logits;
  const float* bias;  // [E] or null
  int32_t* experts;   // [n, top_k]
  float* weights;     // [n, top_k]
  int64_t n;
  MoeRouteParams config;
};

// Warp-wide arg-max: the largest value, the lower index on ties. Every lane gets the winner.
__device__ __forceinline__ void warp_argmax(float& value, int& index) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other_value = __shfl_xor_sync(0xffffffffu, value, offset);
    const int other_index = __shfl_xor_sync(0xffffffffu, index, offset);
    if (other_value > value || (other_value == value && other_index < index)) {
      value = other_value;
      index = other_index;
    }
  }
}

// Token t's choices and weights by one whole warp; scores: [kMaxRoutedExperts] and group_scores:
// [kMaxExpertGroups] the warp's own shared memory.
__device__ void route_token(const RouteKernelParams& p, int64_t t, float* scores,
                            float* group_scores) {
  const int lane = threadIdx.x % 32;
  const MoeRouteParams& c = p.config;
  const int num_experts = c.num_experts;
  const float* logits = p.logits + t * p.ld_logits;

  // Expert e = lane + 32 j lives in slot j of its lane.
  float score[kExpertsPerLane];
  if (c.scoring == MoeScoring::kSigmoid) {
#pragma unroll
    for (int j = 0; j < kExpertsPerLane; ++j) {
      const int e = lane + 32 * j;
      score[j] = e < num_experts ? __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-logits[e]))) : 0.0f;
    }
  } else {
    float max_logit = -INFINITY;
#pragma unroll
    for (int j = 0; j < kExpertsPerLane; ++j) {
      const int e = lane + 32 * j;
      score[j] = e < num_experts ? logits[e] : -INFINITY;
      max_logit = fmaxf(max_logit, score[j]);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      max_logit = fmaxf(max_logit, __shfl_xor_sync(0xffffffffu, max_logit, offset));
    }
#pragma unroll
    for (int j = 0; j < kExpertsPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < num_experts) scores[e] = score[j] = expf(__fsub_rn(score[j], max_logit));
    }
    __syncwarp();
    // The CPU's sum runs in index order in FP32; a serial sum by one lane keeps that order
    // (E <= 256 additions, negligible next to the router GEMM).
    float sum = 0.0f;
    if (lane == 0) {
      for (int e = 0; e < num_experts; ++e) sum = __fadd_rn(sum, scores[e]);
    }
    sum = __shfl_sync(0xffffffffu, sum, 0);
#pragma unroll
    for (int j = 0; j < kExpertsPerLane; ++j) score[j] = __fdiv_rn(score[j], sum);
  }

  float choice[kExpertsPerLane];
#pragma unroll
  for (int j = 0; j < kExpertsPerLane; ++j) {
    const int e = lane + 32 * j;
    choice[j] = score[j];
    if (c.method == MoeTopkMethod::kNoauxTc && p.bias != nullptr && e < num_experts) {
      choice[j] = __fadd_rn(choice[j], p.bias[e]);
    }
  }
  __syncwarp();  // the softmax's lane 0 has finished reading scores[]
#pragma unroll
  for (int j = 0; j < kExpertsPerLane; ++j) {
    const int e = lane + 32 * j;
    if (e < num_experts) scores[e] = choice[j];
  }
  __syncwarp();

  if (c.method != MoeTopkMethod::kGreedy) {
    const int group_size = num_experts / c.n_group;
    const bool sum_top_two = c.method == MoeTopkMethod::kNoauxTc && group_size >= 2;
    if (lane < c.n_group) {
      // The two largest members, duplicates counted twice (the CPU sorts the members).
      float best = -INFINITY;
      float second = -INFINITY;
      for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
        const float v = scores[e];
        if (v > best) {
          second = best;
          best = v;
        } else if (v > second) {
          second = v;
        }
      }
      group_scores[lane] = sum_top_two ? __fadd_rn(best, second) : best;
    }
    __syncwarp();
    // Every lane picks the same topk_group groups (n_group <= 8 values, lower index on ties).
    unsigned kept = 0;
    for (int r = 0; r < c.topk_group; ++r) {
      int best_group = -1;
      for (int g = 0; g < c.n_group; ++g) {
        if ((kept >> g) & 1u) continue;
        if (best_group < 0 || group_scores[g] > group_scores[best_group]) best_group = g;
      }
      kept |= 1u << best_group;
    }
#pragma unroll
    for (int j = 0; j < kExpertsPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e < num_experts && !((kept >> (e / group_size)) & 1u)) choice[j] = 0.0f;
    }
  }

  // Scores are needed again for the weights: restore the unbiased ones.
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kExpertsPerLane; ++j) {
    const int e = lane + 32 * j;
    if (e < num_experts) scores[e] = score[j];
  }
  __syncwarp();

  unsigned taken = 0;  // bit j: expert lane + 32 j chosen already (or past E)
#pragma unroll
  for (int j = 0; j < kExpertsPerLane; ++j) {
    if (lane + 32 * j >= num_experts) taken |= 1u << j;
  }
  int chosen[kMaxExpertsPerToken];
  for (int r = 0; r < c.top_k; ++r) {
    float value = -INFINITY;
    int index = INT_MAX;
#pragma unroll
    for (int j = 0; j < kExpertsPerLane; ++j) {
      const int e = lane + 32 * j;
      if (((taken >> j) & 1u) == 0 && (index == INT_MAX || choice[j] > value)) {
        value = choice[j];  // slots are visited in increasing e, so ">" keeps the lower index
        index = e;
      }
    }
    warp_argmax(value, index);
    if (index % 32 == lane) taken |= 1u << (index / 32);
    chosen[r] = index;
  }

  if (lane == 0) {
    float w[kMaxExpertsPerToken];
    for (int r = 0; r < c.top_k; ++r) w[r] = scores[chosen[r]];
    const bool is_v3 = c.method == MoeTopkMethod::kNoauxTc;
    if (c.norm_topk_prob && (is_v3 || c.top_k > 1)) {
      float denominator = 0.0f;
      for (int r = 0; r < c.top_k; ++r) denominator = __fadd_rn(denominator, w[r]);
      denominator = __fadd_rn(denominator, 1e-20f);
      for (int r = 0; r < c.top_k; ++r) w[r] = __fdiv_rn(w[r], denominator);
    }
    // V3 scales always; the V2 reference code scales only when it does not renormalize.
    if (is_v3 || !c.norm_topk_prob) {
      for (int r = 0; r < c.top_k; ++r) w[r] = __fmul_rn(w[r], c.routed_scaling_factor);
    }
    for (int r = 0; r < c.top_k; ++r) {
      p.experts[t * c.top_k + r] = chosen[r];
      p.weights[t * c.top_k + r] = w[r];
    }
  }
}

__global__ void __launch_bounds__(32 * kRouteWarps)
    moe_route_kernel(const __grid_constant__ RouteKernelParams p) {
  wait_for_previous_kernel();
  __shared__ float scores_of_warp[kRouteWarps][kMaxRoutedExperts];
  __shared__ float group_score_of_warp[kRouteWarps][kMaxExpertGroups];
  const int warp = threadIdx.x / 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp;
  if (t >= p.n) return;  // whole warps: the shuffles see full warps
  route_token(p, t, scores_of_warp[warp], group_score_of_warp[warp]);
}

// ---- sort ----

constexpr int kSortChunk = 256;  // entries per block of the histogram and scatter kernels
constexpr int kMaxSortExperts = 4096;

// chunk_counts[c, e] = entries of chunk c with expert e.
__global__ void __launch_bounds__(kSortChunk)
    sort_histogram_kernel(const int32_t* experts, int64_t entries, int num_experts,
                          int32_t* chunk_counts) {
  wait_for_previous_kernel();
  extern __shared__ int32_t histogram[];  // [num_experts]
  for (int e = threadIdx.x; e < num_experts; e += kSortChunk) histogram[e] = 0;
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kSortChunk + threadIdx.x;
  if (i < entries) {
    const int32_t e = experts[i];
    if (e >= 0 && e < num_experts) atomicAdd(&histogram[e], 1);
  }
  __syncthreads();
  int32_t* out = chunk_counts + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += kSortChunk) out[e] = histogram[e];
}

// counts[0..n) -> their exclusive prefix sums, counts[n] = the total (one thread: E <= 4096).
__device__ void exclusive_prefix_sum(int32_t* counts, int n) {
  int32_t running = 0;
  for (int e = 0; e < n; ++e) {
    const int32_t count = counts[e];
    counts[e] = running;
    running += count;
  }
  counts[n] = running;
}

// MoeSortBuffers::shared_groups: the shared groups' offsets and rows, ahead of the routed ones
// (n tokens each). The whole block calls it.
__device__ void write_shared_rows(int32_t* offsets, int32_t* token_of_slot, int shared_groups,
                                  int64_t n) {
  for (int i = threadIdx.x; i < shared_groups; i += blockDim.x) {
    offsets[i] = static_cast<int32_t>(i * n);
  }
  for (int64_t r = threadIdx.x; r < shared_groups * n; r += blockDim.x) {
    token_of_slot[r] = static_cast<int32_t>(r % n);
  }
}

// One block: counts, offsets, and chunk_counts[c, e] rewritten as the first slot of chunk c's
// entries of expert e (routed slots, before the shared groups' base). An expert's column of
// chunks is cut into runs summed side by side (sort_scan_runs.h), so that a 2K-token prefill's
// 48 chunks are a few dependent loads per thread instead of 48 (exact integer sums: any cut gives
// the same slots).
__global__ void __launch_bounds__(kScanThreads, 1)
    sort_scan_kernel(int32_t* chunk_counts, int64_t chunks, int num_experts, int64_t entries, int k,
                     int shared_groups, int32_t* counts, int32_t* offsets, int32_t* token_of_slot) {
  wait_for_previous_kernel();
  const int64_t base = shared_groups * (entries / k);
  write_shared_rows(offsets, token_of_slot, shared_groups, entries / k);
  offsets += shared_groups;
  token_of_slot += base;
  extern __shared__ int32_t first_slot[];  // [num_experts + 1], then part_first[parts][E]
  const int parts = scan_parts(num_experts);
  int32_t* part_first = first_slot + num_experts + 1;
  // The thread's columns (experts) and its run of each: part `part`, chunks [c0, c1).
  const ScanRun run = scan_run(static_cast<int>(threadIdx.x), num_experts, chunks);
  const int part = run.part, first_column = part < 0 ? num_experts : run.first_expert;
  const int64_t c0 = run.first_chunk, c1 = run.end_chunk;
  for (int e = first_column; e < num_experts; e += kScanThreads) {
    int32_t total = 0;
    const int32_t* cell = chunk_counts + c0 * num_experts + e;
    for (int64_t c = c0; c < c1; ++c, cell += num_experts) total += *cell;
    part_first[part * num_experts + e] = total;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += kScanThreads) {
    int32_t total = 0;
    for (int q = 0; q < parts; ++q) {
      const int32_t count = part_first[q * num_experts + e];
      part_first[q * num_experts + e] = total;
      total += count;
    }
    counts[e] = total;
    first_slot[e] = total;
  }
  __syncthreads();
  if (threadIdx.x == 0) exclusive_prefix_sum(first_slot, num_experts);
  __syncthreads();
  for (int e = threadIdx.x; e <= num_experts; e += kScanThreads) {
    offsets[e] = static_cast<int32_t>(base + first_slot[e]);
  }
  for (int e = first_column; e < num_experts; e += kScanThreads) {
    int32_t slot = first_slot[e] + part_first[part * num_experts + e];
    int32_t* cell = chunk_counts + c0 * num_experts + e;
    for (int64_t c = c0; c < c1; ++c, cell += num_experts) {
      const int32_t count = *cell;
      *cell = slot;
      slot += count;
    }
  }
  for (int64_t s = first_slot[num_experts] + threadIdx.x; s < entries; s += kScanThreads) {
    token_of_slot[s] = -1;
  }
}

__global__ void __launch_bounds__(kSortChunk)
    sort_scatter_kernel(const int32_t* experts, int64_t entries, int k, int num_experts,
                        int shared_groups, const int32_t* chunk_first_slot, int32_t* slot_of,
                        int32_t* token_of_slot) {
  wait_for_previous_kernel();
  const int64_t base = shared_groups * (entries / k);
  __shared__ int32_t chunk_experts[kSortChunk];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kSortChunk + threadIdx.x;
  const int32_t e = i < entries ? experts[i] : -1;
  chunk_experts[threadIdx.x] = e;
  __syncthreads();
  if (i >= entries) return;
  if (e < 0 || e >= num_experts) {
    slot_of[i] = -1;
    return;
  }
  int32_t rank = 0;  // earlier entries of this chunk with the same expert: the stable order
  for (int j = 0; j < static_cast<int>(threadIdx.x); ++j) rank += chunk_experts[j] == e;
  const int64_t slot =
      base + chunk_first_slot[static_cast<int64_t>(blockIdx.x) * num_experts + e] + rank;
  slot_of[i] = static_cast<int32_t>(slot);
  token_of_slot[slot] = static_cast<int32_t>(i / k);
}

// The three kernels' work in one block of kSortChunk threads when the entries fit one chunk
// (decode steps: one launch instead of three): the same counts, offsets and stable slots.
// first_slot: [num_experts + 1] shared memory.
__device__ void sort_one_chunk(const int32_t* experts, int64_t entries, int k, int num_experts,
                               int shared_groups, int32_t* counts, int32_t* offsets,
                               int32_t* slot_of, int32_t* token_of_slot, int32_t* first_slot) {
  __shared__ int32_t chunk_experts[kSortChunk];
  const int base = static_cast<int>(shared_groups * (entries / k));
  write_shared_rows(offsets, token_of_slot, shared_groups, entries / k);
  offsets += shared_groups;
  token_of_slot += base;
  for (int e = threadIdx.x; e < num_experts; e += kSortChunk) first_slot[e] = 0;
  const int i = static_cast<int>(threadIdx.x);
  const int32_t e = i < entries ? experts[i] : -1;
  const bool valid = e >= 0 && e < num_experts;
  chunk_experts[i] = valid ? e : -1;
  __syncthreads();
  if (valid) atomicAdd(&first_slot[e], 1);
  __syncthreads();
  for (int x = threadIdx.x; x < num_experts; x += kSortChunk) counts[x] = first_slot[x];
  __syncthreads();
  if (threadIdx.x == 0) exclusive_prefix_sum(first_slot, num_experts);
  __syncthreads();
  for (int x = threadIdx.x; x <= num_experts; x += kSortChunk) offsets[x] = base + first_slot[x];
  // Slots past the valid ones (entries without an expert) name no token.
  for (int64_t slot = first_slot[num_experts] + threadIdx.x; slot < entries; slot += kSortChunk) {
    token_of_slot[slot] = -1;
  }
  if (i >= entries) return;
  if (!valid) {
    slot_of[i] = -1;
    return;
  }
  int32_t rank = 0;  // earlier entries with the same expert: the stable order
  for (int j = 0; j < i; ++j) rank += chunk_experts[j] == e;
  const int32_t slot = first_slot[e] + rank;
  slot_of[i] = base + slot;
  token_of_slot[slot] = i / k;
}

__global__ void __launch_bounds__(kSortChunk)
    sort_one_chunk_kernel(const int32_t* experts, int64_t entries, int k, int num_experts,
                          int shared_groups, int32_t* counts, int32_t* offsets, int32_t* slot_of,
                          int32_t* token_of_slot) {
  wait_for_previous_kernel();
  extern __shared__ int32_t first_slot[];  // [num_experts + 1]
  sort_one_chunk(experts, entries, k, num_experts, shared_groups, counts, offsets, slot_of,
                 token_of_slot, first_slot);
}

// moe_route then the one-chunk sort in one block (decode steps: one launch instead of two): its
// warps route the tokens in turn, the block sorts their choices.
constexpr int kRouteSortWarps = kSortChunk / 32;

__global__ void __launch_bounds__(kSortChunk)
    route_sort_kernel(const __grid_constant__ RouteKernelParams p, int shared_groups,
                      int32_t* counts, int32_t* offsets, int32_t* slot_of, int32_t* token_of_slot) {
  wait_for_previous_kernel();
  __shared__ float scores_of_warp[kRouteSortWarps][kMaxRoutedExperts];
  __shared__ float group_score_of_warp[kRouteSortWarps][kMaxExpertGroups];
  extern __shared__ int32_t first_slot[];  // [num_experts + 1]
  const int warp = threadIdx.x / 32;
  for (int64_t t = warp; t < p.n; t += kRouteSortWarps) {
    route_token(p, t, scores_of_warp[warp], group_score_of_warp[warp]);
  }
  __syncthreads();  // the choices in global memory, visible to the whole block
  sort_one_chunk(p.experts, p.n * p.config.top_k, p.config.top_k, p.config.num_experts,
                 shared_groups, counts, offsets, slot_of, token_of_slot, first_slot);
}

// ---- gather / combine ----

constexpr int kCopyThreads = 256;

// kGatherRows rows a block, every row's loads issued before its stores: a 2K prefill's ~13K
// rows of 4 KB were a wave of dependent loads per row (the token, then its row), one block each.
constexpr int kGatherRows = 4;
template <bool kVector>
__global__ void __launch_bounds__(kCopyThreads)
    moe_gather_kernel(const uint16_t* h, int64_t ld_h, int64_t n, const int32_t* token_of_slot,
                      int64_t slots, uint16_t* sorted, int64_t ld_sorted, int64_t d) {
  wait_for_previous_kernel();
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kGatherRows;
  const uint16_t* in[kGatherRows];
  bool valid[kGatherRows];
#pragma unroll
  for (int r = 0; r < kGatherRows; ++r) {
    const int64_t token = s0 + r < slots ? token_of_slot[s0 + r] : -1;
    valid[r] = token >= 0 && token < n;
    in[r] = h + (valid[r] ? token : 0) * ld_h;
  }
  const int rows = static_cast<int>(slots - s0 < kGatherRows ? slots - s0 : kGatherRows);
  if constexpr (kVector) {  // 8 BF16 values per 16-byte access
    const int64_t vectors = d / 8;
    for (int64_t v = threadIdx.x; v < vectors; v += kCopyThreads) {
      uint4 value[kGatherRows];
#pragma unroll
      for (int r = 0; r < kGatherRows; ++r) {
        value[r] = valid[r] ? reinterpret_cast<const uint4*>(in[r])[v] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int r = 0; r < kGatherRows; ++r) {
        if (r < rows) reinterpret_cast<uint4*>(sorted + (s0 + r) * ld_sorted)[v] = value[r];
      }
    }
  } else {
    for (int r = 0; r < rows; ++r) {
      uint16_t* out = sorted + (s0 + r) * ld_sorted;
      for (int64_t c = threadIdx.x; c < d; c += kCopyThreads) out[c] = valid[r] ? in[r][c] : 0;
    }
  }
}

// Thread i < E * rows writes row i of the padded layout, thread i < entries rewrites entry i's
// slot (both ranges share the grid).
__global__ void __launch_bounds__(kCopyThreads)
    moe_pad_layout_kernel(const int32_t* offsets, const int32_t* token_of_slot,
                          const int32_t* experts, const int32_t* slot_of, int64_t entries,
                          int64_t padded_rows, int64_t rows, int32_t* token_of_row,
                          int32_t* padded_slot_of) {
  wait_for_previous_kernel();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x;
  if (i < padded_rows) {
    const int64_t x = i / rows, r = i % rows;
    const int64_t first = offsets[x];
    token_of_row[i] = r < offsets[x + 1] - first ? token_of_slot[first + r] : -1;
  }
  if (i < entries) {
    const int32_t slot = slot_of[i];
    const int32_t x = experts[i];
    padded_slot_of[i] = slot < 0 ? -1 : static_cast<int32_t>(x * rows + (slot - offsets[x]));
  }
}

// kVec consecutive values of a row of expert outputs (FP32, or BF16 bits) from value index kVec v.
template <int kVec>
__device__ __forceinline__ void load_values(const float* row, int64_t v, float (&out)[kVec]) {
  if constexpr (kVec == 4) {
    const float4 e = reinterpret_cast<const float4*>(row)[v];
    out[0] = e.x, out[1] = e.y, out[2] = e.z, out[3] = e.w;
  } else {
    out[0] = row[v];
  }
}
template <int kVec>
__device__ __forceinline__ void load_values(const uint16_t* row, int64_t v, float (&out)[kVec]) {
  if constexpr (kVec == 4) {
    const uint2 e = reinterpret_cast<const uint2*>(row)[v];
    out[0] = from_bf16_bits(static_cast<uint16_t>(e.x)), out[1] = from_bf16_bits(e.x >> 16);
    out[2] = from_bf16_bits(static_cast<uint16_t>(e.y)), out[3] = from_bf16_bits(e.y >> 16);
  } else {
    out[0] = from_bf16_bits(row[v]);
  }
}

// kVec consecutive columns per thread (4: 16-byte loads of x and of FP32 outputs, 8-byte ones of
// BF16 outputs; the launcher checks the alignment), the same fma chain per element either way.
template <int kVec, class Out>
__global__ void __launch_bounds__(kCopyThreads)
    moe_combine_kernel(const Out* expert_out, int64_t ld_expert_out, const int32_t* slot_of,
                       const float* weights, float* x, int64_t ld_x, int64_t n, int k, int64_t d,
                       int shared_groups) {
  wait_for_previous_kernel();
  using Vec = std::conditional_t<kVec == 4, float4, float>;
  const int64_t vectors = d / kVec;
  // Tokens along y, columns along x: no 64-bit division per element.
  for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors;
         v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      float sum[kVec] = {}, e[kVec];
      for (int j = 0; j < k; ++j) {
        const int32_t slot = slot_of[t * k + j];
        if (slot < 0) continue;
        const float w = weights[t * k + j];
        load_values<kVec>(expert_out + slot * ld_expert_out, v, e);
        for (int i = 0; i < kVec; ++i) sum[i] = __fmaf_rn(w, e[i], sum[i]);
      }
      for (int g = 0; g < shared_groups; ++g) {  // mixture_sum's order (moe_combine.cuh)
        load_values<kVec>(expert_out + (g * n + t) * ld_expert_out, v, e);
        for (int i = 0; i < kVec; ++i) sum[i] = __fadd_rn(sum[i], e[i]);
      }
      Vec& target = reinterpret_cast<Vec*>(x + t * ld_x)[v];
      Vec result = target;
      float* r = reinterpret_cast<float*>(&result);
      for (int i = 0; i < kVec; ++i) r[i] = __fadd_rn(r[i], sum[i]);
      target = result;
    }
  }
}

}  // namespace

MoeRouteParams moe_route_params(const ModelConfig& config) {
  MoeRouteParams p;
  p.num_experts = static_cast<int>(config.n_routed_experts);
  p.top_k = static_cast<int>(config.num_experts_per_tok);
  if (config.scoring_func == "softmax") {
    p.scoring = MoeScoring::kSoftmax;
  } else if (config.scoring_func == "sigmoid") {
    p.scoring = MoeScoring::kSigmoid;
  } else {
    throw InvalidArgument("unsupported scoring_func \"" + config.scoring_func + "\"");
  }
  if (config.topk_method == "greedy") {
    p.method = MoeTopkMethod::kGreedy;
  } else if (config.topk_method == "group_limited_greedy") {
    p.method = MoeTopkMethod::kGroupLimitedGreedy;
  } else if (config.topk_method == "noaux_tc") {
    p.method = MoeTopkMethod::kNoauxTc;
  } else {
    throw InvalidArgument("unsupported topk_method \"" + config.topk_method + "\"");
  }
  p.n_group = static_cast<int>(config.n_group);
  p.topk_group = static_cast<int>(config.topk_group);
  p.norm_topk_prob = config.norm_topk_prob;
  p.routed_scaling_factor = static_cast<float>(config.routed_scaling_factor);
  return p;
}

namespace {

// moe_route's argument checks (its InvalidArgument and ShapeError cases).
void check_route(const float* router_logits, int64_t ld_logits, const int32_t* out_experts,
                 const float* out_weights, int64_t n, const MoeRouteParams& c) {
  if (c.num_experts < 1 || c.num_experts > kMaxRoutedExperts) {
    throw InvalidArgument("moe_route: " + std::to_string(c.num_experts) +
                          " experts (the kernel takes 1.." + std::to_string(kMaxRoutedExperts) +
                          ")");
  }
  if (c.top_k < 1 || c.top_k > kMaxExpertsPerToken || c.top_k > c.num_experts) {
    throw InvalidArgument("moe_route: top_k " + std::to_string(c.top_k) + " with " +
                          std::to_string(c.num_experts) + " experts (the kernel takes 1.." +
                          std::to_string(kMaxExpertsPerToken) + ", at most E)");
  }
  if (c.method != MoeTopkMethod::kGreedy &&
      (c.n_group < 1 || c.n_group > kMaxExpertGroups || c.num_experts % c.n_group != 0 ||
       c.topk_group < 1 || c.topk_group > c.n_group)) {
    throw InvalidArgument("moe_route: n_group " + std::to_string(c.n_group) + ", topk_group " +
                          std::to_string(c.topk_group) + " with " + std::to_string(c.num_experts) +
                          " experts (need n_group in 1.." + std::to_string(kMaxExpertGroups) +
                          " dividing E and topk_group in 1..n_group)");
  }
  if (n < 0 || ld_logits < c.num_experts) {
    throw ShapeError("moe_route: n " + str(n) + ", ld_logits " + str(ld_logits) + " for " +
                     std::to_string(c.num_experts) + " experts (need n >= 0, ld_logits >= E)");
  }
  if ((n + kRouteWarps - 1) / kRouteWarps > INT_MAX) {
    throw ShapeError("moe_route: " + str(n) + " tokens are too many");
  }
  if (n > 0 && (router_logits == nullptr || out_experts == nullptr || out_weights == nullptr)) {
    throw InvalidArgument(
        "moe_route: router_logits, out_experts and out_weights must be device pointers, got null");
  }
}

// moe_sort's argument checks.
void check_sort(const int32_t* experts, int64_t n, int k, int num_experts,
                const MoeSortBuffers& buffers) {
  if (num_experts < 1 || num_experts > kMaxSortExperts || k < 1 || n < 0) {
    throw InvalidArgument("moe_sort: " + std::to_string(num_experts) + " experts, k " +
                          std::to_string(k) + ", n " + str(n) + " (need E in 1.." +
                          std::to_string(kMaxSortExperts) + ", k >= 1, n >= 0)");
  }
  const int64_t entries = n * k;
  if (buffers.shared_groups < 0 || entries + buffers.shared_groups * n > INT_MAX) {
    throw ShapeError("moe_sort: " + str(entries) + " entries and " +
                     std::to_string(buffers.shared_groups) + " shared groups of " + str(n) +
                     " rows (need shared_groups >= 0, all rows within int32 slots)");
  }
  if (buffers.counts == nullptr || buffers.offsets == nullptr ||
      (entries > 0 && (buffers.slot_of == nullptr || buffers.token_of_slot == nullptr ||
                       buffers.workspace == nullptr || experts == nullptr))) {
    throw InvalidArgument(
        "moe_sort: experts, counts, offsets, slot_of, token_of_slot and the "
        "workspace must be device pointers, got null");
  }
  if (reinterpret_cast<uintptr_t>(buffers.workspace) % alignof(int32_t) != 0) {
    throw InvalidArgument("moe_sort: the workspace must be 4-byte aligned");
  }
}

}  // namespace

void moe_route(const float* router_logits, int64_t ld_logits, const float* correction_bias,
               int32_t* out_experts, float* out_weights, int64_t n, const MoeRouteParams& params,
               cudaStream_t stream) {
  const MoeRouteParams& c = params;
  check_route(router_logits, ld_logits, out_experts, out_weights, n, c);
  if (n == 0) return;
  const int64_t blocks = (n + kRouteWarps - 1) / kRouteWarps;
  RouteKernelParams kernel{
      router_logits, ld_logits, correction_bias, out_experts, out_weights, n, c};
  launch_kernel(moe_route_kernel, static_cast<unsigned>(blocks), 32 * kRouteWarps, 0, stream,
                kernel);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

size_t moe_sort_workspace_bytes(int64_t n, int k, int num_experts) {
  const int64_t entries = n * k;
  const int64_t chunks = (entries + kSortChunk - 1) / kSortChunk;
  return static_cast<size_t>(chunks) * static_cast<size_t>(num_experts) * sizeof(int32_t);
}

void moe_sort(const int32_t* experts, int64_t n, int k, int num_experts,
              const MoeSortBuffers& buffers, cudaStream_t stream) {
  check_sort(experts, n, k, num_experts, buffers);
  const int64_t entries = n * k;
  const int64_t chunks = (entries + kSortChunk - 1) / kSortChunk;
  auto* chunk_counts = static_cast<int32_t*>(buffers.workspace);
  const size_t histogram_bytes = static_cast<size_t>(num_experts) * sizeof(int32_t);
  if (chunks == 1) {
    launch_kernel(sort_one_chunk_kernel, 1, kSortChunk, histogram_bytes + sizeof(int32_t), stream,
                  experts, entries, k, num_experts, buffers.shared_groups, buffers.counts,
                  buffers.offsets, buffers.slot_of, buffers.token_of_slot);
    QUANTMLA_CUDA_CHECK_LAUNCH();
    return;
  }
  if (chunks > 0) {
    launch_kernel(sort_histogram_kernel, static_cast<unsigned>(chunks), kSortChunk, histogram_bytes,
                  stream, experts, entries, num_experts, chunk_counts);
    QUANTMLA_CUDA_CHECK_LAUNCH();
  }
  // With no entries this still writes zero counts and offsets.
  const size_t scan_bytes =
      histogram_bytes * static_cast<size_t>(1 + scan_parts(num_experts)) + sizeof(int32_t);
  launch_kernel(sort_scan_kernel, 1, kScanThreads, scan_bytes, stream, chunk_counts, chunks,
                num_experts, entries, k, buffers.shared_groups, buffers.counts, buffers.offsets,
                buffers.token_of_slot);
  QUANTMLA_CUDA_CHECK_LAUNCH();
  if (chunks > 0) {
    launch_kernel(sort_scatter_kernel, static_cast<unsigned>(chunks), kSortChunk, 0, stream,
                  experts, entries, k, num_experts, buffers.shared_groups, chunk_counts,
                  buffers.slot_of, buffers.token_of_slot);
    QUANTMLA_CUDA_CHECK_LAUNCH();
  }
}

void moe_route_sort(const float* router_logits, int64_t ld_logits, const float* correction_bias,
                    int32_t* out_experts, float* out_weights, int64_t n,
                    const MoeRouteParams& params, const MoeSortBuffers& buffers,
                    cudaStream_t stream) {
  const int64_t entries = n * params.top_k;
  if (n == 0 || entries > kSortChunk) {
    moe_route(router_logits, ld_logits, correction_bias, out_experts, out_weights, n, params,
              stream);
    moe_sort(out_experts, n, params.top_k, params.num_experts, buffers, stream);
    return;
  }
  check_route(router_logits, ld_logits, out_experts, out_weights, n, params);
  check_sort(out_experts, n, params.top_k, params.num_experts, buffers);
  const RouteKernelParams kernel{router_logits, ld_logits, correction_bias, out_experts,
                                 out_weights,   n,         params};
  launch_kernel(route_sort_kernel, 1, kSortChunk,
                (static_cast<size_t>(params.num_experts) + 1) * sizeof(int32_t), stream, kernel,
                buffers.shared_groups, buffers.counts, buffers.offsets, buffers.slot_of,
                buffers.token_of_slot);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

void pad_expert_layout(const int32_t* offsets, int num_experts, const int32_t* token_of_slot,
                       int64_t rows, std::vector<int32_t>& token_of_row,
                       std::vector<int32_t>& slot_of) {
  token_of_row.assign(static_cast<size_t>(num_experts * rows), -1);
  std::vector<int32_t> row_of_slot(static_cast<size_t>(std::max(offsets[num_experts], 0)));
  for (int x = 0; x < num_experts; ++x) {
    const int64_t count = offsets[x + 1] - offsets[x];
    if (offsets[x] < 0 || count < 0 || count > rows) {
      throw InvalidArgument("pad_expert_layout: expert " + std::to_string(x) + " has slots [" +
                            std::to_string(offsets[x]) + ", " + std::to_string(offsets[x + 1]) +
                            "), more than " + str(rows) + " rows or not a prefix sum");
    }
    for (int64_t i = 0; i < count; ++i) {
      const int64_t row = x * rows + i;
      token_of_row[static_cast<size_t>(row)] = token_of_slot[offsets[x] + i];
      row_of_slot[static_cast<size_t>(offsets[x] + i)] = static_cast<int32_t>(row);
    }
  }
  for (int32_t& slot : slot_of) slot = slot < 0 ? -1 : row_of_slot[static_cast<size_t>(slot)];
}

void moe_gather(const uint16_t* h, int64_t ld_h, int64_t n, const int32_t* token_of_slot,
                int64_t slots, uint16_t* sorted, int64_t ld_sorted, int64_t d,
                cudaStream_t stream) {
  if (slots < 0 || slots > INT_MAX || d < 1 || ld_h < d || ld_sorted < d || n < 0) {
    throw ShapeError("moe_gather: slots " + str(slots) + ", d " + str(d) + ", ld_h " + str(ld_h) +
                     ", ld_sorted " + str(ld_sorted) + ", n " + str(n) +
                     " (need 0 <= slots <= 2^31 - 1, d >= 1, ld_h >= d, ld_sorted >= d)");
  }
  if (slots == 0) return;
  if (h == nullptr || token_of_slot == nullptr || sorted == nullptr) {
    throw InvalidArgument(
        "moe_gather: h, token_of_slot and sorted must be device pointers, got "
        "null");
  }
  const bool vector = d % 8 == 0 && ld_h % 8 == 0 && ld_sorted % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(h) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(sorted) % 16 == 0;
  const auto blocks = static_cast<unsigned>((slots + kGatherRows - 1) / kGatherRows);
  if (vector) {
    launch_kernel(moe_gather_kernel<true>, blocks, kCopyThreads, 0, stream, h, ld_h, n,
                  token_of_slot, slots, sorted, ld_sorted, d);
  } else {
    launch_kernel(moe_gather_kernel<false>, blocks, kCopyThreads, 0, stream, h, ld_h, n,
                  token_of_slot, slots, sorted, ld_sorted, d);
  }
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

void moe_pad_layout(const int32_t* offsets, int num_experts, const int32_t* token_of_slot,
                    const int32_t* experts, const int32_t* slot_of, int64_t entries, int64_t rows,
                    int32_t* token_of_row, int32_t* padded_slot_of, cudaStream_t stream) {
  const int64_t padded_rows = num_experts * rows;
  if (num_experts < 1 || rows < 1 || entries < 0 || padded_rows > INT_MAX || entries > INT_MAX) {
    throw ShapeError("moe_pad_layout: " + std::to_string(num_experts) + " experts of " + str(rows) +
                     " rows, " + str(entries) +
                     " entries (need >= 1 expert, rows >= 1, E * rows and entries below 2^31)");
  }
  if (offsets == nullptr || token_of_slot == nullptr || experts == nullptr || slot_of == nullptr ||
      token_of_row == nullptr || padded_slot_of == nullptr) {
    throw InvalidArgument("moe_pad_layout: every buffer must be a device pointer, got null");
  }
  const int64_t threads = std::max(padded_rows, entries);
  const auto blocks = static_cast<unsigned>((threads + kCopyThreads - 1) / kCopyThreads);
  launch_kernel(moe_pad_layout_kernel, blocks, kCopyThreads, 0, stream, offsets, token_of_slot,
                experts, slot_of, entries, padded_rows, rows, token_of_row, padded_slot_of);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

namespace {

template <class Out>
void combine(const Out* expert_out, int64_t ld_expert_out, const int32_t* slot_of,
             const float* weights, float* x, int64_t ld_x, int64_t n, int k, int64_t d,
             cudaStream_t stream, int shared_groups) {
  if (n < 0 || k < 1 || d < 1 || ld_expert_out < d || ld_x < d || shared_groups < 0) {
    throw ShapeError("moe_combine: n " + str(n) + ", k " + std::to_string(k) + ", d " + str(d) +
                     ", ld_expert_out " + str(ld_expert_out) + ", ld_x " + str(ld_x) +
                     ", shared_groups " + std::to_string(shared_groups) +
                     " (need n >= 0, k >= 1, d >= 1, ld_expert_out >= d, ld_x >= d, "
                     "shared_groups >= 0)");
  }
  if (n == 0) return;
  if (expert_out == nullptr || slot_of == nullptr || weights == nullptr || x == nullptr) {
    throw InvalidArgument(
        "moe_combine: expert_out, slot_of, weights and x must be device pointers, got null");
  }
  const bool vector = d % 4 == 0 && ld_expert_out % 4 == 0 && ld_x % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(expert_out) % (4 * sizeof(Out)) == 0 &&
                      reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int vec = vector ? 4 : 1;
  const int64_t column_blocks = std::min<int64_t>((d / vec + kCopyThreads - 1) / kCopyThreads, 64);
  const dim3 grid(static_cast<unsigned>(column_blocks),
                  static_cast<unsigned>(std::min<int64_t>(n, 65535)));
  if (vector) {
    launch_kernel(moe_combine_kernel<4, Out>, grid, kCopyThreads, 0, stream, expert_out,
                  ld_expert_out, slot_of, weights, x, ld_x, n, k, d, shared_groups);
  } else {
    launch_kernel(moe_combine_kernel<1, Out>, grid, kCopyThreads, 0, stream, expert_out,
                  ld_expert_out, slot_of, weights, x, ld_x, n, k, d, shared_groups);
  }
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_combine(const float* expert_out, int64_t ld_expert_out, const int32_t* slot_of,
                 const float* weights, float* x, int64_t ld_x, int64_t n, int k, int64_t d,
                 cudaStream_t stream, int shared_groups) {
  combine(expert_out, ld_expert_out, slot_of, weights, x, ld_x, n, k, d, stream, shared_groups);
}

void moe_combine(const uint16_t* expert_out, int64_t ld_expert_out, const int32_t* slot_of,
                 const float* weights, float* x, int64_t ld_x, int64_t n, int k, int64_t d,
                 cudaStream_t stream, int shared_groups) {
  combine(expert_out, ld_expert_out, slot_of, weights, x, ld_x, n, k, d, stream, shared_groups);
}

void moe_expert_mlps(GemmRunner& gemm, const int32_t* host_offsets, int num_experts,
                     const uint16_t* sorted, int64_t ld_sorted, const MoeExpertWeights& weights,
                     int64_t d, int64_t inner, float* gate_up, uint16_t* act, float* out,
                     int64_t ld_out, cudaStream_t stream) {
  if (host_offsets == nullptr || num_experts < 1) {
    throw InvalidArgument("moe_expert_mlps: host_offsets null or " + std::to_string(num_experts) +
                          " experts");
  }
  if (host_offsets[0] != 0) {
    throw InvalidArgument("moe_expert_mlps: offsets[0] is " + std::to_string(host_offsets[0]) +
                          ", not 0");
  }
  for (int e = 0; e < num_experts; ++e) {
    if (host_offsets[e + 1] < host_offsets[e]) {
      throw InvalidArgument("moe_expert_mlps: offsets decrease at expert " + std::to_string(e) +
                            " (" + std::to_string(host_offsets[e]) + " then " +
                            std::to_string(host_offsets[e + 1]) + ")");
    }
  }
  const int64_t slots = host_offsets[num_experts];
  if (slots == 0) return;
  if (weights.gate == nullptr || weights.up == nullptr || weights.down == nullptr) {
    throw InvalidArgument("moe_expert_mlps: the gate, up and down pointer arrays must be set");
  }
  const int64_t ld_gate_up = 2 * inner;
  for (int e = 0; e < num_experts; ++e) {
    const int64_t begin = host_offsets[e];
    const int64_t rows = host_offsets[e + 1] - begin;
    if (rows == 0) continue;
    if (weights.gate[e] == nullptr || weights.up[e] == nullptr || weights.down[e] == nullptr) {
      throw InvalidArgument("moe_expert_mlps: expert " + std::to_string(e) + " has " + str(rows) +
                            " rows but a null weight");
    }
    const uint16_t* x = sorted + begin * ld_sorted;
    float* y = gate_up + begin * ld_gate_up;
    gemm.linear(rows, inner, d, x, ld_sorted, weights.gate[e], d, y, ld_gate_up, DType::kF32, 0.0f,
                stream);
    gemm.linear(rows, inner, d, x, ld_sorted, weights.up[e], d, y + inner, ld_gate_up, DType::kF32,
                0.0f, stream);
  }
  silu_mul(gate_up, ld_gate_up, act, inner, slots, inner, stream);
  for (int e = 0; e < num_experts; ++e) {
    const int64_t begin = host_offsets[e];
    const int64_t rows = host_offsets[e + 1] - begin;
    if (rows == 0) continue;
    gemm.linear(rows, d, inner, act + begin * inner, inner, weights.down[e], inner,
                out + begin * ld_out, ld_out, DType::kF32, 0.0f, stream);
  }
}

}  // namespace quantmla::gpu
