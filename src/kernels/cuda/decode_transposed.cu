// The transposed decode kernel: few heads (16 or 32 query rows a block), both products on the
// warpgroup MMA with the page's keys and channels as its M, so that wgmma's 64 rows carry no
// padding where the tiled kernel's mma.sync tiles and the warpgroup kernel's 64 query rows would
// (docs/gpu-kernels.md). A BF16 cache's pages are copied as the tiles the products read; the
// int4-content formats' (the converting form) are copied raw and dequantized into one tile.
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
// The converting form (int4 and int2 content, either RoPE format) is for few sequences, where the
// tiled kernel's chain of mma.sync steps costs ~2.8 us a page against ~1 us here for a BF16 page
// (docs/benchmarks.md, batch 1): the producer bulk-copies each page's records raw into two
// stages; step 1 takes its A operand (the keys) from registers, each thread converting its two
// keys' columns of each box straight from the raw records with the tile decoders' arithmetic
// (key_fragments: the same BF16 values, in tile column order, so Q's columns are permuted to that
// order once and the output's back at the end) and storing the content's into a tile of the
// values for step 3; records past the sequence's end zeroed in the raw stage first. Its 16-row
// blocks have two consuming warpgroups (warps 0-7, the producer warp 8), each with a values tile,
// a P^T and an online-softmax chain of its own over every other page of the run (page i in raw
// stage i % 2, warpgroup i % 2), so that one converts a page while the other's products run; at
// the end the second hands its accumulators, maxima and sums to the first through its tile, which
// merges them as the combine merges runs (MlaDecodePlan::Block::chains, which test_gpu_mla's
// reference follows). The two-tile form has no room for a second tile and keeps one warpgroup.
#include <cuda_bf16.h>

#include <string>
#include <type_traits>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/decode_kernels.h"
#include "kernels/cuda/decode_transposed.h"
#include "kernels/cuda/decode_warpgroup.cuh"
#include "kernels/cuda/fragment_maps.h"
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
template <class ContentType, class RopeType, int kRowTiles>
struct TransposedLayout {
  static_assert(kRowTiles == 1 || kRowTiles == 2);
  using Content = ContentType;
  using Rope = RopeType;
  static constexpr bool kDirect = Content::kIsBf16 && Rope::kIsBf16;  // pages copied as tiles
  // The consuming warpgroups, each its own online-softmax chain over every kWarpgroups-th page
  // of the block (transposed_chains: two in the converting form's 16-row blocks).
  static constexpr int kWarpgroups = transposed_chains(kDirect, kRowTiles);
  static constexpr int kConsumers = 128 * kWarpgroups;
  static constexpr int kThreads = kConsumers + 32;  // and a producer warp
  static constexpr int kRows = 16 * kRowTiles;      // query rows a block: wgmma's N
  static constexpr int kNTiles = kRows / 8;         // of the accumulators, as mma.m16n8's
  static constexpr int kBoxes = kKeyDim / 64;       // of 64 channels: 8 of content, 1 of RoPE
  static constexpr int kValueBoxes = kLatentDim / 64;
  static constexpr int kBoxBytes = kPageTokens * 128;  // a page's 64 keys x 64 channels
  static constexpr int kTileBytes = kBoxes * kBoxBytes;
  // The converting form's tile a warpgroup: the values alone (its keys' scores take their
  // operands from registers).
  static constexpr int kValueTileBytes = kValueBoxes * kBoxBytes;
  // A page's records as they are stored (the converting form's stages).
  static constexpr int kRawPageBytes =
      (kPageTokens * (Content::kBytes + Rope::kMaxBytes) + 127) / 128 * 128;
  static constexpr int kStages = 2;
  static constexpr int kStageBytes = kDirect ? kTileBytes : kRawPageBytes;
  static constexpr int kQueryBlockBytes = kRows * 128;  // Q's 16 rows x 64 channels
  // From the 1024-byte-aligned base: the tiles (the stages, or the converting form's tile a
  // warpgroup), Q's tile, P^T a warpgroup, the converting form's raw stages, the exchange a
  // warpgroup, the barriers.
  static constexpr int kQueryOffset =
      kDirect ? kStages * kTileBytes : kWarpgroups * kValueTileBytes;
  static constexpr int kProbOffset = kQueryOffset + kBoxes * kQueryBlockBytes;
  static constexpr int kRawOffset =  // P^T: kRows x 64 keys
      kProbOffset + kWarpgroups * kQueryBlockBytes;
  static constexpr int kExchangeOffset = kRawOffset + (kDirect ? 0 : kStages * kRawPageBytes);
  static constexpr int kExchangeBytes = 4 * kRows * 4;  // [warp][row] FP32, a warpgroup's
  static constexpr int kBarrierOffset = kExchangeOffset + kWarpgroups * kExchangeBytes;
  static constexpr int kSharedBytes = 1024 + kBarrierOffset + 2 * kStages * 8;
  static_assert(kSharedBytes <= kSharedLimit, "the page stages, Q and P^T fit");
  static_assert(kTileBytes % 1024 == 0 && kQueryOffset % 1024 == 0 && kProbOffset % 1024 == 0 &&
                    kQueryBlockBytes % 1024 == 0 && kRawOffset % 128 == 0,
                "swizzled boxes on 1024-byte atoms, raw stages on 128 bytes");
  static_assert(kPageTokens == kTransposedStepKeys && kPageTokens == 64,
                "a page is wgmma's M of the scores and a softmax step");
  static_assert(kWarpgroups == 1 || (kStages == kWarpgroups && !kDirect),
                "a warpgroup's pages always in its own raw stage");
  // The second warpgroup's state handed to the first at the end, through its tile.
  static_assert(kWarpgroups == 1 ||
                    128 * (kValueBoxes * kNTiles * 4 + 4 * kNTiles) * 4 <= kValueTileBytes,
                "a warpgroup's accumulators, maxima and sums fit a tile");
  // Named barriers: 1 every consumer (Q's tile, the merge), 2 + w warpgroup w's (kWarpgroups == 1:
  // both 1).
  static constexpr int kConsumersBarrier = 1;
  static constexpr int warpgroup_barrier(int w) { return kWarpgroups == 1 ? 1 : 2 + w; }
};
constexpr int kWarpgroupThreads = 128;

// Q's kRows rows of the block (BF16, [kRows][kKeyDim] from `q`) into the tile at `tile` (nine
// column blocks of kRows rows, 128-byte swizzle, K-major: wgmma's B operand), by the consumers.
// The converting form's tile holds its keys in tile column order (record_formats.cuh), so there
// the content's boxes take the order of Content::kPairSpan and the RoPE key's of Rope::kPairSpan,
// each thread a group of 2 span columns (at least 8) of a row; a BF16 cache's are in channel order.
template <class L>
__device__ __forceinline__ void copy_query(const uint16_t* q, uint8_t* tile) {
  if constexpr (L::kDirect) {
    for (int c = threadIdx.x; c < L::kBoxes * L::kRows * 8; c += L::kConsumers) {
      const int row = c % L::kRows, chunk = c / L::kRows % 8, box = c / L::kRows / 8;
      *reinterpret_cast<uint4*>(tile + box * L::kQueryBlockBytes +
                                swizzled_chunk_offset(row, chunk)) =
          *reinterpret_cast<const uint4*>(q + row * kKeyDim + 64 * box + 8 * chunk);
    }
  } else {
    const auto copy_boxes = [&](auto span_constant, int first_box, int boxes) {
      constexpr int kSpan = decltype(span_constant)::value;
      // A group: the columns a channel pair spreads over, at least a 16-byte chunk (span 1, a
      // BF16 RoPE key: the identity order, copied a chunk at a time).
      constexpr int kGroup = 2 * kSpan > 8 ? 2 * kSpan : 8, kGroupsPerBox = 64 / kGroup;
      for (int task = threadIdx.x; task < L::kRows * boxes * kGroupsPerBox; task += L::kConsumers) {
        const int row = task % L::kRows, group = task / L::kRows % kGroupsPerBox;
        const int box = first_box + task / L::kRows / kGroupsPerBox;
        const uint16_t* const from = q + row * kKeyDim + 64 * box + kGroup * group;
#pragma unroll
        for (int k = 0; k < kGroup / 8; ++k) {
          uint32_t words[4];
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            words[w] = static_cast<uint32_t>(from[channel_of_column<kSpan>(8 * k + 2 * w)]) |
                       static_cast<uint32_t>(from[channel_of_column<kSpan>(8 * k + 2 * w + 1)])
                           << 16;
          }
          *reinterpret_cast<uint4*>(tile + box * L::kQueryBlockBytes +
                                    tma_box_offset(row, kGroup * group + 8 * k)) =
              make_uint4(words[0], words[1], words[2], words[3]);
        }
      }
    };
    copy_boxes(std::integral_constant<int, L::Content::kPairSpan>{}, 0, L::kValueBoxes);
    copy_boxes(std::integral_constant<int, L::Rope::kPairSpan>{}, L::kValueBoxes, 1);
  }
}

// The converting form: records [valid, 64) of a raw page (kPageTokens records of p.record_bytes
// at `raw`) as zeros, by one warpgroup (thread `wtid`, `barrier` its named barrier): their pool
// bytes are arbitrary, and NaN would survive a probability of 0 in P V, while every supported
// format decodes a zero record to zeros.
__device__ __forceinline__ void zero_tail_records(uint8_t* raw, int valid, int wtid, int barrier,
                                                  const DecodeKernelParams& p) {
  const int first = max(valid, 0) * p.record_bytes;
  const int words = (kPageTokens * p.record_bytes - first) / 4;
#pragma unroll 1  // a sequence's last page only: kept short
  for (int i = wtid; i < words; i += kWarpgroupThreads) store_u32(raw + first + 4 * i, 0u);
  named_barrier(barrier, kWarpgroupThreads);
}

// The BF16 pair of codes (bits 0 and 16 of `codes` shifted right by `shift`, kBits wide) as the
// tile decoders give it: code * scale + min.
template <int kBits>
__device__ __forceinline__ uint32_t code_pair(uint32_t codes, int shift, __nv_bfloat162 scale,
                                              __nv_bfloat162 minimum) {
  return dequantize_biased_pair(biased_codes(codes >> shift, kBits == 4 ? kInt4Pair : kInt2Pair),
                                scale, minimum);
}

// The converting form's A operand of S^T for box b (content chunk b < kValueBoxes, the RoPE key
// last) and the thread's two keys (records `lo` and `hi`: rows g and g + 8 of its warp's 16),
// straight from the raw records: register 2h + k of k-step s (key k) holds the tile columns
// transposed_key_column(s, t, h, 0 and 1) (fragment_maps.h), the values the tile decoders give
// them (int codes: the pair of transposed_key_code_word and _shift; a BF16 RoPE key's columns are
// its channels), kept RoPE pairs patched in.
template <class L>
__device__ __forceinline__ void key_fragments(const uint8_t* lo, const uint8_t* hi, int b, int t,
                                              const DecodeKernelParams& p, uint32_t (&frag)[4][4]) {
  using Content = typename L::Content;
  using Rope = typename L::Rope;
  constexpr int kBits = Content::kCodeBits;
  const uint8_t* const records[2] = {lo, hi};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint8_t* const rec = records[k];
    const uint8_t* const rope = rec + Content::kBytes;
    // Key k's registers from a box of kCodeBits-wide codes at `codes` and its group's {scale,
    // min} word at `scale_min`.
    const auto code_pairs = [&](auto bits_constant, const uint8_t* codes,
                                const uint8_t* scale_min) {
      constexpr int kCodeBits = decltype(bits_constant)::value;
      __nv_bfloat162 scale, minimum;
      load_scale_min(scale_min, scale, minimum);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          frag[s][2 * h + k] =
              code_pair<kCodeBits>(load_u32(codes + 4 * transposed_key_code_word(kCodeBits, s, h)),
                                   transposed_key_code_shift(kCodeBits, t, h), scale, minimum);
        }
      }
    };
    if (b < L::kValueBoxes) {
      code_pairs(std::integral_constant<int, kBits>{}, rec + 8 * kBits * b,
                 rec + Content::kCodeBytes + 4 * (b * 64 / Content::kGroupChannels));
    } else if constexpr (!Rope::kIsBf16) {  // int4 g64, one group
      code_pairs(std::integral_constant<int, 4>{}, rope, rope + Rope::kCodeBytes);
    } else {
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // channel order: the BF16 pair at the columns
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          frag[s][2 * h + k] = load_u32(rope + 2 * transposed_key_column(s, t, h, 0));
        }
      }
    }
  }
  if constexpr (!Rope::kIsBf16) {
    if (b == L::kValueBoxes) {
      // Kept pairs replace their two channels, each in the register half of its column
      // (transposed_key_place), the thread of that column's lane t.
      for (int n = 0; n < p.kept.count; ++n) {
        const uint32_t stored[2] = {Rope::kept_pair(lo + Content::kBytes, n),
                                    Rope::kept_pair(hi + Content::kBytes, n)};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const FragmentPlace place =
              transposed_key_place(column_of_channel<Rope::kPairSpan>(2 * p.kept.pairs[n] + h));
          if (place.t != t) continue;
          const int shift = 16 * place.e;
#pragma unroll
          for (int s = 0; s < 4; ++s) {  // constant indices: frag stays in registers
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const uint32_t value = (stored[r % 2] >> (16 * h)) & 0xffffu;
              const uint32_t patched = (frag[s][r] & ~(0xffffu << shift)) | value << shift;
              frag[s][r] = s == place.s && r / 2 == place.h ? patched : frag[s][r];
            }
          }
        }
      }
    }
  }
}

// Rows [valid, 64) of a stage's value boxes as zeros, by the consumers (one warpgroup: a BF16
// cache's).
template <class L>
__device__ __forceinline__ void zero_tail_values(uint8_t* stage, int valid) {
  static_assert(L::kWarpgroups == 1);
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

// pool_map: the BF16 pool's tensor map (a BF16 cache only; unused by the converting form).
template <class Content, class Rope, int kRowTiles>
__global__ void __launch_bounds__(TransposedLayout<Content, Rope, kRowTiles>::kThreads, 1)
    mla_decode_transposed_kernel(const __grid_constant__ DecodeKernelParams p,
                                 const __grid_constant__ CUtensorMap pool_map) {
  using L = TransposedLayout<Content, Rope, kRowTiles>;
  constexpr int kNTiles = L::kNTiles;
  constexpr int kSpan = Content::kPairSpan;  // the output's channels are tile columns of it
  // With the pool ready (MlaDecodeParams::pool_ready) the producer requests its pages while the
  // previous kernel runs; only the consumers wait, before they read Q.
  if (!p.pool_ready) wait_for_previous_kernel();
  const WorkItem item = p.items[blockIdx.x];
  if (item.batch < 0) return;  // padding of a fixed grid (a plan in a workspace)
  extern __shared__ __align__(16) uint8_t shared_raw[];
  const uint32_t base = swizzle_base(shared_raw);
  uint8_t* const base_bytes = shared_raw + (base - shared_address(shared_raw));
  // Stage s: a page's tile (a BF16 cache) or its raw records (the converting form, whose values
  // tiles, one a warpgroup, are at the base).
  const auto stage = [&](int s) {
    return base + static_cast<uint32_t>((L::kDirect ? 0 : L::kRawOffset) + s * L::kStageBytes);
  };
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  // A consumer's warpgroup, its thread and its warp in it (constants where there is one).
  const int wg = L::kWarpgroups == 1 ? 0 : warp / 4;
  const int wtid = L::kWarpgroups == 1 ? tid : tid % kWarpgroupThreads;
  const int wwarp = L::kWarpgroups == 1 ? warp : warp % 4;
  const uint32_t q_tile = base + L::kQueryOffset;
  const uint32_t probs = base + L::kProbOffset + wg * L::kQueryBlockBytes;
  uint8_t* const probs_bytes = base_bytes + (probs - base);
  float* const exchange =
      reinterpret_cast<float*>(base_bytes + L::kExchangeOffset + wg * L::kExchangeBytes);
  uint64_t* const full = reinterpret_cast<uint64_t*>(base_bytes + L::kBarrierOffset);
  uint64_t* const empty = full + L::kStages;
  const int barrier = L::warpgroup_barrier(wg);

  const int seq_len = p.seq_lens[item.batch];
  const int num_pages = item.page_end - item.page_begin;
  if (tid == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbarrier_init(full + s, 1);
      mbarrier_init(empty + s, kWarpgroupThreads / 32);  // its warpgroup's warps' arrivals
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
        // The stage's page before (i - kStages) released by the warps of the warpgroup that
        // took it.
        if (i >= L::kStages) mbarrier_wait(empty + s, (i / L::kStages - 1) & 1);
        if constexpr (L::kDirect) {
          mbarrier_arrive_expect_bytes(full + s, L::kStageBytes);
          const int first_record = pages[i] * kPageTokens;
          for (int b = 0; b < L::kBoxes; ++b) {
            tma_load_2d(stage(s) + b * L::kBoxBytes, &pool_map, 64 * b, first_record, full + s);
          }
        } else {
          const uint32_t page_bytes = kPageTokens * p.record_bytes;
          mbarrier_arrive_expect_bytes(full + s, page_bytes);
          bulk_copy_to_shared(base_bytes + (stage(s) - base),
                              p.pool + static_cast<int64_t>(pages[i]) * page_bytes, page_bytes,
                              full + s);
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
  const int key_lo = 16 * wwarp + g, key_hi = key_lo + 8;
  float o[L::kValueBoxes][kNTiles][4] = {};            // O^T: [channel block][n-tile][register]
  named_barrier(L::kConsumersBarrier, L::kConsumers);  // Q's tile in place

  // The products' descriptors at their operands' starts, advanced a k-step at a time below.
  const uint64_t query_descriptor = wgmma_descriptor(q_tile);
  const uint64_t probs_descriptor = wgmma_descriptor(probs);
  // Warpgroup wg's pages: i = wg, wg + kWarpgroups, ... of the block's run, page i in stage
  // i % kStages (its own where there are two).
  for (int i = wg; i < num_pages; i += L::kWarpgroups) {
    const int s = i % L::kStages;
    const uint32_t keys = L::kDirect ? stage(s) : base + wg * L::kValueTileBytes;
    const uint64_t keys_descriptor = wgmma_descriptor(keys);  // a BF16 cache's stage
    const uint64_t values_descriptor = wgmma_descriptor_mn(keys, L::kBoxBytes);
    const int key0 = (item.page_begin + i) * kPageTokens;
    mbarrier_wait(full + s, (i / L::kStages) & 1);

    // 1. S^T over the nine boxes of 64 channels, four k-steps each.
    float sc[kNTiles][4];
    if constexpr (L::kDirect) {
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
    } else {
      // The keys' A fragments straight from the raw records, box by box (their registers
      // rewritten once the previous box's products are done), the content boxes' values also
      // stored into the warpgroup's tile for the values' products (the previous page's are done
      // with it: the barrier at the end of the previous step); then the stage back to the
      // producer.
      uint8_t* const raw = base_bytes + (stage(s) - base);
      if (seq_len - key0 < kPageTokens) zero_tail_records(raw, seq_len - key0, wtid, barrier, p);
      const uint8_t* const lo = raw + key_lo * p.record_bytes;
      const uint8_t* const hi = raw + key_hi * p.record_bytes;
      uint8_t* const tile = base_bytes + (keys - base);
      uint32_t frag[4][4];
#pragma unroll
      for (int b = 0; b < L::kBoxes; ++b) {
        if (b >= 1) wgmma_wait<0>();
        key_fragments<L>(lo, hi, b, t, p, frag);
        if (b < L::kValueBoxes) {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int key = r % 2 == 0 ? key_lo : key_hi;
              const int column = transposed_key_column(k, t, r / 2, 0);
              *reinterpret_cast<uint32_t*>(tile + b * L::kBoxBytes + tma_box_offset(key, column)) =
                  frag[k][r];
            }
          }
        }
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          wgmma_m64k16_rs_tiles(sc, frag[k],
                                descriptor_at(query_descriptor, b * L::kQueryBlockBytes + k * 32),
                                b > 0 || k > 0);
        }
        wgmma_commit();
      }
      fence_proxy_async_shared();  // the tile for the tensor cores, the stage for the next copy
      __syncwarp();
      if (lane == 0) mbarrier_arrive(empty + s);
      wgmma_wait<0>();
    }
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
        if (g == 0) exchange[wwarp * L::kRows + 8 * n + 2 * t + e] = page_max;
      }
    }
    named_barrier(barrier, kWarpgroupThreads);
    float alpha[kNTiles][2];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = 8 * n + 2 * t + e;
        float tile_max = exchange[row];
#pragma unroll
        for (int w = 1; w < kWarpgroupThreads / 32; ++w) {
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
    if constexpr (L::kDirect) {  // the converting form's records past the end decode to zeros
      if (valid < kPageTokens) zero_tail_values<L>(base_bytes + s * L::kStageBytes, valid);
    }
    fence_proxy_async_shared();                 // P^T and the zeroed rows, read by the tensor cores
    named_barrier(barrier, kWarpgroupThreads);  // P^T complete; the exchange read

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
    if constexpr (L::kDirect) {
      __syncwarp();
      if (lane == 0) mbarrier_arrive(empty + s);  // this warp is done with the stage
    } else {
      named_barrier(barrier, kWarpgroupThreads);  // every warp done with the tile
    }
  }

  if constexpr (L::kWarpgroups == 2) {
    // The second chain to the first warpgroup, thread for thread (the same rows and keys): its
    // accumulators, maxima and sums through its own tile, which its products are done with; the
    // first merges them at the larger maximum, in FP32, as the combine merges runs.
    constexpr int kValues = L::kValueBoxes * kNTiles * 4;
    float* const handoff = reinterpret_cast<float*>(base_bytes + L::kValueTileBytes);
    const auto at = [&](int k) -> float& { return handoff[k * kWarpgroupThreads + wtid]; };
    if (wg == 1) {
#pragma unroll
      for (int m = 0; m < L::kValueBoxes; ++m) {
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
          for (int r = 0; r < 4; ++r) at((m * kNTiles + n) * 4 + r) = o[m][n][r];
        }
      }
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          at(kValues + 2 * n + e) = row_max[n][e];
          at(kValues + 2 * kNTiles + 2 * n + e) = row_sum[n][e];
        }
      }
      named_barrier_arrive(L::kConsumersBarrier, L::kConsumers);
      return;
    }
    named_barrier(L::kConsumersBarrier, L::kConsumers);
    float own[kNTiles][2], theirs[kNTiles][2];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float their_max = at(kValues + 2 * n + e);
        const float merged = fmaxf(row_max[n][e], their_max);
        own[n][e] = warpgroup_detail::rescale_between(row_max[n][e], merged);
        theirs[n][e] = warpgroup_detail::rescale_between(their_max, merged);
        row_sum[n][e] =
            row_sum[n][e] * own[n][e] + at(kValues + 2 * kNTiles + 2 * n + e) * theirs[n][e];
        row_max[n][e] = merged;
      }
    }
#pragma unroll
    for (int m = 0; m < L::kValueBoxes; ++m) {
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          o[m][n][r] =
              o[m][n][r] * own[n][r % 2] + at((m * kNTiles + n) * 4 + r) * theirs[n][r % 2];
        }
      }
    }
  }

  // Each row's sum over its 8 lanes g and the four warps (the exchange's last readers passed the
  // barrier after P^T), by the first warpgroup.
  float total[kNTiles][2];
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) {
        row_sum[n][e] += __shfl_xor_sync(0xffffffffu, row_sum[n][e], offset);
      }
      if (g == 0) exchange[wwarp * L::kRows + 8 * n + 2 * t + e] = row_sum[n][e];
    }
  }
  named_barrier(barrier, kWarpgroupThreads);
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int local_row = 8 * n + 2 * t + e;
      total[n][e] = exchange[local_row];
#pragma unroll
      for (int w = 1; w < kWarpgroupThreads / 32; ++w)
        total[n][e] += exchange[w * L::kRows + local_row];
    }
  }

  // O^T's register r of n-tile n: tile column 64 m + 16 warp + g (+ 8 for r >= 2) of row 8n + 2t
  // + r % 2, whose channel is the column's in the tile column order of span kSpan (the column
  // itself for a BF16 cache, whose output pointers then start at the thread's `lane_column`).
  const int lane_column = kSpan == 1 ? 16 * wwarp + g : 0;
  const auto channel = [&](int m, int r) {
    if constexpr (kSpan == 1) {
      return 64 * m + (r >= 2 ? 8 : 0);  // the identity
    } else {
      return channel_of_column<kSpan>(64 * m + 16 * wwarp + g + (r >= 2 ? 8 : 0));
    }
  };
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
        uint16_t* const out = p.out + row * kLatentDim + lane_column;
#pragma unroll
        for (int m = 0; m < L::kValueBoxes; ++m) {
          out[channel(m, e)] = __bfloat16_as_ushort(__float2bfloat16_rn(o[m][n][e] * inverse));
          out[channel(m, 2 + e)] =
              __bfloat16_as_ushort(__float2bfloat16_rn(o[m][n][2 + e] * inverse));
        }
        if (wwarp == 0 && g == 0 && p.lse != nullptr) p.lse[row] = lse;
      } else {
        float* const out =
            p.partial_out +
            (static_cast<int64_t>(item.partial) * L::kRows + local_row) * kLatentDim + lane_column;
#pragma unroll
        for (int m = 0; m < L::kValueBoxes; ++m) {
          out[channel(m, e)] = o[m][n][e] * inverse;
          out[channel(m, 2 + e)] = o[m][n][2 + e] * inverse;
        }
        if (wwarp == 0 && g == 0) p.partial_lse[item.partial * L::kRows + local_row] = lse;
      }
    }
  }
}

}  // namespace

template <class Content, class Rope>
void launch_decode_transposed(const DecodeKernelParams& p, int row_tiles, int blocks,
                              cudaStream_t stream) {
  static_assert(kTransposedReads<Content, Rope>, "instantiated for the formats it reads only");
  using L = TransposedLayout<Content, Rope, 1>;
  const int max_record = Content::kBytes + Rope::kMaxBytes;
  const bool records_fit = L::kDirect ? p.record_bytes == max_record
                                      : p.record_bytes <= max_record && p.record_bytes % 4 == 0;
  if (!records_fit) {
    throw InvalidArgument("GPU decode, transposed kernel: records of " +
                          std::to_string(p.record_bytes) + " bytes, the format's " +
                          (L::kDirect ? "are " : "are at most ") + std::to_string(max_record));
  }
  CUtensorMap pool_map{};  // the converting form copies its pages raw
  if constexpr (L::kDirect) {
    // Boxes of 64 channels by a page's 64 records.
    const int box[] = {64, kPageTokens};
    const int64_t pool_dims[] = {kKeyDim, warpgroup_detail::kPoolMapRecords};
    const int64_t strides[] = {kKeyDim};
    pool_map = bf16_tensor_map(p.pool, 2, pool_dims, strides, box);
  }
  const auto launch = [&](auto row_tiles_constant) {
    constexpr int kRowTiles = decltype(row_tiles_constant)::value;
    using Layout = TransposedLayout<Content, Rope, kRowTiles>;
    launch_large_shared<mla_decode_transposed_kernel<Content, Rope, kRowTiles>>(
        blocks, Layout::kThreads, Layout::kSharedBytes, stream, p, pool_map);
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

template void launch_decode_transposed<ContentBf16, RopeBf16>(const DecodeKernelParams&, int, int,
                                                              cudaStream_t);
template void launch_decode_transposed<ContentInt<4, 64>, RopeInt4>(const DecodeKernelParams&, int,
                                                                    int, cudaStream_t);
template void launch_decode_transposed<ContentInt<4, 64>, RopeBf16>(const DecodeKernelParams&, int,
                                                                    int, cudaStream_t);
template void launch_decode_transposed<ContentInt<4, 128>, RopeInt4>(const DecodeKernelParams&, int,
                                                                     int, cudaStream_t);
template void launch_decode_transposed<ContentInt<4, 128>, RopeBf16>(const DecodeKernelParams&, int,
                                                                     int, cudaStream_t);
template void launch_decode_transposed<ContentInt<2, 64>, RopeInt4>(const DecodeKernelParams&, int,
                                                                    int, cudaStream_t);
template void launch_decode_transposed<ContentInt<2, 64>, RopeBf16>(const DecodeKernelParams&, int,
                                                                    int, cudaStream_t);
template void launch_decode_transposed<ContentInt<2, 128>, RopeInt4>(const DecodeKernelParams&, int,
                                                                     int, cudaStream_t);
template void launch_decode_transposed<ContentInt<2, 128>, RopeBf16>(const DecodeKernelParams&, int,
                                                                     int, cudaStream_t);

}  // namespace quantmla::gpu
