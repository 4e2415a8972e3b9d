// The decode kernel: absorbed MLA over the paged cache, one thread block per WorkItem (16 or 32
// query rows of one sequence, a run of its pages). Per page: the raw records are copied to shared
// memory with cp.async (several pages ahead) and dequantized there to a BF16 tile, a whole or half
// page per step (BF16 caches are copied straight into the tile); then scores = Q K^T and
// out += P V run on the tensor cores (mma.m16n8k16, BF16 in, FP32 accumulation) with an online
// softmax in base 2.
//
// Eight warps; warp w takes row tile w % kRowTiles. For Q K^T it takes a quarter of the channels
// (content [128 s, +128) and RoPE [16 s, +16), s = (w / kRowTiles) % 4), its Q fragments held in
// registers for the whole block, and its part of the step's keys (kKeyTiles x 8); the four
// channel quarters' partial scores are summed in shared memory. For P V it takes 8 x kColumnTiles
// of the 512 output columns.
#pragma once

#include <cstdint>

#include "kernels/cuda/decode_schedule.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/record_formats.cuh"

namespace quantmla::gpu {

struct DecodeKernelParams {
  const uint16_t* q;           // [batch, s_q, num_heads, kKeyDim] BF16
  const uint8_t* pool;         // [pages, kPageTokens, record_bytes]
  const int32_t* block_table;  // [batch, block_table_stride]
  int64_t block_table_stride;
  const int32_t* seq_lens;  // [batch]
  uint16_t* out;            // [batch, s_q, num_heads, kLatentDim] BF16
  float* lse;               // [batch, s_q, num_heads] or null
  float* partial_out;       // [num_partials, rows_per_block, kLatentDim]
  float* partial_lse;       // [num_partials, rows_per_block]
  const WorkItem* items;    // [gridDim.x]
  int s_q;
  int num_heads;
  int record_bytes;
  float scale_log2;  // softmax_scale * log2(e)
  KeptPairs kept;
  bool pool_ready;  // MlaDecodeParams::pool_ready
};

// Shared memory per block on sm_90: all of it for one block per multiprocessor, half (less the
// 1 KB the driver reserves per block) for two.
inline constexpr int kSharedLimit = 227 * 1024;
inline constexpr int kSharedLimitTwoBlocks = 113 * 1024;
inline constexpr int kSharedLimitThreeBlocks = 75 * 1024;

template <class Content, class Rope, int kRowTiles>
struct DecodeLayout {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16 * kRowTiles;
  static constexpr bool kDirect = Content::kIsBf16 && Rope::kIsBf16;
  // One row tile of a small-record format (two raw pages in 48 KB: the int formats): half a page
  // per step, so that the block fits twice on a multiprocessor and twice the warps hide the
  // latencies (ncu with one block per SM: two warps per scheduler, stalled on shared-memory and
  // ALU dependencies most cycles).
  static constexpr int kMaxRecordBytes = Content::kBytes + Rope::kMaxBytes;
  static constexpr int kRawPageBytes = (kPageTokens * kMaxRecordBytes + 15) / 16 * 16;
  static constexpr bool kHalfPages = kRowTiles == 1 && !kDirect && 2 * kRawPageBytes <= 48 * 1024;
  static constexpr int kBlocksPerSm = kHalfPages ? 2 : 1;
  static constexpr int kStepKeys = kHalfPages ? kPageTokens / 2 : kPageTokens;
  static constexpr int kSlices = 4;                                 // channel quarters of Q K^T
  static constexpr int kKeyParts = kWarps / (kSlices * kRowTiles);  // key ranges of Q K^T
  static constexpr int kKeyTiles = kStepKeys / 8 / kKeyParts;       // n8 tiles of keys per warp
  static constexpr int kColumnTiles = kLatentDim / 8 / (kWarps / kRowTiles);  // P V n8 tiles
  static constexpr int kSoftThreads = kThreads / kRows;       // softmax threads per row
  static constexpr int kSoftKeys = kStepKeys / kSoftThreads;  // keys per softmax thread
  // BF16 values per tile row; the 16 extra bytes put the 8 rows of an ldmatrix in distinct banks.
  static constexpr int kTileStride = kKeyDim + 8;
  static constexpr int kTileBytes = kStepKeys * kTileStride * 2;
  static constexpr int kStageBytes = kDirect ? kTileBytes : kRawPageBytes;
  static constexpr int kScoreStride = kStepKeys + 8;
  static constexpr int kScoreBytes = kSlices * kRows * kScoreStride * 4;
  static constexpr int kProbStride = kStepKeys + 8;
  static constexpr int kProbBytes = kRows * kProbStride * 2;
  static constexpr int kStatBytes = 3 * kRows * 4;
  static constexpr int kFixedBytes =
      (kDirect ? 0 : kTileBytes) + kScoreBytes + kProbBytes + kStatBytes;
  static constexpr int kLimit = kBlocksPerSm == 2 ? kSharedLimitTwoBlocks : kSharedLimit;
  static constexpr int kMaxStages = 4;
  static constexpr int kFitStages = (kLimit - kFixedBytes) / kStageBytes;
  static constexpr int kStages = kFitStages < kMaxStages ? kFitStages : kMaxStages;
  // One stage (BF16 content with an int4 RoPE key only) still works, without copy/compute overlap.
  static_assert(kStages >= 1);
  static constexpr int kSharedBytes = kFixedBytes + kStages * kStageBytes;
  static_assert(kSharedBytes <= kLimit);
  static_assert(kKeyParts >= 1 && kKeyTiles >= 1 && kSoftKeys % 2 == 0);
};

// The BF16 values of tile columns (column, column + 1) of a row stored in channel order.
template <int kSpan>
__device__ __forceinline__ uint32_t load_pair(const uint16_t* row, int column) {
  const int channel = channel_of_column<kSpan>(column);
  if constexpr (kSpan == 1) {
    return *reinterpret_cast<const uint32_t*>(row + channel);
  } else {
    return static_cast<uint32_t>(row[channel]) | static_cast<uint32_t>(row[channel + kSpan]) << 16;
  }
}

// Dequantizes kStepKeys records starting at `raw` into BF16 tile rows, the first `valid` of them;
// rows past them become zeros (the pool holds arbitrary bytes there, which could decode to NaN and
// poison P V). Consecutive lanes take consecutive records: with odd record sizes in words, their
// loads hit distinct banks.
template <class Content, class Rope, class Layout>
__device__ __forceinline__ void dequantize_step(const uint8_t* raw, uint16_t* tile, int valid,
                                                const DecodeKernelParams& p) {
  constexpr int kRows = Layout::kStepKeys;
  constexpr int kChunks = kLatentDim / 64;
  constexpr int kRopeUnits = kRopeDim / 8;
  static_assert(kRows * kChunks % Layout::kThreads == 0);
#pragma unroll
  for (int task = threadIdx.x; task < kRows * kChunks; task += Layout::kThreads) {
    const int r = task % kRows;
    const int c = task / kRows;
    uint4 v[8];
    if (r < valid) {
      Content::chunk(raw + r * p.record_bytes, c, v);
    } else {
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = make_uint4(0, 0, 0, 0);
    }
    uint4* out = reinterpret_cast<uint4*>(tile + r * Layout::kTileStride + 64 * c);
#pragma unroll
    for (int u = 0; u < 8; ++u) out[u] = v[u];
  }
#pragma unroll
  for (int u = threadIdx.x; u < kRows * kRopeUnits; u += Layout::kThreads) {
    const int r = u % kRows;
    const int k = u / kRows;
    const uint8_t* rec = raw + r * p.record_bytes + Content::kBytes;
    uint16_t* out = tile + r * Layout::kTileStride + kLatentDim;
    *reinterpret_cast<uint4*>(out + 8 * k) =
        r < valid ? Rope::unit(rec, k) : make_uint4(0, 0, 0, 0);
    // Kept pairs overwrite their channels; the same thread wrote them just before.
    for (int n = 0; n < p.kept.count; ++n) {
      const int pair = p.kept.pairs[n];
      if (pair / 4 == k && r < valid) {
        const uint32_t stored = Rope::kept_pair(rec, n);
        out[column_of_channel<Rope::kPairSpan>(2 * pair)] = static_cast<uint16_t>(stored);
        out[column_of_channel<Rope::kPairSpan>(2 * pair + 1)] = static_cast<uint16_t>(stored >> 16);
      }
    }
  }
}

template <class Content, class Rope, int kRowTiles>
__global__ void __launch_bounds__(DecodeLayout<Content, Rope, kRowTiles>::kThreads,
                                  DecodeLayout<Content, Rope, kRowTiles>::kBlocksPerSm)
    mla_decode_kernel(const __grid_constant__ DecodeKernelParams p) {
  if (!p.pool_ready) wait_for_previous_kernel();
  using L = DecodeLayout<Content, Rope, kRowTiles>;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* const stages = smem;
  uint16_t* const tile_buffer = reinterpret_cast<uint16_t*>(smem + L::kStages * L::kStageBytes);
  float* const scores = reinterpret_cast<float*>(smem + L::kStages * L::kStageBytes +
                                                 (L::kDirect ? 0 : L::kTileBytes));
  uint16_t* const probs = reinterpret_cast<uint16_t*>(scores + L::kScoreBytes / 4);
  float* const alpha_rows = reinterpret_cast<float*>(probs + L::kProbBytes / 2);
  float* const sum_rows = alpha_rows + L::kRows;
  float* const max_rows = sum_rows + L::kRows;

  const WorkItem item = p.items[blockIdx.x];
  // A plan in a workspace launches a fixed grid (CUDA graphs); its unused items are padding.
  if (item.batch < 0) return;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int warp = tid / 32;
  const int warp_tile = warp % kRowTiles;
  const int slice = (warp / kRowTiles) % L::kSlices;     // Q K^T channel quarter
  const int key_part = warp / (kRowTiles * L::kSlices);  // Q K^T key range
  const int column_part = warp / kRowTiles;              // P V output columns
  const int seq_len = p.seq_lens[item.batch];
  const int rows_per_seq = p.s_q * p.num_heads;
  const int first_row = item.row_tile * L::kRows;
  const int num_pages = item.page_end - item.page_begin;
  const int32_t* const pages = p.block_table + item.batch * p.block_table_stride + item.page_begin;

  const auto load_page = [&](int i) {
    if (i < num_pages) {
      const int valid = min(kPageTokens, seq_len - (item.page_begin + i) * kPageTokens);
      const uint8_t* src = p.pool + static_cast<int64_t>(pages[i]) * kPageTokens * p.record_bytes;
      uint8_t* dst = stages + (i % L::kStages) * L::kStageBytes;
      if constexpr (L::kDirect) {
        constexpr int kChunks = kKeyDim * 2 / 16;
        for (int c = tid; c < kPageTokens * kChunks; c += L::kThreads) {
          const int r = c / kChunks;
          const int k = c % kChunks;
          cp_async_16(shared_address(dst + r * L::kTileStride * 2 + 16 * k),
                      src + r * (kKeyDim * 2) + 16 * k, r < valid ? 16 : 0);
        }
      } else {
        const int chunks = (valid * p.record_bytes + 15) / 16;
        for (int c = tid; c < chunks; c += L::kThreads) {
          cp_async_16(shared_address(dst + 16 * c), src + 16 * c, 16);
        }
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait count uniform
  };

  // The first pages before Q: with the pool ready (MlaDecodeParams::pool_ready) they are
  // requested while the previous kernel runs, and Q, which that kernel writes, after the wait.
#pragma unroll
  for (int s = 0; s < L::kStages - 1; ++s) load_page(s);
  if (p.pool_ready) wait_for_previous_kernel();

  // This warp's Q fragments for its 9 k-steps (8 of content, 1 of RoPE), in tile column order.
  uint32_t qf[9][4];
  {
    const uint16_t* q =
        p.q +
        (static_cast<int64_t>(item.batch) * rows_per_seq + first_row + 16 * warp_tile) * kKeyDim;
#pragma unroll
    for (int ks = 0; ks < 9; ++ks) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint16_t* row = q + (g + 8 * (i % 2)) * kKeyDim;
        const int column = 16 * (ks < 8 ? 8 * slice + ks : slice) + 2 * t + 8 * (i / 2);
        qf[ks][i] = ks < 8 ? load_pair<Content::kPairSpan>(row, column)
                           : load_pair<Rope::kPairSpan>(row + kLatentDim, column);
      }
    }
  }

  constexpr int kColumns = 8 * L::kColumnTiles;
  constexpr int kSpan = Content::kPairSpan;  // output columns are tile columns of the content
  float acc[L::kColumnTiles][4];
#pragma unroll
  for (int nt = 0; nt < L::kColumnTiles; ++nt) {
    acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  }

  // Softmax role: thread tid owns one row and kSoftKeys consecutive keys of every page.
  const int soft_row = tid / L::kSoftThreads;
  const int soft_seg = tid % L::kSoftThreads;
  const int soft_limit = seq_len - p.s_q + (first_row + soft_row) / p.num_heads + 1;
  float row_max = -INFINITY;
  float row_sum = 0.0f;

  for (int i = 0; i < num_pages; ++i) {
    __syncthreads();  // page i - 1 is done with: its stage and the tile may be overwritten
    load_page(i + L::kStages - 1);
    cp_async_wait<L::kStages - 1>();
    __syncthreads();
    const uint8_t* stage = stages + (i % L::kStages) * L::kStageBytes;
#pragma unroll 1
    for (int step = 0; step < kPageTokens / L::kStepKeys; ++step) {
      const int key0 = (item.page_begin + i) * kPageTokens + step * L::kStepKeys;
      const uint16_t* tile;
      if constexpr (L::kDirect) {
        tile = reinterpret_cast<const uint16_t*>(stage);
      } else {
        if (step > 0) __syncthreads();  // the previous step's P V has read the tile
        dequantize_step<Content, Rope, L>(stage + step * L::kStepKeys * p.record_bytes, tile_buffer,
                                          min(L::kStepKeys, seq_len - key0), p);
        __syncthreads();
        tile = tile_buffer;
      }

      // Partial scores over this warp's channel quarter: 16 rows x its keys. The k-step loop is
      // outside so that consecutive MMAs accumulate into different tiles.
      {
        float sc[L::kKeyTiles][4];
#pragma unroll
        for (int nt = 0; nt < L::kKeyTiles; ++nt)
          sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
        const uint16_t* key_rows = tile + (8 * L::kKeyTiles * key_part + lane % 8) * L::kTileStride;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          uint32_t b[L::kKeyTiles][4];
#pragma unroll
          for (int nt = 0; nt < L::kKeyTiles; ++nt) {
            ldmatrix_x4(b[nt], shared_address(key_rows + nt * 8 * L::kTileStride + 128 * slice +
                                              32 * kk + 8 * (lane / 8)));
          }
#pragma unroll
          for (int nt = 0; nt < L::kKeyTiles; ++nt) {
            mma_bf16_16x8x16(sc[nt], qf[2 * kk], b[nt][0], b[nt][1]);
          }
#pragma unroll
          for (int nt = 0; nt < L::kKeyTiles; ++nt) {
            mma_bf16_16x8x16(sc[nt], qf[2 * kk + 1], b[nt][2], b[nt][3]);
          }
        }
#pragma unroll
        for (int nt = 0; nt < L::kKeyTiles; ++nt) {
          uint32_t b[2];
          ldmatrix_x2(b, shared_address(key_rows + nt * 8 * L::kTileStride + kLatentDim +
                                        16 * slice + 8 * ((lane / 8) % 2)));
          mma_bf16_16x8x16(sc[nt], qf[8], b[0], b[1]);
        }
        float* mine = scores + (slice * L::kRows + 16 * warp_tile + g) * L::kScoreStride +
                      8 * L::kKeyTiles * key_part + 2 * t;
#pragma unroll
        for (int nt = 0; nt < L::kKeyTiles; ++nt) {
          *reinterpret_cast<float2*>(mine + 8 * nt) = make_float2(sc[nt][0], sc[nt][1]);
          *reinterpret_cast<float2*>(mine + 8 * L::kScoreStride + 8 * nt) =
              make_float2(sc[nt][2], sc[nt][3]);
        }
      }
      __syncthreads();

      // Online softmax over the page: sum the quarters, mask, rescale.
      {
        constexpr int kKeys = L::kSoftKeys;
        float x[kKeys] = {};
        const float* row = scores + soft_row * L::kScoreStride + kKeys * soft_seg;
#pragma unroll
        for (int s = 0; s < L::kSlices; ++s) {
#pragma unroll
          for (int j = 0; j < kKeys; j += 2) {
            const float2 v =
                *reinterpret_cast<const float2*>(row + s * L::kRows * L::kScoreStride + j);
            x[j] += v.x, x[j + 1] += v.y;
          }
        }
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < kKeys; ++j) {
          x[j] = key0 + kKeys * soft_seg + j < soft_limit ? x[j] * p.scale_log2 : -INFINITY;
          tile_max = fmaxf(tile_max, x[j]);
        }
#pragma unroll
        for (int offset = 1; offset < L::kSoftThreads; offset <<= 1) {
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
        }
        const float new_max = fmaxf(row_max, tile_max);
        // A row with no visible key yet keeps weight 0 everywhere instead of exp(-inf + inf).
        const float reference = new_max == -INFINITY ? 0.0f : new_max;
        const float alpha = exp2f(row_max - reference);
        float sum = 0.0f;
        uint32_t packed[kKeys / 2];
#pragma unroll
        for (int j = 0; j < kKeys / 2; ++j) {
          const float p0 = exp2_flushed(x[2 * j] - reference);
          const float p1 = exp2_flushed(x[2 * j + 1] - reference);
          sum += p0 + p1;
          packed[j] = bf16x2_bits(__floats2bfloat162_rn(p0, p1));
        }
        uint16_t* prob = probs + soft_row * L::kProbStride + kKeys * soft_seg;
#pragma unroll
        for (int j = 0; j < kKeys / 2; ++j) reinterpret_cast<uint32_t*>(prob)[j] = packed[j];
#pragma unroll
        for (int offset = 1; offset < L::kSoftThreads; offset <<= 1) {
          sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        row_sum = row_sum * alpha + sum;
        row_max = new_max;
        if (soft_seg == 0) alpha_rows[soft_row] = alpha;
      }
      __syncthreads();

      // out += P V over this warp's output columns.
      {
        const float alpha_lo = alpha_rows[16 * warp_tile + g];
        const float alpha_hi = alpha_rows[16 * warp_tile + g + 8];
#pragma unroll
        for (int nt = 0; nt < L::kColumnTiles; ++nt) {
          acc[nt][0] *= alpha_lo, acc[nt][1] *= alpha_lo;
          acc[nt][2] *= alpha_hi, acc[nt][3] *= alpha_hi;
        }
#pragma unroll
        for (int kk = 0; kk < L::kStepKeys / 16; ++kk) {
          uint32_t a[4];
          ldmatrix_x4(a, shared_address(probs + (16 * warp_tile + lane % 16) * L::kProbStride +
                                        16 * kk + 8 * (lane / 16)));
          const uint16_t* value_row = tile +
                                      (16 * kk + lane % 8 + 8 * ((lane / 8) % 2)) * L::kTileStride +
                                      kColumns * column_part + 8 * (lane / 16);
#pragma unroll
          for (int np = 0; np < L::kColumnTiles / 2; ++np) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, shared_address(value_row + 16 * np));
            mma_bf16_16x8x16(acc[2 * np], a, b[0], b[1]);
            mma_bf16_16x8x16(acc[2 * np + 1], a, b[2], b[3]);
          }
        }
      }
    }
  }

  if (soft_seg == 0) {
    sum_rows[soft_row] = row_sum;
    max_rows[soft_row] = row_max;
  }
  __syncthreads();

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int local_row = 16 * warp_tile + g + 8 * half;
    const int row = first_row + local_row;
    const float sum = sum_rows[local_row];
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    const float lse =
        sum > 0.0f ? (max_rows[local_row] + log2f(sum)) * 0.69314718055994531f : -INFINITY;
    if (item.partial < 0) {
      uint16_t* out = p.out + (static_cast<int64_t>(item.batch) * rows_per_seq + row) * kLatentDim;
#pragma unroll
      for (int nt = 0; nt < L::kColumnTiles; ++nt) {
        const int channel = channel_of_column<kSpan>(kColumns * column_part + 8 * nt + 2 * t);
        const uint32_t v = bf16x2_bits(
            __floats2bfloat162_rn(acc[nt][2 * half] * inverse, acc[nt][2 * half + 1] * inverse));
        if constexpr (kSpan == 1) {
          *reinterpret_cast<uint32_t*>(out + channel) = v;
        } else {
          out[channel] = static_cast<uint16_t>(v);
          out[channel + kSpan] = static_cast<uint16_t>(v >> 16);
        }
      }
      if (column_part == 0 && t == 0 && p.lse != nullptr) {
        p.lse[static_cast<int64_t>(item.batch) * rows_per_seq + row] = lse;
      }
    } else {
      float* out =
          p.partial_out + (static_cast<int64_t>(item.partial) * L::kRows + local_row) * kLatentDim;
#pragma unroll
      for (int nt = 0; nt < L::kColumnTiles; ++nt) {
        const int channel = channel_of_column<kSpan>(kColumns * column_part + 8 * nt + 2 * t);
        out[channel] = acc[nt][2 * half] * inverse;
        out[channel + kSpan] = acc[nt][2 * half + 1] * inverse;
      }
      if (column_part == 0 && t == 0) p.partial_lse[item.partial * L::kRows + local_row] = lse;
    }
  }
}

}  // namespace quantmla::gpu
