// The warpgroup decode kernel: a block per work item of 64 query rows (one sequence, a run of its
// pages), the products on wgmma with both operands in shared memory, for the head counts where the
// tiled kernel's mma.sync tiles are compute-bound (docs/benchmarks.md: 0.27x FlashMLA at 128
// heads). Where a sequence's s_q x heads rows do not come in 64s, its last block is padded: the
// rows past them read whatever Q follows (the next sequence's, or the copy's zeros past the
// tensor) and write nothing.
//
// This file's kernel runs the page schedule, for the formats that are dequantized; a BF16 cache's
// pages are copied as tiles and take the seesaw schedule (decode_seesaw.cuh), which shares the
// work items, the roundings and the output stage (store_rows) with it.
//
// Two of the block's four warpgroups multiply, two convert (warp specialization: each role gets
// its share of the registers with setmaxnreg). The converting warpgroups' first thread copies Q's
// 64 rows with a tensor map, as nine boxes of 64 channels in the 128-byte swizzle (wgmma.cuh), and
// the pages raw in halves of 32 records (bulk copies, three half pages in flight, two where three
// do not fit: WarpgroupLayout::kRawStages); all 256 converting threads dequantize each half into
// a BF16 slot of 32 keys with the tiled kernel's decoders (record_formats.cuh), so the values are
// the tiled kernel's; those decoders put a channel pair where the codes make it cheapest (a "pair
// span", tile column order), so Q's columns are permuted to the same order once, and the output's
// back at the end. Three slots turn: page i's halves are in slots 2i % 3 and (2i + 1) % 3, and the
// third takes the next page's first half. A slot's half is signalled converted on a shared-memory
// barrier, and released on another once both multiplying warpgroups' P V over it is done, which
// the converting warpgroups wait for before they write the slot again. Per page, the multiplying
// warpgroups:
//   1. S = Q K^T, each over its own half of the page (one slot: m64n32, 36 k-steps of 16
//      channels), each once its half is converted.
//   2. The online softmax in the log2 domain: each warpgroup's maximum of a row goes through
//      shared memory (a barrier of both), so both rescale by the same page maximum; P = exp2 in
//      FP32, rounded to BF16 into one 64 x 64 box (K-major for the next product's A operand); each
//      warpgroup sums the unrounded P of its own keys, merged at the end. Keys past a row's
//      query (s_q > 1) or the sequence are -inf; records past the sequence's end are
//      dequantized as zeros (their pool bytes are arbitrary, and NaN would survive a probability
//      of 0 in P V).
//   3. O += P V, each warpgroup over its own 256 of the 512 channels (two m64n128 products a
//      k-step, 4 k-steps, two commit groups of a half page each): V is the slots' own content
//      channels, read untransposed as an MN-major B operand. It runs while the next page's S is
//      issued.
// The softmax's steps are pages and P is rounded as the tiled kernel rounds it, so the host
// reference of test_gpu_mla (MlaDecodePlan::Operands::kBf16Tile) follows this kernel too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_kernel.cuh"
#include "kernels/cuda/decode_kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/record_formats.cuh"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/wgmma.cuh"
#include "quantmla/error.h"

namespace quantmla::gpu {

template <class ContentType, class RopeType>
struct WarpgroupLayout {
  using Content = ContentType;
  using Rope = RopeType;
  // A BF16 cache's pages are copied as tiles by the seesaw kernel (decode_seesaw.cuh) instead.
  static constexpr bool kDirect = Content::kIsBf16 && Rope::kIsBf16;
  // Two multiplying warpgroups (S, the softmax, P V) and two converting ones (the raw half pages'
  // copies and their dequantization into the slots), each role with its share of registers.
  static constexpr int kMultiplierThreads = 256;
  static constexpr int kConverterThreads = 256;
  static constexpr int kThreads = kMultiplierThreads + kConverterThreads;
  static constexpr int kMultiplierRegs = 184;  // O's 128 accumulators, S's 16, the softmax
  static constexpr int kConverterRegs = 72;    // a content chunk's codes and values
  static_assert(kMultiplierThreads * kMultiplierRegs + kConverterThreads * kConverterRegs <= 65536,
                "the roles' registers fit the SM's register file");
  static constexpr int kRows = kWarpgroupRows;                      // wgmma's M
  static constexpr int kStepKeys = kWarpgroupStepKeys;              // a page
  static constexpr int kHalfKeys = kStepKeys / 2;                   // a half page, one tile slot
  static constexpr int kColumnBlocks = kKeyDim / 64;                // boxes of 64 channels
  static constexpr int kBlockBytes = 64 * 128;                      // a box of 64 rows (Q, P)
  static constexpr int kQBytes = kColumnBlocks * kBlockBytes;       // Q's 64 rows
  static constexpr int kHalfBoxBytes = kHalfKeys * 128;             // a box of a half page's keys
  static constexpr int kSlotBytes = kColumnBlocks * kHalfBoxBytes;  // a half page as BF16
  // Three half-page slots: a page's two halves and the next page's first, converted while the
  // products of this page run.
  static constexpr int kSlots = 3;
  // Half page h's slot (page i's halves: h = 2i and 2i + 1).
  static constexpr int slot_of_half(int h) { return h % kSlots; }
  // What the kernel's order of waits relies on to never wait in a circle, page by page: a page's
  // halves in two slots; its second half where the previous page's first half was, and the next
  // page's first half where the previous page's second half was (each released once the P V over
  // it is done, which both warpgroups wait for before they wait for this page's halves), neither
  // of this page's slots.
  static constexpr bool slots_turn_as_scheduled() {
    for (int i = 1; i < 4 * kSlots; ++i) {
      const int first = slot_of_half(2 * i), second = slot_of_half(2 * i + 1);
      const int next_first = slot_of_half(2 * i + 2);
      if (first == second || second != slot_of_half(2 * i - 2) ||
          next_first != slot_of_half(2 * i - 1) || next_first == first || next_first == second) {
        return false;
      }
    }
    return true;
  }
  static constexpr int kProbBytes = kBlockBytes;  // P: 64 rows x 64 keys, one box
  static constexpr int kRawHalfBytes =            // a half page's records, copied raw
      (kHalfKeys * (Content::kBytes + Rope::kMaxBytes) + 127) / 128 * 128;
  static constexpr int kExchangeBytes = 2 * kRows * 4;  // the row maxima, [warpgroup][row] FP32
  // Q, the slots and P, each of whole 1024-byte swizzle atoms from a 1024-byte-aligned base
  // (+ 1024: the dynamic allocation only promises 16), then the raw stages (16-byte aligned for
  // the bulk copies), the exchange and the barriers (Q's, one a raw stage, two a slot: converted
  // and released).
  static constexpr int kSlotOffset = kQBytes;
  static constexpr int kProbOffset = kSlotOffset + kSlots * kSlotBytes;
  static constexpr int kRawOffset = kProbOffset + kProbBytes;
  static constexpr int shared_bytes(int raw_stages) {
    return 1024 + kRawOffset + raw_stages * kRawHalfBytes + kExchangeBytes +
           (1 + raw_stages + 2 * kSlots) * 8;
  }
  // Half pages in flight: three where they fit (a copy then has a page and a half to land), else
  // two (FP8 content, and INT4 content with a BF16 RoPE key).
  static constexpr int kRawStages = shared_bytes(3) <= kSharedLimit ? 3 : 2;
  static constexpr int kExchangeOffset = kRawOffset + kRawStages * kRawHalfBytes;
  static constexpr int kSharedBytes = shared_bytes(kRawStages);
  static_assert(kSlotBytes % 1024 == 0 && kProbOffset % 1024 == 0 && kRawOffset % 16 == 0,
                "swizzled boxes on 1024-byte atoms, raw stages on 16 bytes");
  static_assert(kKeyDim % 64 == 0 && kLatentDim == 2 * 256, "two warpgroups of 256 channels");
  static_assert(kRows == 64 && kStepKeys == kPageTokens && kStepKeys == 64,
                "64 rows of wgmma's M; a page is one box of keys and one k-block of P");
};

// The formats whose slots and raw stages fit an SM's shared memory: all but BF16 content with an
// int4 RoPE key and FP8 content with a BF16 one (two raw half pages of 34 or 21 KB beside the
// slots), as decode_kernels.h's warpgroup_kernel_reads states it for the plan (checked below). A
// BF16 cache is copied as tiles by the seesaw kernel, whose layout decode_seesaw.cuh checks.
template <class Content, class Rope>
inline constexpr bool kWarpgroupFits = WarpgroupLayout<Content, Rope>::kDirect ||
                                       WarpgroupLayout<Content, Rope>::kSharedBytes <= kSharedLimit;
static_assert(kWarpgroupFits<ContentBf16, RopeBf16> && !kWarpgroupFits<ContentBf16, RopeInt4> &&
                  !kWarpgroupFits<ContentFp8, RopeBf16> && kWarpgroupFits<ContentFp8, RopeInt4> &&
                  kWarpgroupFits<ContentInt<4, 64>, RopeBf16> &&
                  kWarpgroupFits<ContentInt<4, 64>, RopeInt4> &&
                  kWarpgroupFits<ContentInt<4, 128>, RopeBf16> &&
                  kWarpgroupFits<ContentInt<4, 128>, RopeInt4> &&
                  kWarpgroupFits<ContentInt<2, 64>, RopeBf16> &&
                  kWarpgroupFits<ContentInt<2, 64>, RopeInt4> &&
                  kWarpgroupFits<ContentInt<2, 128>, RopeBf16> &&
                  kWarpgroupFits<ContentInt<2, 128>, RopeInt4>,
              "warpgroup_kernel_reads (decode_kernels.h) names the two formats that do not fit");
static_assert(WarpgroupLayout<ContentInt<4, 64>, RopeInt4>::slots_turn_as_scheduled(),
              "the page schedule's three slots turn as its waits presume");
static_assert(WarpgroupLayout<ContentInt<4, 64>, RopeInt4>::kRawStages == 3 &&
                  WarpgroupLayout<ContentInt<2, 64>, RopeInt4>::kRawStages == 3 &&
                  WarpgroupLayout<ContentInt<4, 64>, RopeBf16>::kRawStages == 2 &&
                  WarpgroupLayout<ContentFp8, RopeInt4>::kRawStages == 2,
              "three half pages in flight for the int4 and int2 caches with an int4 RoPE key");

namespace warpgroup_detail {

constexpr int kHalfKeys = kPageTokens / 2;      // one warpgroup's keys of the scores
constexpr int kHalfChannels = kLatentDim / 2;   // one warpgroup's channels of the output
constexpr int kScoreRegs = kHalfKeys / 2;       // m64n32's accumulators a thread
constexpr int kOutputRegs = kHalfChannels / 2;  // m64n256's
constexpr int kBlockBytes = 64 * 128;
constexpr int kStoreBarrier = 7;      // the named barrier of store_rows (1-6: the kernels' own)
constexpr int kConvertedBarrier = 3;  // the page schedule's converting warpgroups
// A BF16 pool's tensor map spans this many records (the kernel parameters do not carry the pool's
// size; a copy only reads the pages the block table names): 2^28 records are 309 GB, more than any
// GPU holds, and keep the map's extent below the hardware's 2^40 bytes.
constexpr int64_t kPoolMapRecords = int64_t{1} << 28;

// The base a row's P is taken against for its running maximum: a row without a visible key so far
// keeps 0 (exp2(-inf - -inf) would be NaN); and the factor 2^(from - to) of a rescale between two
// running maxima.
__device__ __forceinline__ float softmax_base(float max) { return max == -INFINITY ? 0.0f : max; }
__device__ __forceinline__ float rescale_between(float from, float to) {
  return exp2f(from - softmax_base(to));
}

// Scores of keys past a row's last visible one as -inf, in accumulators of m64nN (the N / 8
// n-tiles of rows r0 and r1: registers 4 j + e hold key first_key + 8 j + (e & 1), of row r0 for
// e < 2 and r1 otherwise; first_key includes the thread's 2 (lane % 4)). Called on the pages that
// need it only, behind a branch: the compares and selects then cost nothing on the others.
template <int kRegs>
__device__ __forceinline__ void mask_scores(float (&sc)[kRegs], int first_key, int last0,
                                            int last1) {
#pragma unroll
  for (int j = 0; j < kRegs / 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (first_key + 8 * j + (e & 1) > (e < 2 ? last0 : last1)) sc[4 * j + e] = -INFINITY;
    }
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// The maxima of rows r0 and r1 over accumulators of m64nN (laid out as in mask_scores), across the
// four lanes of each row, times `scale` (positive: rounding keeps the order of the products, so
// these are the scaled scores' maxima, and P takes one FFMA an element).
template <int kRegs>
__device__ __forceinline__ void scaled_row_maxima(const float (&sc)[kRegs], float scale,
                                                  float& max0, float& max1) {
  float row_max0 = -INFINITY, row_max1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < kRegs / 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e < 2) {
        row_max0 = fmaxf(row_max0, sc[4 * j + e]);
      } else {
        row_max1 = fmaxf(row_max1, sc[4 * j + e]);
      }
    }
  }
  max0 = quad_max(row_max0) * scale, max1 = quad_max(row_max1) * scale;
}

// O's rows r0 and r1 (the accumulators of m64n256: registers 4 j + e, row r0 for e < 2) times
// their rescale factors s0 and s1, skipped where no row of the warp changed its maximum (factors
// of 1: the multiplications would change nothing, and once a row's maximum has settled that is
// most pages).
__device__ __forceinline__ void rescale_output(float (&o)[kOutputRegs], float s0, float s1) {
  if (!__any_sync(0xffffffffu, s0 != 1.0f || s1 != 1.0f)) return;
#pragma unroll
  for (int j = 0; j < kOutputRegs / 4; ++j) {
    o[4 * j] *= s0, o[4 * j + 1] *= s0;
    o[4 * j + 2] *= s1, o[4 * j + 3] *= s1;
  }
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Q's boxes [first, first + count) from channel order to the tile column order of pair span kSpan
// (record_formats.cuh), in place: each thread takes groups of 2 kSpan columns of a row.
template <int kSpan, int kThreads>
__device__ __forceinline__ void to_tile_columns(uint8_t* q, int first, int count) {
  if constexpr (kSpan > 1) {
    constexpr int kGroup = 2 * kSpan;         // columns a group
    constexpr int kGroupChunks = kGroup / 8;  // its 16-byte chunks
    constexpr int kGroupsPerRow = 64 / kGroup;
    for (int task = threadIdx.x; task < 64 * count * kGroupsPerRow; task += kThreads) {
      const int row = task % 64;
      const int box = first + task / 64 / kGroupsPerRow;
      const int group = task / 64 % kGroupsPerRow;
      uint8_t* const base = q + box * kBlockBytes;
      uint16_t natural[kGroup], tiled[kGroup];
#pragma unroll
      for (int k = 0; k < kGroupChunks; ++k) {
        const uint4 v =
            *reinterpret_cast<const uint4*>(base + tma_box_offset(row, kGroup * group + 8 * k));
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          natural[8 * k + 2 * w] = static_cast<uint16_t>(words[w]);
          natural[8 * k + 2 * w + 1] = static_cast<uint16_t>(words[w] >> 16);
        }
      }
#pragma unroll
      for (int c = 0; c < kGroup; ++c) tiled[c] = natural[channel_of_column<kSpan>(c)];
#pragma unroll
      for (int k = 0; k < kGroupChunks; ++k) {
        uint32_t words[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          words[w] = static_cast<uint32_t>(tiled[8 * k + 2 * w]) |
                     static_cast<uint32_t>(tiled[8 * k + 2 * w + 1]) << 16;
        }
        *reinterpret_cast<uint4*>(base + tma_box_offset(row, kGroup * group + 8 * k)) =
            make_uint4(words[0], words[1], words[2], words[3]);
      }
    }
  }
}

// The 16-bit value `column` (0-7) of 8 packed in v replaced by `value`, in registers (an index
// into an array would put it in local memory).
__device__ __forceinline__ void set_value(uint4& v, int column, uint32_t value) {
  const uint32_t shift = (column % 2) * 16, keep = ~(0xffffu << shift), put = value << shift;
  const int word = column / 2;
  v.x = word == 0 ? (v.x & keep) | put : v.x;
  v.y = word == 1 ? (v.y & keep) | put : v.y;
  v.z = word == 2 ? (v.z & keep) | put : v.z;
  v.w = word == 3 ? (v.w & keep) | put : v.w;
}

// A raw half page (32 records of p.record_bytes at `raw`) into a slot (nine boxes of 32 keys, tile
// column order), the tiled kernel's decoders and kept pairs; records from `valid` on as zeros.
// One content chunk and one RoPE unit a converting thread (`thread`: its index among them).
template <class L>
__device__ __forceinline__ void dequantize_half(uint8_t* raw, uint8_t* slot, int valid,
                                                const DecodeKernelParams& p, int thread) {
  using Content = typename L::Content;
  using Rope = typename L::Rope;
  constexpr int kRows = L::kHalfKeys, kBoxBytes = L::kHalfBoxBytes;
  constexpr int kChunks = kLatentDim / 64;  // content boxes
  static_assert(
      kRows * kChunks == L::kConverterThreads && kRows * (kRopeDim / 8) == L::kConverterThreads,
      "a content chunk and a RoPE unit a converting thread");
  // Records past the sequence's end (in its last half page) hold arbitrary pool bytes, and NaN
  // would survive a probability of 0 in P V: they are zeroed in the raw stage first (every
  // supported format decodes a zero record to zeros), so that no thread selects zeros for them
  // on every other half page. `valid` is the same in every converting thread.
  if (valid < kRows) {
    const int first = max(valid, 0) * p.record_bytes, words = (kRows * p.record_bytes - first) / 4;
#pragma unroll 1  // a sequence's last half page only: kept short
    for (int i = thread; i < words; i += L::kConverterThreads) store_u32(raw + first + 4 * i, 0u);
    named_barrier(kConvertedBarrier, L::kConverterThreads);
  }
  const int r = thread % kRows, c = thread / kRows;
  const uint8_t* const rec = raw + r * p.record_bytes;
  // The RoPE unit's stored words first, so that they load with the content's: read after the
  // content's stores (which the compiler cannot move a load above: both are shared memory), their
  // latency was the conversion's largest stall (Nsight Compute, 64 x 32K, 128 heads: 6% of the
  // kernel's samples).
  const typename Rope::Unit rope_words = Rope::load_unit(rec + Content::kBytes, c);
  uint4 v[8];
  Content::chunk(rec, c, v);
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    *reinterpret_cast<uint4*>(slot + c * kBoxBytes + tma_box_offset(r, 8 * u)) = v[u];
  }
  // The RoPE key's unit k = c of this record.
  uint4 w = Rope::dequantize_unit(rope_words);
  // Kept pairs replace their two channels (both in this unit of 8).
  for (int n = 0; n < p.kept.count; ++n) {
    const int pair = p.kept.pairs[n];
    if (pair / 4 != c) continue;
    const uint32_t stored = Rope::kept_pair(rec + Content::kBytes, n);
    set_value(w, column_of_channel<Rope::kPairSpan>(2 * pair) % 8, stored & 0xffffu);
    set_value(w, column_of_channel<Rope::kPairSpan>(2 * pair + 1) % 8, stored >> 16);
  }
  *reinterpret_cast<uint4*>(slot + kChunks * kBoxBytes + tma_box_offset(r, 8 * c)) = w;
}

// A work item's run as both warpgroup kernels read it, and this thread's two rows of the block
// (accumulator rows g and g + 8 of its warp; the two warpgroups hold the same rows) with the last
// key each sees: its query's position (a padded row's: the sequence's last).
struct BlockRun {
  int seq_len, rows_per_seq, first_row, num_pages;
  const int32_t* pages;  // the block table from the run's first page
  int r0, r1, last0, last1;
  int block_last;  // the block's first row's last key
};
__device__ __forceinline__ BlockRun block_run(const DecodeKernelParams& p, const WorkItem& item) {
  BlockRun run;
  run.seq_len = p.seq_lens[item.batch];
  run.rows_per_seq = p.s_q * p.num_heads;
  run.first_row = item.row_tile * kWarpgroupRows;
  run.num_pages = item.page_end - item.page_begin;
  run.pages =
      p.block_table + static_cast<int64_t>(item.batch) * p.block_table_stride + item.page_begin;
  run.r0 = 16 * ((threadIdx.x / 32) % 4) + threadIdx.x % 32 / 4;
  run.r1 = run.r0 + 8;
  run.last0 = min(run.seq_len - p.s_q + (run.first_row + run.r0) / p.num_heads, run.seq_len - 1);
  run.last1 = min(run.seq_len - p.s_q + (run.first_row + run.r1) / p.num_heads, run.seq_len - 1);
  run.block_last = run.seq_len - p.s_q + run.first_row / p.num_heads;
  return run;
}

// The block's output rows: this thread's sums (of its rows run.r0 and run.r1: the unrounded P of
// its keys) merged over the four lanes of a row and the two warpgroups (through `sum_exchange`,
// [2][64] FP32), then each warpgroup's 256 channels of O (accumulator columns in tile column order
// of pair span kSpan) over the sum in BF16, or, for a split's run, in FP32 beside its log-sum-exp.
// max0, max1: the rows' final maxima (log2 domain). Rows past the sequence's s_q x heads (padding)
// write nothing.
template <int kSpan>
__device__ __forceinline__ void store_rows(const DecodeKernelParams& p, const WorkItem& item,
                                           const BlockRun& run, float max0, float max1, float sum0,
                                           float sum1, const float (&o)[kOutputRegs],
                                           float* sum_exchange) {
  constexpr int kRows = kWarpgroupRows;
  const int warpgroup = threadIdx.x / 128, t4 = threadIdx.x % 4;
  const int rows_per_seq = run.rows_per_seq, first_row = run.first_row, r0 = run.r0, r1 = run.r1;
  const int rows = min(kRows, rows_per_seq - first_row);  // the block's rows that are not padding
  sum0 = quad_sum(sum0), sum1 = quad_sum(sum1);
  if (t4 == 0) {
    sum_exchange[warpgroup * kRows + r0] = sum0;
    sum_exchange[warpgroup * kRows + r1] = sum1;
  }
  named_barrier(kStoreBarrier, 2 * 128);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int local_row = half == 0 ? r0 : r1;
    if (local_row >= rows) continue;
    const float row_max = half == 0 ? max0 : max1;
    const float sum = sum_exchange[local_row] + sum_exchange[kRows + local_row];
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    const float lse = sum > 0.0f ? (row_max + log2f(sum)) * 0.69314718055994531f : -INFINITY;
    // Accumulator columns 8 j + 2 t4 (+ 1) of the warpgroup's 256, in tile column order.
    const int column0 = warpgroup * kHalfChannels + 2 * t4;
    if (item.partial < 0) {
      const int64_t row = static_cast<int64_t>(item.batch) * rows_per_seq + first_row + local_row;
      uint16_t* const out = p.out + row * kLatentDim;
#pragma unroll
      for (int j = 0; j < kOutputRegs / 4; ++j) {
        const uint32_t v = bf16x2_bits(__floats2bfloat162_rn(o[4 * j + 2 * half] * inverse,
                                                             o[4 * j + 2 * half + 1] * inverse));
        const int channel = channel_of_column<kSpan>(column0 + 8 * j);
        if constexpr (kSpan == 1) {
          *reinterpret_cast<uint32_t*>(out + channel) = v;
        } else {
          out[channel] = static_cast<uint16_t>(v);
          out[channel + kSpan] = static_cast<uint16_t>(v >> 16);
        }
      }
      if (warpgroup == 0 && t4 == 0 && p.lse != nullptr) p.lse[row] = lse;
    } else {
      float* const out =
          p.partial_out + (static_cast<int64_t>(item.partial) * kRows + local_row) * kLatentDim;
#pragma unroll
      for (int j = 0; j < kOutputRegs / 4; ++j) {
        const int channel = channel_of_column<kSpan>(column0 + 8 * j);
        out[channel] = o[4 * j + 2 * half] * inverse;
        out[channel + kSpan] = o[4 * j + 2 * half + 1] * inverse;
      }
      if (warpgroup == 0 && t4 == 0) p.partial_lse[item.partial * kRows + local_row] = lse;
    }
  }
}

}  // namespace warpgroup_detail

template <class Content, class Rope>
__global__ void __launch_bounds__(WarpgroupLayout<Content, Rope>::kThreads, 1)
    mla_decode_warpgroup_kernel(const __grid_constant__ DecodeKernelParams p,
                                const __grid_constant__ CUtensorMap q_map) {
  using L = WarpgroupLayout<Content, Rope>;
  using namespace warpgroup_detail;
  static_assert(kWarpgroupFits<Content, Rope> && !L::kDirect,
                "a format whose pages fit raw beside the tiles; BF16 takes the seesaw kernel");
  wait_for_previous_kernel();
  const WorkItem item = p.items[blockIdx.x];
  if (item.batch < 0) return;  // padding of a fixed grid (a plan in a workspace)

  extern __shared__ __align__(16) uint8_t shared_raw[];
  const uint32_t base = swizzle_base(shared_raw);
  uint8_t* const base_bytes = shared_raw + (base - shared_address(shared_raw));
  // Q, the three slots, P, the raw stages, the exchange of row maxima, the barriers.
  const uint32_t q_tile = base;
  const uint32_t slots = base + L::kSlotOffset;
  uint8_t* const slot_bytes = base_bytes + L::kSlotOffset;
  const uint32_t probs = base + L::kProbOffset;
  uint8_t* const probs_bytes = base_bytes + L::kProbOffset;
  float* const max_exchange = reinterpret_cast<float*>(base_bytes + L::kExchangeOffset);  // [2][64]
  uint64_t* const q_full = reinterpret_cast<uint64_t*>(max_exchange + 2 * L::kRows);
  uint64_t* const half_full = q_full + 1;                 // [kRawStages]: a raw half page landed
  uint64_t* const converted = half_full + L::kRawStages;  // [kSlots]: a half page in the slot
  uint64_t* const released = converted + L::kSlots;       // [kSlots]: both warpgroups' reads done

  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int s = 0; s < L::kRawStages; ++s) mbarrier_init(&half_full[s], 1);
    for (int s = 0; s < L::kSlots; ++s) {
      mbarrier_init(&converted[s], 1);
      mbarrier_init(&released[s], 2);  // one thread of each multiplying warpgroup
    }
    fence_barrier_init();
  }
  __syncthreads();
  const BlockRun run = block_run(p, item);
  const int halves = 2 * run.num_pages;  // half h: page h / 2's records 32 (h % 2) on

  // The converting warpgroups (threads 256-511): Q's copy and the raw half pages' (their first
  // thread), each half converted into its slot (slot_of_half) once the slot's previous half is
  // released. The roles split right after the barriers' set-up, before the roles' own state, on a
  // value the compiler knows to be the same in a warp (as `warpgroup` below).
  const bool converting =
      __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / L::kMultiplierThreads), 0) > 0;
  if (converting) {
    setmaxnreg_dec<L::kConverterRegs>();
    const int thread = threadIdx.x - L::kMultiplierThreads;
    uint8_t* const raw_stages = base_bytes + L::kRawOffset;
    // Half page h of the run into raw stage `stage` (h % kRawStages), as the records' bytes.
    const uint32_t half_bytes = static_cast<uint32_t>(L::kHalfKeys * p.record_bytes);
    const auto load_half = [&](int h, int stage) {
      const int64_t record =
          static_cast<int64_t>(run.pages[h / 2]) * kPageTokens + (h % 2) * L::kHalfKeys;
      mbarrier_arrive_expect_bytes(&half_full[stage], half_bytes);
      bulk_copy_to_shared(raw_stages + stage * L::kRawHalfBytes, p.pool + record * p.record_bytes,
                          half_bytes, &half_full[stage]);
    };
    if (thread == 0) {
      mbarrier_arrive_expect_bytes(q_full, L::kQBytes);
      const int q_row = item.batch * run.rows_per_seq + run.first_row;
#pragma unroll
      for (int b = 0; b < L::kColumnBlocks; ++b) {
        tma_load_2d(q_tile + b * L::kBlockBytes, &q_map, 64 * b, q_row, q_full);
      }
      for (int h = 0; h < L::kRawStages && h < halves; ++h) load_half(h, h);
    }
    // Half h's slot (slot_of_half) and raw stage, and the parities their barriers' phases wait
    // for, stepped along with h rather than divided out of it: the slot's previous half's release
    // (h / kSlots - 1: unused for the first kSlots halves), the stage's copy (h / kRawStages).
    static_assert(L::slot_of_half(L::kSlots) == 0, "slots taken in turn");
    int slot = 0, stage = 0;
    uint32_t released_parity = 1, landed_parity = 0;
    for (int h = 0; h < halves; ++h) {
      // The slot's previous half (h - kSlots) read by both warpgroups, and this half's bytes.
      if (h >= L::kSlots) mbarrier_wait(&released[slot], released_parity);
      mbarrier_wait(&half_full[stage], landed_parity);
      const int valid = run.seq_len - (item.page_begin * kPageTokens + h * L::kHalfKeys);
      dequantize_half<L>(raw_stages + stage * L::kRawHalfBytes, slot_bytes + slot * L::kSlotBytes,
                         valid, p, thread);
      // Every converting thread's writes reach the tensor cores' reads, and its reads of the raw
      // stage are done (the stage takes half h + kRawStages next).
      fence_proxy_async_shared();
      named_barrier(kConvertedBarrier, L::kConverterThreads);
      if (thread == 0) {
        mbarrier_arrive(&converted[slot]);
        if (h + L::kRawStages < halves) load_half(h + L::kRawStages, stage);
      }
      if (++slot == L::kSlots) slot = 0, released_parity ^= 1;
      if (++stage == L::kRawStages) stage = 0, landed_parity ^= 1;
    }
    return;
  }

  // The multiplying warpgroups (threads 0-255).
  setmaxnreg_inc<L::kMultiplierRegs>();
  // The warpgroup as a value the compiler knows to be the same in a warp (a shuffle): wgmma under
  // a branch it takes for divergent would be serialized (ptxas C7520).
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  const int t4 = threadIdx.x % 4;
  const int r0 = run.r0, r1 = run.r1;
  float o[kOutputRegs] = {};
  // O as two products of 128 channels each: an instruction of m64n256's 128 accumulators needs
  // more registers than the block's even share (the launch's 512 threads: 128), which is all
  // ptxas allows an instruction whatever setmaxnreg gives the warpgroup (C7602).
  float(&o_left)[kOutputRegs / 2] = *reinterpret_cast<float(*)[kOutputRegs / 2]>(&o[0]);
  float(&o_right)[kOutputRegs / 2] =
      *reinterpret_cast<float(*)[kOutputRegs / 2]>(&o[kOutputRegs / 2]);
  float max0 = -INFINITY, max1 = -INFINITY;  // the page maxima so far (both warpgroups' keys)
  float sum0 = 0.0f, sum1 = 0.0f;            // this thread's keys only
  // The products' operands as descriptors made once (a k-step, and a slot, add their offsets:
  // descriptor_at). The warpgroup's values are its four boxes of a slot.
  const uint64_t q_descriptor = wgmma_descriptor(q_tile);
  const uint64_t keys_descriptor = wgmma_descriptor(slots);
  const uint64_t values_descriptor = wgmma_descriptor_mn(
      slots + warpgroup * (kHalfChannels / 64) * L::kHalfBoxBytes, L::kHalfBoxBytes);
  const uint64_t probs_descriptor = wgmma_descriptor(probs);
  mbarrier_wait(q_full, 0);
  if constexpr (Content::kPairSpan > 1 || Rope::kPairSpan > 1) {
    to_tile_columns<Content::kPairSpan, L::kMultiplierThreads>(base_bytes, 0, kLatentDim / 64);
    to_tile_columns<Rope::kPairSpan, L::kMultiplierThreads>(base_bytes, kLatentDim / 64, 1);
    fence_proxy_async_shared();
    named_barrier(1, L::kMultiplierThreads);
  }
  // Half h converted into its slot; half h's slot released by this warpgroup (its reads of it
  // done: one thread arrives for the warpgroup).
  const auto wait_converted = [&](int h) {
    mbarrier_wait(&converted[L::slot_of_half(h)], static_cast<uint32_t>((h / L::kSlots) & 1));
  };
  const auto release = [&](int h) {
    if (h >= 0 && threadIdx.x % 128 == 0) mbarrier_arrive(&released[L::slot_of_half(h)]);
  };

  // Page i's halves sit in slots 2i % 3 (warpgroup 0's keys) and (2i + 1) % 3 (warpgroup 1's).
  // Page i - 1's P V is in flight as two commit groups, one a half page: each warpgroup first
  // releases each half's slot as soon as its group over it is done, so that the converting
  // warpgroups can refill it (page i's second half takes the slot of page i - 1's first, the next
  // page's first half that of its second), and only then waits for its own half of page i.
  for (int i = 0; i < run.num_pages; ++i) {
    const int page_key = (item.page_begin + i) * kPageTokens;
    const int first_slot = L::slot_of_half(2 * i), second_slot = L::slot_of_half(2 * i + 1);
    wgmma_wait<1>();  // the previous page's P V over its first half
    release(2 * i - 2);
    wgmma_wait<0>();  // and over its second
    release(2 * i - 1);
    // 1. S over this warpgroup's keys (its half of the page, one slot), issued once nothing else
    // of this warpgroup's is in flight (a wgmma_wait<1> while S is, as releasing the previous
    // page's second half behind S would need, makes ptxas serialize every product: C7514).
    float sc[kScoreRegs];
    const int own_half = 2 * i + warpgroup;
    wait_converted(own_half);
    const uint64_t keys_at =
        descriptor_at(keys_descriptor, L::slot_of_half(own_half) * L::kSlotBytes);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kKeyDim / 16; ++s) {
      wgmma_m64nk16_ss<kHalfKeys>(
          sc, descriptor_at(q_descriptor, (s / 4) * L::kBlockBytes + (s % 4) * 32),
          descriptor_at(keys_at, (s / 4) * L::kHalfBoxBytes + (s % 4) * 32), s);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_registers(sc);
    wgmma_fence_registers(o);

    // 2. The mask, this warpgroup's maxima of the rows (scaled), the page maxima through shared
    // memory.
    const int key0 = page_key + warpgroup * kHalfKeys;
    const bool masked = key0 + kHalfKeys - 1 > run.block_last;
    if (masked) mask_scores(sc, key0 + 2 * t4, run.last0, run.last1);
    float page_max0, page_max1;
    scaled_row_maxima(sc, p.scale_log2, page_max0, page_max1);
    if (t4 == 0) {
      max_exchange[warpgroup * L::kRows + r0] = page_max0;
      max_exchange[warpgroup * L::kRows + r1] = page_max1;
    }
    named_barrier(1, L::kMultiplierThreads);
    const int other = (1 - warpgroup) * L::kRows;
    const float new_max0 = fmaxf(max0, fmaxf(page_max0, max_exchange[other + r0]));
    const float new_max1 = fmaxf(max1, fmaxf(page_max1, max_exchange[other + r1]));
    const float base0 = softmax_base(new_max0), base1 = softmax_base(new_max1);
    const float rescale0 = exp2f(max0 - base0), rescale1 = exp2f(max1 - base1);
    max0 = new_max0, max1 = new_max1;
    sum0 *= rescale0, sum1 *= rescale1;

    // P into this warpgroup's 32 key columns of the box (the previous page's P V, its reader, is
    // done in both warpgroups: each waited for it above, before barrier 1).
#pragma unroll
    for (int j = 0; j < kHalfKeys / 8; ++j) {
      const float p0 = exp2_flushed(fmaf(sc[4 * j], p.scale_log2, -base0));
      const float p1 = exp2_flushed(fmaf(sc[4 * j + 1], p.scale_log2, -base0));
      const float p2 = exp2_flushed(fmaf(sc[4 * j + 2], p.scale_log2, -base1));
      const float p3 = exp2_flushed(fmaf(sc[4 * j + 3], p.scale_log2, -base1));
      sum0 += p0 + p1;
      sum1 += p2 + p3;
      const int column = warpgroup * kHalfKeys + 8 * j + 2 * t4;
      *reinterpret_cast<uint32_t*>(probs_bytes + tma_box_offset(r0, column)) =
          bf16x2_bits(__floats2bfloat162_rn(p0, p1));
      *reinterpret_cast<uint32_t*>(probs_bytes + tma_box_offset(r1, column)) =
          bf16x2_bits(__floats2bfloat162_rn(p2, p3));
    }
    rescale_output(o, rescale0, rescale1);
    // The writes above reach the tensor cores' (asynchronous) reads of shared memory.
    fence_proxy_async_shared();
    named_barrier(2, L::kMultiplierThreads);

    // 3. O += P V over this warpgroup's channels, left in flight as two commit groups, one a
    // half page (keys 0-31 from the first slot, 32-63 from the second).
    wgmma_fence_registers(o);
    wgmma_fence();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint64_t values_at =
          descriptor_at(values_descriptor, (half == 0 ? first_slot : second_slot) * L::kSlotBytes);
#pragma unroll
      for (int k = 0; k < kHalfKeys / 16; ++k) {
        const uint64_t probs_at = descriptor_at(probs_descriptor, (2 * half + k) * 32);
        wgmma_m64nk16_ss<kHalfChannels / 2, true>(o_left, probs_at,
                                                  descriptor_at(values_at, k * 16 * 128), 1);
        wgmma_m64nk16_ss<kHalfChannels / 2, true>(
            o_right, probs_at, descriptor_at(values_at, 2 * L::kHalfBoxBytes + k * 16 * 128), 1);
      }
      wgmma_commit();
    }
  }
  wgmma_wait<0>();
  wgmma_fence_registers(o);

  // Q's bytes are free (every S is done: each warpgroup waited for its last before barrier 1):
  // the exchange of the rows' sums.
  store_rows<Content::kPairSpan>(p, item, run, max0, max1, sum0, sum1, o,
                                 reinterpret_cast<float*>(base_bytes));
}

}  // namespace quantmla::gpu
