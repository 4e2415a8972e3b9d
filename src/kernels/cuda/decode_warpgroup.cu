// The warpgroup decode kernel: BF16 content and RoPE, a block per work item of 64 query rows (one
// sequence, a run of its pages), the products on wgmma with both operands in shared memory. Where a
// sequence's s_q x heads rows do not come in 64s, its last block is padded: the rows past them read
// whatever Q follows (the next sequence's, or the copy's zeros past the tensor) and write nothing.
//
// Thread 0 copies Q's 64 rows and each page's 64 records with tensor maps, as nine boxes of 64
// channels in the 128-byte swizzle (wgmma.cuh), into two stages that complete on a barrier each.
// Per page, the two warpgroups:
//   1. S = Q K^T, each over its own 32 keys of the page (m64n32, 36 k-steps of 16 channels),
//      issued while the previous page's P V is still in flight.
//   2. The online softmax in the log2 domain: each warpgroup's maximum of a row goes through
//      shared memory (a barrier of both), so both rescale by the same page maximum; P = exp2 in
//      FP32, rounded to BF16 into one 64 x 64 box (K-major for the next product's A operand); each
//      warpgroup sums the unrounded P of its own keys, merged at the end. Keys past a row's
//      query (s_q > 1) or the sequence are -inf; records past the sequence's end hold arbitrary
//      pool bytes (NaN would survive a probability of 0 in P V), so they are zeroed in the stage.
//   3. O += P V, each warpgroup over its own 256 of the 512 channels (m64n256, 4 k-steps): V is the
//      page's own content channels, read untransposed as an MN-major B operand.
// The softmax's steps are pages and P is rounded as the tiled kernel rounds it, so the host
// reference of test_gpu_mla (MlaDecodePlan::Operands::kBf16Tile) follows this kernel too.
#include <cuda_bf16.h>

#include <string>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_warpgroup.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/wgmma.cuh"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

using L = WarpgroupLayout;
constexpr int kHalfKeys = kPageTokens / 2;      // one warpgroup's keys of the scores
constexpr int kHalfChannels = kLatentDim / 2;   // one warpgroup's channels of the output
constexpr int kScoreRegs = kHalfKeys / 2;       // m64n32's accumulators a thread
constexpr int kOutputRegs = kHalfChannels / 2;  // m64n256's
// The pool's tensor map spans this many records (the kernel parameters do not carry the pool's
// size; a copy only reads the pages the block table names): 2^28 BF16 records are 309 GB, more
// than any GPU holds, and keep the map's extent below the hardware's 2^40 bytes.
constexpr int64_t kPoolMapRecords = int64_t{1} << 28;

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__global__ void __launch_bounds__(L::kThreads, 1)
    mla_decode_warpgroup_kernel(const __grid_constant__ DecodeKernelParams p,
                                const __grid_constant__ CUtensorMap q_map,
                                const __grid_constant__ CUtensorMap pool_map) {
  wait_for_previous_kernel();
  const WorkItem item = p.items[blockIdx.x];
  if (item.batch < 0) return;  // padding of a fixed grid (a plan in a workspace)

  extern __shared__ __align__(16) uint8_t shared_raw[];
  const uint32_t raw = shared_address(shared_raw);
  const uint32_t base = (raw + 1023) / 1024 * 1024;
  uint8_t* const base_bytes = shared_raw + (base - raw);
  // Q, the stages, P, the exchange of row maxima and sums, the barriers.
  const uint32_t q_tile = base;
  const auto stage = [&](int i) {
    return base + static_cast<uint32_t>(L::kTileBytes) * (1 + i % L::kStages);
  };
  const uint32_t probs = base + (1 + L::kStages) * L::kTileBytes;
  uint8_t* const probs_bytes = base_bytes + (1 + L::kStages) * L::kTileBytes;
  float* const max_exchange = reinterpret_cast<float*>(probs_bytes + L::kProbBytes);  // [2][64]
  float* const sum_exchange = max_exchange + 2 * L::kRows;                            // [2][64]
  uint64_t* const q_full = reinterpret_cast<uint64_t*>(sum_exchange + 2 * L::kRows);
  uint64_t* const page_full = q_full + 1;  // [kStages]

  const int seq_len = p.seq_lens[item.batch];
  const int rows_per_seq = p.s_q * p.num_heads;
  const int first_row = item.row_tile * L::kRows;
  const int num_pages = item.page_end - item.page_begin;
  const int32_t* const pages =
      p.block_table + static_cast<int64_t>(item.batch) * p.block_table_stride + item.page_begin;

  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int s = 0; s < L::kStages; ++s) mbarrier_init(&page_full[s], 1);
    fence_barrier_init();
  }
  __syncthreads();
  // Page i of the run into stage i % kStages: its 64 records as nine boxes of 64 channels.
  const auto load_page = [&](int i) {
    uint64_t* const full = &page_full[i % L::kStages];
    mbarrier_arrive_expect_bytes(full, L::kTileBytes);
    const int first_record = pages[i] * kPageTokens;
#pragma unroll
    for (int b = 0; b < L::kColumnBlocks; ++b) {
      tma_load_2d(stage(i) + b * L::kBlockBytes, &pool_map, 64 * b, first_record, full);
    }
  };
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_bytes(q_full, L::kTileBytes);
    const int q_row = item.batch * rows_per_seq + first_row;
#pragma unroll
    for (int b = 0; b < L::kColumnBlocks; ++b) {
      tma_load_2d(q_tile + b * L::kBlockBytes, &q_map, 64 * b, q_row, q_full);
    }
    for (int i = 0; i < L::kStages && i < num_pages; ++i) load_page(i);
  }
  __syncwarp();  // warp 0 converged again for the warpgroup instructions

  const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  // This thread's two rows of the block (accumulator rows g and g + 8 of its warp; the two
  // warpgroups hold the same rows) and the last key each sees: its query's position (a padded
  // row's: the sequence's last).
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  const int rows =
      min(L::kRows, rows_per_seq - first_row);  // the block's rows that are not padding
  const int last0 = min(seq_len - p.s_q + (first_row + r0) / p.num_heads, seq_len - 1);
  const int last1 = min(seq_len - p.s_q + (first_row + r1) / p.num_heads, seq_len - 1);
  const int block_last = seq_len - p.s_q + first_row / p.num_heads;  // the block's first row's
  float o[kOutputRegs] = {};
  float max0 = -INFINITY, max1 = -INFINITY;  // the page maxima so far (both warpgroups' keys)
  float sum0 = 0.0f, sum1 = 0.0f;            // this thread's keys only
  const uint32_t own_keys = warpgroup * kHalfKeys * 128;  // rows of the warpgroup's keys in a box
  const uint32_t own_values = warpgroup * (kHalfChannels / 64) * L::kBlockBytes;
  mbarrier_wait(q_full, 0);

  for (int i = 0; i < num_pages; ++i) {
    const uint32_t keys = stage(i);
    mbarrier_wait(&page_full[i % L::kStages], static_cast<uint32_t>((i / L::kStages) & 1));

    // 1. S over this warpgroup's keys; the wait also ends the previous page's P V (O final for
    // its rescale below, the previous stage read).
    float sc[kScoreRegs];
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kKeyDim / 16; ++s) {
      const uint32_t column = (s / 4) * L::kBlockBytes + (s % 4) * 32;
      wgmma_m64nk16_ss<kHalfKeys>(sc, wgmma_descriptor(q_tile + column),
                                  wgmma_descriptor(keys + own_keys + column), s);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_registers(sc);
    wgmma_fence_registers(o);

    // 2. The mask, this warpgroup's maxima of the rows, the page maxima through shared memory.
    const int page_key = (item.page_begin + i) * kPageTokens;
    const int key0 = page_key + warpgroup * kHalfKeys;
    const bool masked = key0 + kHalfKeys - 1 > block_last;
    float page_max0 = -INFINITY, page_max1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < kHalfKeys / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[4 * j + e] * p.scale_log2;
        if (masked && key0 + 8 * j + 2 * t4 + (e & 1) > (e < 2 ? last0 : last1)) x = -INFINITY;
        sc[4 * j + e] = x;
        if (e < 2) {
          page_max0 = fmaxf(page_max0, x);
        } else {
          page_max1 = fmaxf(page_max1, x);
        }
      }
    }
    page_max0 = quad_max(page_max0), page_max1 = quad_max(page_max1);
    if (t4 == 0) {
      max_exchange[warpgroup * L::kRows + r0] = page_max0;
      max_exchange[warpgroup * L::kRows + r1] = page_max1;
    }
    named_barrier(1, L::kThreads);
    // Both warpgroups are past their wait: the stage of page i - 1 is free for page i + 1.
    if (threadIdx.x == 0 && i >= 1 && i + 1 < num_pages) load_page(i + 1);
    __syncwarp();
    const int other = (1 - warpgroup) * L::kRows;
    const float new_max0 = fmaxf(max0, fmaxf(page_max0, max_exchange[other + r0]));
    const float new_max1 = fmaxf(max1, fmaxf(page_max1, max_exchange[other + r1]));
    // A row without a visible key so far keeps a base of 0 (exp2(-inf - -inf) would be NaN).
    const float base0 = new_max0 == -INFINITY ? 0.0f : new_max0;
    const float base1 = new_max1 == -INFINITY ? 0.0f : new_max1;
    const float rescale0 = exp2f(max0 - base0), rescale1 = exp2f(max1 - base1);
    max0 = new_max0, max1 = new_max1;
    sum0 *= rescale0, sum1 *= rescale1;

    // P into this warpgroup's 32 key columns of the box; the records past the sequence's end
    // among its keys zeroed (only this warpgroup's S read them).
#pragma unroll
    for (int j = 0; j < kHalfKeys / 8; ++j) {
      const float p0 = exp2f(sc[4 * j] - base0), p1 = exp2f(sc[4 * j + 1] - base0);
      const float p2 = exp2f(sc[4 * j + 2] - base1), p3 = exp2f(sc[4 * j + 3] - base1);
      sum0 += p0 + p1;
      sum1 += p2 + p3;
      const int column = warpgroup * kHalfKeys + 8 * j + 2 * t4;
      *reinterpret_cast<uint32_t*>(probs_bytes + tma_box_offset(r0, column)) =
          bf16x2_bits(__floats2bfloat162_rn(p0, p1));
      *reinterpret_cast<uint32_t*>(probs_bytes + tma_box_offset(r1, column)) =
          bf16x2_bits(__floats2bfloat162_rn(p2, p3));
    }
    const int valid = seq_len - page_key;  // records of the page in the sequence
    if (valid < key0 - page_key + kHalfKeys) {
      const int first = max(valid, warpgroup * kHalfKeys);
      const int chunks = (warpgroup * kHalfKeys + kHalfKeys - first) * L::kColumnBlocks * 8;
      uint8_t* const tile = base_bytes + (keys - base);
      for (int u = threadIdx.x % 128; u < chunks; u += 128) {
        const int row = first + u / (L::kColumnBlocks * 8), rest = u % (L::kColumnBlocks * 8);
        *reinterpret_cast<uint4*>(tile + (rest / 8) * L::kBlockBytes + row * 128 +
                                  (rest % 8) * 16) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int j = 0; j < kOutputRegs / 4; ++j) {
      o[4 * j] *= rescale0, o[4 * j + 1] *= rescale0;
      o[4 * j + 2] *= rescale1, o[4 * j + 3] *= rescale1;
    }
    // The writes above reach the tensor cores' (asynchronous) reads of shared memory.
    fence_proxy_async_shared();
    named_barrier(2, L::kThreads);

    // 3. O += P V over this warpgroup's channels, left in flight.
    wgmma_fence_registers(o);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kPageTokens / 16; ++k) {
      wgmma_m64nk16_ss<kHalfChannels, true>(
          o, wgmma_descriptor(probs + k * 32),
          wgmma_descriptor_mn(keys + own_values + k * 16 * 128, L::kBlockBytes), 1);
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
  wgmma_fence_registers(o);

  // The rows' sums over the four lanes of a row, then over the two warpgroups.
  sum0 = quad_sum(sum0), sum1 = quad_sum(sum1);
  if (t4 == 0) {
    sum_exchange[warpgroup * L::kRows + r0] = sum0;
    sum_exchange[warpgroup * L::kRows + r1] = sum1;
  }
  named_barrier(1, L::kThreads);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int local_row = half == 0 ? r0 : r1;
    if (local_row >= rows) continue;
    const float row_max = half == 0 ? max0 : max1;
    const float sum = sum_exchange[local_row] + sum_exchange[L::kRows + local_row];
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    const float lse = sum > 0.0f ? (row_max + log2f(sum)) * 0.69314718055994531f : -INFINITY;
    const int channel0 = warpgroup * kHalfChannels + 2 * t4;
    if (item.partial < 0) {
      const int64_t row = static_cast<int64_t>(item.batch) * rows_per_seq + first_row + local_row;
      uint16_t* const out = p.out + row * kLatentDim + channel0;
#pragma unroll
      for (int j = 0; j < kOutputRegs / 4; ++j) {
        *reinterpret_cast<uint32_t*>(out + 8 * j) = bf16x2_bits(__floats2bfloat162_rn(
            o[4 * j + 2 * half] * inverse, o[4 * j + 2 * half + 1] * inverse));
      }
      if (warpgroup == 0 && t4 == 0 && p.lse != nullptr) p.lse[row] = lse;
    } else {
      float* const out = p.partial_out +
                         (static_cast<int64_t>(item.partial) * L::kRows + local_row) * kLatentDim +
                         channel0;
#pragma unroll
      for (int j = 0; j < kOutputRegs / 4; ++j) {
        *reinterpret_cast<float2*>(out + 8 * j) =
            make_float2(o[4 * j + 2 * half] * inverse, o[4 * j + 2 * half + 1] * inverse);
      }
      if (warpgroup == 0 && t4 == 0) p.partial_lse[item.partial * L::kRows + local_row] = lse;
    }
  }
}

}  // namespace

void launch_decode_warpgroup(const DecodeKernelParams& p, int batch, int blocks,
                             cudaStream_t stream) {
  const int rows_per_seq = p.s_q * p.num_heads;
  if (p.record_bytes != L::kRecordBytes || rows_per_seq < 1 || batch < 1) {
    throw InvalidArgument("GPU decode, warpgroup kernel: records of " +
                          std::to_string(p.record_bytes) +
                          " bytes (BF16 content and RoPE: " + std::to_string(L::kRecordBytes) +
                          "), s_q " + std::to_string(p.s_q) + " x heads " +
                          std::to_string(p.num_heads) + ", batch " + std::to_string(batch));
  }
  // Boxes of 64 channels by 64 rows: Q's rows of a block, a page's records.
  const int box[] = {64, L::kRows};
  const int64_t q_dims[] = {kKeyDim, static_cast<int64_t>(batch) * rows_per_seq};
  const int64_t pool_dims[] = {kKeyDim, kPoolMapRecords};
  const int64_t strides[] = {kKeyDim};
  const CUtensorMap q_map = bf16_tensor_map(p.q, 2, q_dims, strides, box);
  const CUtensorMap pool_map = bf16_tensor_map(p.pool, 2, pool_dims, strides, box);
  launch_large_shared<mla_decode_warpgroup_kernel>(blocks, L::kThreads, L::kSharedBytes, stream, p,
                                                   q_map, pool_map);
}

}  // namespace quantmla::gpu
