// The transposed decode kernel: a BF16 cache at few heads (16 or 32 query rows a block), both
// products on the warpgroup MMA with the page's keys and channels as its M, so that wgmma's 64 rows
// carry no padding where the tiled kernel's mma.sync tiles and the warpgroup kernel's 64 query rows
// would (docs/gpu-kernels.md).
//
// One block per WorkItem of 16 query rows, or 32 in the two-tile form where a sequence's rows
// come in 32s (s_q = 2 at 16 heads: one block reads each page for both tokens, where two 16-row
// blocks read it twice; the products' N is then 32, twice the tensor-core work a page, still below
// the page's copy time). Warp 4 is the producer: its lane 0 copies whole pages with tensor maps
// (nine boxes of 64 channels x 64 keys in the 128-byte swizzle, the layout the warpgroup kernels'
// tiles have) into two stages of 72 KB, each completing on a barrier, and refills a stage once the
// consumers release it. Warps 0-3, one warpgroup, consume, per page:
//   1. S^T = K Q^T (wgmma m64n16k16 or m64n32k16, 36 k-steps): A the page's keys from the stage
//      (K-major), B Q's rows (a tile of the same layout, copied once a block).
//   2. The online softmax in base 2 per query row, a column of S^T: the page's maximum over the
//      four warps' keys through shared memory, P = exp2 in FP32 rounded to BF16 into P^T (the rows
//      x 64 keys, K-major: the next product's B operand); the row sums add the unrounded P, as the
//      tiled kernel's (MlaDecodePlan::Operands::kBf16Tile, which test_gpu_mla's reference follows).
//      Keys past a row's query (s_q > 1) or the sequence are -inf; the records past the sequence's
//      end in its last page are zeroed in the stage before the values read them (their pool bytes
//      are arbitrary, and NaN would survive a probability of 0).
//   3. O^T += V^T P^T (wgmma m64nNk16, 8 blocks of 64 channels x 4 k-steps of 16 keys): A the
//      page's content channels read transposed from the stage's boxes (MN-major, as the seesaw
//      reads its values), B P^T.
// The products run one after the other within the warpgroup; the page copies run ahead of them,
// which is what a BF16 cache at 16 heads needs (its arithmetic is ~1,100 cycles a page against
// ~4,000 for its 72 KB at an SM's share of the copy rate).
#include <cuda_bf16.h>

#include <string>
#include <type_traits>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/decode_kernels.h"
#include "kernels/cuda/decode_transposed.h"
#include "kernels/cuda/decode_warpgroup.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/swizzle_layouts.h"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/wgmma.cuh"
#include "quantmla/error.h"

namespace quantmla::gpu {

namespace {

// kRowTiles: the block's 16-row tiles, 1 or 2 (where the rows come in 32s: s_q = 2 at 16 heads
// reads each page once for both tokens).
template <int kRowTiles>
struct TransposedLayout {
  static_assert(kRowTiles == 1 || kRowTiles == 2);
  static constexpr int kConsumers = 128;            // one warpgroup
  static constexpr int kThreads = kConsumers + 32;  // and a producer warp
  static constexpr int kRows = 16 * kRowTiles;      // query rows a block: wgmma's N
  static constexpr int kNTiles = kRows / 8;         // of the accumulators, as mma.m16n8's
  static constexpr int kBoxes = kKeyDim / 64;       // of 64 channels: 8 of content, 1 of RoPE
  static constexpr int kValueBoxes = kLatentDim / 64;
  static constexpr int kBoxBytes = kPageTokens * 128;  // a page's 64 keys x 64 channels
  static constexpr int kStageBytes = kBoxes * kBoxBytes;
  static constexpr int kStages = 2;
  static constexpr int kQueryBlockBytes = kRows * 128;  // Q's 16 rows x 64 channels
  // From the 1024-byte-aligned base: the stages, Q's tile, P^T, the exchange, the barriers.
  static constexpr int kQueryOffset = kStages * kStageBytes;
  static constexpr int kProbOffset = kQueryOffset + kBoxes * kQueryBlockBytes;
  static constexpr int kExchangeOffset = kProbOffset + kQueryBlockBytes;  // P^T: kRows x 64 keys
  static constexpr int kExchangeBytes = 4 * kRows * 4;                    // [warp][row] FP32
  static constexpr int kBarrierOffset = kExchangeOffset + kExchangeBytes;
  static constexpr int kSharedBytes = 1024 + kBarrierOffset + 2 * kStages * 8;
  static_assert(kSharedBytes <= kSharedLimit, "two page stages, Q and P^T fit");
  static_assert(kStageBytes % 1024 == 0 && kQueryOffset % 1024 == 0 && kProbOffset % 1024 == 0 &&
                    kQueryBlockBytes % 1024 == 0,
                "swizzled boxes on 1024-byte atoms");
  static_assert(kPageTokens == kTransposedStepKeys && kPageTokens == 64,
                "a page is wgmma's M of the scores and a softmax step");
};
constexpr int kConsumerBarrier = 1;

// Q's kRows rows of the block (BF16, [kRows][kKeyDim] from `q`) into the tile at `tile` (nine
// column blocks of kRows rows, 128-byte swizzle, K-major: wgmma's B operand), by the consumers.
template <class L>
__device__ __forceinline__ void copy_query(const uint16_t* q, uint8_t* tile) {
  for (int c = threadIdx.x; c < L::kBoxes * L::kRows * 8; c += L::kConsumers) {
    const int row = c % L::kRows, chunk = c / L::kRows % 8, box = c / L::kRows / 8;
    *reinterpret_cast<uint4*>(tile + box * L::kQueryBlockBytes +
                              swizzled_chunk_offset(row, chunk)) =
        *reinterpret_cast<const uint4*>(q + row * kKeyDim + 64 * box + 8 * chunk);
  }
}

// Rows [valid, 64) of a stage's value boxes as zeros, by the consumers.
template <class L>
__device__ __forceinline__ void zero_tail_values(uint8_t* stage, int valid) {
  const int chunks = (kPageTokens - valid) * L::kValueBoxes * 8;
  for (int u = threadIdx.x; u < chunks; u += L::kConsumers) {
    const int row = valid + u / (L::kValueBoxes * 8), rest = u % (L::kValueBoxes * 8);
    *reinterpret_cast<uint4*>(stage + (rest / 8) * L::kBoxBytes +
                              swizzled_chunk_offset(row, rest % 8)) = make_uint4(0u, 0u, 0u, 0u);
  }
}

template <int kNTiles>
__device__ __forceinline__ void fence_fragments(float (&d)[kNTiles][4]) {
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) wgmma_fence_registers(d[n]);
}

template <int kRowTiles>
__global__ void __launch_bounds__(TransposedLayout<kRowTiles>::kThreads, 1)
    mla_decode_transposed_kernel(const __grid_constant__ DecodeKernelParams p,
                                 const __grid_constant__ CUtensorMap pool_map) {
  using L = TransposedLayout<kRowTiles>;
  constexpr int kNTiles = L::kNTiles;
  // With the pool ready (MlaDecodeParams::pool_ready) the producer requests its pages while the
  // previous kernel runs; only the consumers wait, before they read Q.
  if (!p.pool_ready) wait_for_previous_kernel();
  const WorkItem item = p.items[blockIdx.x];
  if (item.batch < 0) return;  // padding of a fixed grid (a plan in a workspace)
  extern __shared__ __align__(16) uint8_t shared_raw[];
  const uint32_t base = swizzle_base(shared_raw);
  uint8_t* const base_bytes = shared_raw + (base - shared_address(shared_raw));
  const auto stage = [&](int s) { return base + static_cast<uint32_t>(s * L::kStageBytes); };
  const uint32_t q_tile = base + L::kQueryOffset, probs = base + L::kProbOffset;
  uint8_t* const probs_bytes = base_bytes + L::kProbOffset;
  float* const exchange = reinterpret_cast<float*>(base_bytes + L::kExchangeOffset);
  uint64_t* const full = reinterpret_cast<uint64_t*>(base_bytes + L::kBarrierOffset);
  uint64_t* const empty = full + L::kStages;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int seq_len = p.seq_lens[item.batch];
  const int num_pages = item.page_end - item.page_begin;
  if (tid == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbarrier_init(full + s, 1);
      mbarrier_init(empty + s, L::kConsumers / 32);  // a consumer warp's arrival each
    }
    fence_barrier_init();
  }
  __syncthreads();  // the last block-wide barrier: the producer leaves after its loop

  if (warp == L::kConsumers / 32) {
    if (lane == 0) {
      const int32_t* const pages =
          p.block_table + static_cast<int64_t>(item.batch) * p.block_table_stride + item.page_begin;
      for (int i = 0; i < num_pages; ++i) {
        const int s = i % L::kStages;
        // The stage's page before (i - kStages) released by every consumer warp.
        if (i >= L::kStages) mbarrier_wait(empty + s, (i / L::kStages - 1) & 1);
        mbarrier_arrive_expect_bytes(full + s, L::kStageBytes);
        const int first_record = pages[i] * kPageTokens;
        for (int b = 0; b < L::kBoxes; ++b) {
          tma_load_2d(stage(s) + b * L::kBoxBytes, &pool_map, 64 * b, first_record, full + s);
        }
      }
    }
    return;
  }

  if (p.pool_ready) wait_for_previous_kernel();
  const int rows_per_seq = p.s_q * p.num_heads;
  const int first_row = item.row_tile * L::kRows;
  copy_query<L>(p.q + (static_cast<int64_t>(item.batch) * rows_per_seq + first_row) * kKeyDim,
                base_bytes + L::kQueryOffset);
  fence_proxy_async_shared();  // Q's tile, written by these threads, read by the tensor cores

  // This thread's 2 kNTiles rows (S^T's and O^T's columns): n-tile n, half e -> row 8n + 2t + e;
  // its keys of a page (S^T's rows): 16 warp + g and + 8.
  int limit[kNTiles][2];  // keys visible to the row: those before it
  float row_max[kNTiles][2], row_sum[kNTiles][2];
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      limit[n][e] = seq_len - p.s_q + (first_row + 8 * n + 2 * t + e) / p.num_heads + 1;
      row_max[n][e] = -INFINITY;
      row_sum[n][e] = 0.0f;  // this thread's keys only; summed over the block at the end
    }
  }
  const int key_lo = 16 * warp + g, key_hi = key_lo + 8;
  float o[L::kValueBoxes][kNTiles][4] = {};        // O^T: [channel block][n-tile][register]
  named_barrier(kConsumerBarrier, L::kConsumers);  // Q's tile in place

  // The products' descriptors at their operands' starts, advanced a k-step at a time below.
  const uint64_t query_descriptor = wgmma_descriptor(q_tile);
  const uint64_t probs_descriptor = wgmma_descriptor(probs);
  for (int i = 0; i < num_pages; ++i) {
    const int s = i % L::kStages;
    const uint32_t keys = stage(s);
    const uint64_t keys_descriptor = wgmma_descriptor(keys);
    const uint64_t values_descriptor = wgmma_descriptor_mn(keys, L::kBoxBytes);
    const int key0 = (item.page_begin + i) * kPageTokens;
    mbarrier_wait(full + s, (i / L::kStages) & 1);

    // 1. S^T over the nine boxes of 64 channels, four k-steps each.
    float sc[kNTiles][4];
    wgmma_fence();
#pragma unroll
    for (int b = 0; b < L::kBoxes; ++b) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        wgmma_m64k16_ss_tiles<false>(
            sc, descriptor_at(keys_descriptor, b * L::kBoxBytes + k * 32),
            descriptor_at(query_descriptor, b * L::kQueryBlockBytes + k * 32), b > 0 || k > 0);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_fragments(sc);

    // 2. The softmax: sc[n][e] is key g, sc[n][2 + e] key g + 8, of row 8n + 2t + e.
    float x[kNTiles][4];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        x[n][e] = key0 + key_lo < limit[n][e] ? sc[n][e] * p.scale_log2 : -INFINITY;
        x[n][2 + e] = key0 + key_hi < limit[n][e] ? sc[n][2 + e] * p.scale_log2 : -INFINITY;
        float page_max = fmaxf(x[n][e], x[n][2 + e]);
#pragma unroll
        for (int offset = 4; offset < 32; offset <<= 1) {
          page_max = fmaxf(page_max, __shfl_xor_sync(0xffffffffu, page_max, offset));
        }
        if (g == 0) exchange[warp * L::kRows + 8 * n + 2 * t + e] = page_max;
      }
    }
    named_barrier(kConsumerBarrier, L::kConsumers);
    float alpha[kNTiles][2];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = 8 * n + 2 * t + e;
        float tile_max = exchange[row];
#pragma unroll
        for (int w = 1; w < L::kConsumers / 32; ++w) {
          tile_max = fmaxf(tile_max, exchange[w * L::kRows + row]);
        }
        const float new_max = fmaxf(row_max[n][e], tile_max);
        const float reference = warpgroup_detail::softmax_base(new_max);
        alpha[n][e] = exp2f(row_max[n][e] - reference);
        row_max[n][e] = new_max;
        const float p_lo = exp2_flushed(x[n][e] - reference);
        const float p_hi = exp2_flushed(x[n][2 + e] - reference);
        row_sum[n][e] = row_sum[n][e] * alpha[n][e] + (p_lo + p_hi);
        *reinterpret_cast<__nv_bfloat16*>(probs_bytes + tma_box_offset(row, key_lo)) =
            __float2bfloat16_rn(p_lo);
        *reinterpret_cast<__nv_bfloat16*>(probs_bytes + tma_box_offset(row, key_hi)) =
            __float2bfloat16_rn(p_hi);
      }
    }
    const int valid = seq_len - key0;
    if (valid < kPageTokens) zero_tail_values<L>(base_bytes + s * L::kStageBytes, valid);
    fence_proxy_async_shared();  // P^T and the zeroed rows, read by the tensor cores
    named_barrier(kConsumerBarrier, L::kConsumers);  // P^T complete; the exchange read

    // 3. O^T to the page's maximum, then O^T += V^T P^T.
#pragma unroll
    for (int m = 0; m < L::kValueBoxes; ++m) {
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
        for (int r = 0; r < 4; ++r) o[m][n][r] *= alpha[n][r % 2];
      }
      fence_fragments(o[m]);  // the rescale before the fence (else ptxas fences each product)
    }
    wgmma_fence();
#pragma unroll
    for (int m = 0; m < L::kValueBoxes; ++m) {
#pragma unroll
      for (int k = 0; k < kPageTokens / 16; ++k) {
        wgmma_m64k16_ss_tiles<true>(
            o[m], descriptor_at(values_descriptor, m * L::kBoxBytes + k * 16 * 128),
            descriptor_at(probs_descriptor, k * 32), true);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int m = 0; m < L::kValueBoxes; ++m) fence_fragments(o[m]);
    __syncwarp();
    if (lane == 0) mbarrier_arrive(empty + s);  // this warp is done with the stage
  }

  // Each row's sum over its 8 lanes g and the four warps (the exchange's last readers passed the
  // barrier after P^T).
  float total[kNTiles][2];
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) {
        row_sum[n][e] += __shfl_xor_sync(0xffffffffu, row_sum[n][e], offset);
      }
      if (g == 0) exchange[warp * L::kRows + 8 * n + 2 * t + e] = row_sum[n][e];
    }
  }
  named_barrier(kConsumerBarrier, L::kConsumers);
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int local_row = 8 * n + 2 * t + e;
      total[n][e] = exchange[local_row];
#pragma unroll
      for (int w = 1; w < L::kConsumers / 32; ++w)
        total[n][e] += exchange[w * L::kRows + local_row];
    }
  }

  // O^T's register r of n-tile n: channel 64 m + 16 warp + g (+ 8 for r >= 2) of row 8n + 2t +
  // r % 2.
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int local_row = 8 * n + 2 * t + e;
      const float sum = total[n][e];
      const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
      const float lse =
          sum > 0.0f ? (row_max[n][e] + log2f(sum)) * 0.69314718055994531f : -INFINITY;
      if (item.partial < 0) {
        const int64_t row = static_cast<int64_t>(item.batch) * rows_per_seq + first_row + local_row;
        uint16_t* const out = p.out + row * kLatentDim + 16 * warp + g;
#pragma unroll
        for (int m = 0; m < L::kValueBoxes; ++m) {
          out[64 * m] = __bfloat16_as_ushort(__float2bfloat16_rn(o[m][n][e] * inverse));
          out[64 * m + 8] = __bfloat16_as_ushort(__float2bfloat16_rn(o[m][n][2 + e] * inverse));
        }
        if (warp == 0 && g == 0 && p.lse != nullptr) p.lse[row] = lse;
      } else {
        float* const out =
            p.partial_out +
            (static_cast<int64_t>(item.partial) * L::kRows + local_row) * kLatentDim + 16 * warp +
            g;
#pragma unroll
        for (int m = 0; m < L::kValueBoxes; ++m) {
          out[64 * m] = o[m][n][e] * inverse;
          out[64 * m + 8] = o[m][n][2 + e] * inverse;
        }
        if (warp == 0 && g == 0) p.partial_lse[item.partial * L::kRows + local_row] = lse;
      }
    }
  }
}

}  // namespace

void launch_decode_transposed(const DecodeKernelParams& p, int row_tiles, int blocks,
                              cudaStream_t stream) {
  if (p.record_bytes != 2 * kKeyDim) {
    throw InvalidArgument("GPU decode, transposed kernel: records of " +
                          std::to_string(p.record_bytes) + " bytes, a BF16 cache's are " +
                          std::to_string(2 * kKeyDim));
  }
  // Boxes of 64 channels by a page's 64 records.
  const int box[] = {64, kPageTokens};
  const int64_t pool_dims[] = {kKeyDim, warpgroup_detail::kPoolMapRecords};
  const int64_t strides[] = {kKeyDim};
  const CUtensorMap pool_map = bf16_tensor_map(p.pool, 2, pool_dims, strides, box);
  const auto launch = [&](auto row_tiles_constant) {
    constexpr int kRowTiles = decltype(row_tiles_constant)::value;
    using L = TransposedLayout<kRowTiles>;
    launch_large_shared<mla_decode_transposed_kernel<kRowTiles>>(
        blocks, L::kThreads, L::kSharedBytes, stream, p, pool_map);
  };
  switch (row_tiles) {
    case 1:
      return launch(std::integral_constant<int, 1>{});
    case 2:
      return launch(std::integral_constant<int, 2>{});
    default:
      throw InvalidArgument("GPU decode, transposed kernel: blocks of " +
                            std::to_string(row_tiles) + " 16-row tiles, it takes 1 or 2");
  }
}

}  // namespace quantmla::gpu
