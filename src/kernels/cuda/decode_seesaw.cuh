// The warpgroup decode kernel's schedule for a BF16 cache ("seesaw", after FlashMLA's write-up of
// its dense decode kernel): the same work items, 64 query rows and a softmax step per page as
// decode_warpgroup.cuh's page schedule, but the two warpgroups no longer do the same thing at the
// same time. Pages go in pairs (a, b) from each run's first: warpgroup 0 computes S = Q K^T of
// page a over all 64 keys (m64n64, so Q is read once a page from shared memory, where the page
// schedule read it twice over 32 keys each) and its softmax while warpgroup 1 computes S of page
// b, and each keeps O over its own 256 channels. So the tensor cores have one warpgroup's
// products to run while the other runs its softmax.
//
// Per pair, in order of the softmax steps:
//   warpgroup 0: softmax of page a against the running maximum m (-> m_a, P_a), publishes m_a;
//     O_L = O_L 2^(m - m_a) + P_a V_a,L (P from registers); with m_b from warpgroup 1, P_a
//     2^(m_a - m_b) rounded into shared memory; O_L = O_L 2^(m_a - m_b) + P_b V_b,L (P_b from
//     shared memory).
//   warpgroup 1: with m_a, softmax of page b (-> m_b, P_b), publishes m_b; O_R = O_R 2^(m - m_b)
//     + P_b V_b,R (P from registers); P_b into shared memory; O_R += P_a 2^(m_a - m_b) V_a,R.
// P is rounded to BF16 against the running maximum after its page, as in the page schedule,
// except the right half's P of a pair's first page, rounded after its rescale to the pair's
// second maximum: so warpgroup 1 never waits between its two products, and page b's right values
// are free early (MlaDecodePlan::Operands::kBf16TileScaledPairs, which test_gpu_mla's reference
// follows).
// Shared memory: Q (its RoPE box moved to registers once, whose place then holds P_b), one tile a
// page of the pair (nine boxes of 64 channels, each completing on its own barrier), P_a. There is
// no third tile: each box is copied again for the next pair as soon as its last reader is done
// (boxes 0-3 of a page are the left values, 4-7 the right, 8 the RoPE keys only S reads), by the
// warpgroup that read it last, and the next S reads the boxes in the order they come free.
// Named barriers (one warpgroup arrives, the other waits) carry m_a, P_a, m_b, P_b across.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/decode_warpgroup.cuh"

namespace quantmla::gpu {

struct SeesawLayout {
  static constexpr int kThreads = 256;  // two warpgroups
  static constexpr int kRows = kWarpgroupRows;
  static constexpr int kBoxes = kKeyDim / 64;  // of 64 channels: 8 of content, 1 of RoPE
  static constexpr int kRopeBox = kBoxes - 1;
  static constexpr int kBoxBytes = 64 * 128;  // 64 rows of 64 BF16 channels
  static constexpr int kTileBytes = kBoxes * kBoxBytes;
  // From the 1024-byte-aligned base: Q's boxes, its RoPE box's place then holding P_b; the two
  // page tiles; P_a; the exchange of maxima and sums; the barriers (Q's, then one a box a tile).
  static constexpr int kOddProbOffset = kRopeBox * kBoxBytes;
  static constexpr int kTileOffset = kBoxes * kBoxBytes;
  static constexpr int kEvenProbOffset = kTileOffset + 2 * kTileBytes;
  static constexpr int kExchangeOffset = kEvenProbOffset + kBoxBytes;
  static constexpr int kExchangeBytes = 4 * kRows * 4;  // [m_a, m_b, sums of two warpgroups][row]
  static constexpr int kBarrierOffset = kExchangeOffset + kExchangeBytes;
  static constexpr int kBarriers = 1 + 2 * kBoxes;
  static constexpr int kSharedBytes = 1024 + kBarrierOffset + kBarriers * 8;
  static_assert(kSharedBytes <= kSharedLimit, "Q, two page tiles and two P boxes fit");
  static_assert(kTileOffset % 1024 == 0 && kEvenProbOffset % 1024 == 0 &&
                    kOddProbOffset % 1024 == 0,
                "swizzled boxes on 1024-byte atoms");
  static_assert(kLatentDim / 64 == 8 && kRows == 64 && kPageTokens == 64,
                "four value boxes a warpgroup; a page is one box of keys and one k-block of P");
};

namespace seesaw_detail {

using warpgroup_detail::rescale_between;
using L = SeesawLayout;
constexpr int kScoreRegs = kPageTokens / 2;  // m64n64's accumulators a thread
// Named barriers: one warpgroup arrives, the other waits (warpgroup_detail::kStoreBarrier is 7).
constexpr int kEvenMaxReady = 1, kEvenProbsReady = 2, kOddMaxReady = 3, kOddProbsReady = 4;
constexpr int kFirstWarpgroupOnly = 5, kSecondWarpgroupOnly = 6;

// The online softmax of one page's scores (this thread's accumulators of rows r0 and r1, m64n64)
// against the running maxima max_in: keys past a row's last one (when `masked`) are -inf; returns
// the maxima after the page in max_out and the factor 2^(max_in - max_out) of what came before in
// rescale, rescales sum0 / sum1 by it and adds the unrounded P; P rounded to BF16 as the A
// fragments of P V (probs[k]: keys 16 k to 16 k + 15), and unrounded in sc. The maxima are those
// of the raw scores times the scale (the scaled scores' maxima: rounding keeps the order of the
// products with a positive scale), so that P takes one FFMA and one exp2 an element.
__device__ __forceinline__ void page_softmax(float (&sc)[kScoreRegs], int key0, bool masked,
                                             int last0, int last1, float scale_log2, float max_in0,
                                             float max_in1, float& max_out0, float& max_out1,
                                             float& rescale0, float& rescale1, float& sum0,
                                             float& sum1, uint32_t (&probs)[4][4]) {
  const int t4 = threadIdx.x % 4;
  if (masked) warpgroup_detail::mask_scores(sc, key0 + 2 * t4, last0, last1);
  float page_max0, page_max1;
  warpgroup_detail::scaled_row_maxima(sc, scale_log2, page_max0, page_max1);
  max_out0 = fmaxf(max_in0, page_max0);
  max_out1 = fmaxf(max_in1, page_max1);
  const float base0 = warpgroup_detail::softmax_base(max_out0);
  const float base1 = warpgroup_detail::softmax_base(max_out1);
  rescale0 = exp2f(max_in0 - base0), rescale1 = exp2f(max_in1 - base1);
  sum0 *= rescale0, sum1 *= rescale1;
#pragma unroll
  for (int j = 0; j < kScoreRegs / 4; ++j) {
    const float p0 = exp2_flushed(fmaf(sc[4 * j], scale_log2, -base0));
    const float p1 = exp2_flushed(fmaf(sc[4 * j + 1], scale_log2, -base0));
    const float p2 = exp2_flushed(fmaf(sc[4 * j + 2], scale_log2, -base1));
    const float p3 = exp2_flushed(fmaf(sc[4 * j + 3], scale_log2, -base1));
    sum0 += p0 + p1;
    sum1 += p2 + p3;
    sc[4 * j] = p0, sc[4 * j + 1] = p1, sc[4 * j + 2] = p2, sc[4 * j + 3] = p3;
    probs[j / 2][(j % 2) * 2] = bf16x2_bits(__floats2bfloat162_rn(p0, p1));
    probs[j / 2][(j % 2) * 2 + 1] = bf16x2_bits(__floats2bfloat162_rn(p2, p3));
  }
}

// P (the A fragments of this thread's rows r0, r1) into a 64 x 64 box, K-major, for the other
// warpgroup's product.
__device__ __forceinline__ void store_probs(uint8_t* box, const uint32_t (&probs)[4][4], int r0,
                                            int r1) {
  const int t4 = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < kScoreRegs / 4; ++j) {
    const int column = 8 * j + 2 * t4;
    *reinterpret_cast<uint32_t*>(box + tma_box_offset(r0, column)) = probs[j / 2][(j % 2) * 2];
    *reinterpret_cast<uint32_t*>(box + tma_box_offset(r1, column)) = probs[j / 2][(j % 2) * 2 + 1];
  }
}

// P in FP32 (sc) times a factor per row (scale0 for r0, scale1 for r1) rounded to BF16 into a
// 64 x 64 box as above.
__device__ __forceinline__ void store_probs(uint8_t* box, const float (&sc)[kScoreRegs],
                                            float scale0, float scale1, int r0, int r1) {
  const int t4 = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < kScoreRegs / 4; ++j) {
    const int column = 8 * j + 2 * t4;
    *reinterpret_cast<uint32_t*>(box + tma_box_offset(r0, column)) =
        bf16x2_bits(__floats2bfloat162_rn(sc[4 * j] * scale0, sc[4 * j + 1] * scale0));
    *reinterpret_cast<uint32_t*>(box + tma_box_offset(r1, column)) =
        bf16x2_bits(__floats2bfloat162_rn(sc[4 * j + 2] * scale1, sc[4 * j + 3] * scale1));
  }
}

// Rows [valid, 64) of a page tile's value boxes as zeros (a sequence's last page: the records past
// its end hold arbitrary pool bytes, and NaN would survive a probability of 0 in P V), by the 128
// threads of one warpgroup, visible to the tensor cores' reads afterwards.
__device__ __forceinline__ void zero_tail_values(uint8_t* tile, int valid) {
  const int chunks = (kPageTokens - valid) * L::kRopeBox * 8;
  for (int u = threadIdx.x % 128; u < chunks; u += 128) {
    const int row = valid + u / (L::kRopeBox * 8), rest = u % (L::kRopeBox * 8);
    *reinterpret_cast<uint4*>(tile + (rest / 8) * L::kBoxBytes + row * 128 + (rest % 8) * 16) =
        make_uint4(0u, 0u, 0u, 0u);
  }
  fence_proxy_async_shared();
}

// O (+)= P V over a page's 64 keys and this warpgroup's 256 channels (`values`: the descriptor of
// the first of its four value boxes of the page tile, read untransposed as an MN-major operand),
// committed as one group; P from the registers (this warpgroup's page) or from a 64 x 64 box in
// shared memory (the other's, `probs`: its descriptor).
__device__ __forceinline__ void issue_values(float (&o)[warpgroup_detail::kOutputRegs],
                                             const uint32_t (&probs)[4][4], uint64_t values) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kPageTokens / 16; ++k) {
    wgmma_m64k16_rs<kLatentDim / 2, true>(o, probs[k], descriptor_at(values, k * 16 * 128), 1);
  }
  wgmma_commit();
}
__device__ __forceinline__ void issue_values(float (&o)[warpgroup_detail::kOutputRegs],
                                             uint64_t probs, uint64_t values) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kPageTokens / 16; ++k) {
    wgmma_m64nk16_ss<kLatentDim / 2, true>(o, descriptor_at(probs, k * 32),
                                           descriptor_at(values, k * 16 * 128), 1);
  }
  wgmma_commit();
}

// S (+)= Q K^T over the boxes [kFirst, kEnd) of a page tile (`page_tile`: its descriptor, its
// boxes' barriers at `full`, this pair's phase `parity`), waiting for each box's copy: Q's content
// boxes from shared memory (`q_tile`: their descriptor), its RoPE box from the registers (whose
// first product overwrites S).
template <int kFirst, int kEnd>
__device__ __forceinline__ void issue_scores(float (&sc)[kScoreRegs],
                                             const uint32_t (&q_rope)[4][4], uint64_t q_tile,
                                             uint64_t page_tile, uint64_t* full, uint32_t parity) {
  wgmma_fence();
#pragma unroll
  for (int b = kFirst; b < kEnd; ++b) {
    mbarrier_wait(&full[b], parity);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t column = b * L::kBoxBytes + k * 32;
      if (b == L::kRopeBox) {
        wgmma_m64k16_rs<kPageTokens>(sc, q_rope[k], descriptor_at(page_tile, column), k > 0);
      } else {
        wgmma_m64nk16_ss<kPageTokens>(sc, descriptor_at(q_tile, column),
                                      descriptor_at(page_tile, column), 1);
      }
    }
  }
  wgmma_commit();
}

}  // namespace seesaw_detail

// kPrefetchL2: page i + 2 of the run requested into L2 with page i's first copy (the launch
// chooses it by the plan's runs: kSeesawL2PrefetchMinPages).
template <class Content, class Rope, bool kPrefetchL2>
__global__ void __launch_bounds__(256, 1)
    mla_decode_seesaw_kernel(const __grid_constant__ DecodeKernelParams p,
                             const __grid_constant__ CUtensorMap q_map,
                             const __grid_constant__ CUtensorMap pool_map) {
  using namespace seesaw_detail;
  using warpgroup_detail::BlockRun;
  using warpgroup_detail::kOutputRegs;
  static_assert(Content::kIsBf16 && Rope::kIsBf16, "pages copied as tiles: a BF16 cache only");
  wait_for_previous_kernel();
  const WorkItem item = p.items[blockIdx.x];
  if (item.batch < 0) return;  // padding of a fixed grid (a plan in a workspace)

  extern __shared__ __align__(16) uint8_t shared_raw[];
  const uint32_t base = swizzle_base(shared_raw);
  uint8_t* const base_bytes = shared_raw + (base - shared_address(shared_raw));
  const auto tile = [&](int t) {
    return base + static_cast<uint32_t>(L::kTileOffset + t * L::kTileBytes);
  };
  const auto tile_bytes = [&](int t) { return base_bytes + L::kTileOffset + t * L::kTileBytes; };
  float* const even_max = reinterpret_cast<float*>(base_bytes + L::kExchangeOffset);  // [64]
  float* const odd_max = even_max + L::kRows;                                         // [64]
  float* const sum_exchange = odd_max + L::kRows;                                     // [2][64]
  uint64_t* const q_full = reinterpret_cast<uint64_t*>(base_bytes + L::kBarrierOffset);
  uint64_t* const box_full = q_full + 1;  // [2][kBoxes]

  const BlockRun run = warpgroup_detail::block_run(p, item);

  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int b = 0; b < 2 * L::kBoxes; ++b) mbarrier_init(&box_full[b], 1);
    fence_barrier_init();
  }
  __syncthreads();
  // Boxes [first, end) of page i (of the run) into its tile, i % 2 (one thread); with kPrefetchL2
  // and the copy that ends at the last box (the whole page in the prologue, its RoPE box in the
  // loop, each the page's first), page i + 2 into L2: with no third tile, a page's copies go out
  // only a few products before S reads them, so without it S waits for DRAM.
  const auto load_boxes = [&](int i, int first, int end) {
    const int t = i % 2, first_record = run.pages[i] * kPageTokens;
    for (int b = first; b < end; ++b) {
      uint64_t* const full = &box_full[t * L::kBoxes + b];
      mbarrier_arrive_expect_bytes(full, L::kBoxBytes);
      tma_load_2d(tile(t) + b * L::kBoxBytes, &pool_map, 64 * b, first_record, full);
    }
    if constexpr (kPrefetchL2) {
      if (end == L::kBoxes && i + 2 < run.num_pages) {
        const uint32_t page_bytes = kPageTokens * static_cast<uint32_t>(p.record_bytes);
        bulk_prefetch_l2(p.pool + static_cast<int64_t>(run.pages[i + 2]) * page_bytes, page_bytes);
      }
    }
  };
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_bytes(q_full, L::kTileBytes);
    const int q_row = item.batch * run.rows_per_seq + run.first_row;
    for (int b = 0; b < L::kBoxes; ++b) {
      tma_load_2d(base + b * L::kBoxBytes, &q_map, 64 * b, q_row, q_full);
    }
    for (int i = 0; i < 2 && i < run.num_pages; ++i) load_boxes(i, 0, L::kBoxes);
  }
  __syncwarp();  // warp 0 converged again for the warpgroup instructions

  // The warpgroup as a value the compiler knows to be the same in a warp (a shuffle): wgmma under
  // a branch it takes for divergent would be serialized (ptxas C7520).
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int r0 = run.r0, r1 = run.r1;
  // Q's RoPE box as the A fragments of S's last four k-steps (the same in both warpgroups), read
  // before its place becomes P_b's.
  uint32_t q_rope[4][4];
  mbarrier_wait(q_full, 0);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    ldmatrix_x4(q_rope[k], base + L::kRopeBox * L::kBoxBytes +
                               swizzled_chunk_offset(16 * warp + lane % 16, 2 * k + lane / 16));
  }
  __syncthreads();

  // Boxes [first, end) of page i copied again (when `when`) by the first thread of the warpgroup
  // that read them last; its warp converged again for the warpgroup instructions.
  const auto copy_boxes = [&](bool when, int i, int first, int end) {
    if (when && threadIdx.x % 128 == 0) load_boxes(i, first, end);
    __syncwarp();
  };
  float o[kOutputRegs] = {};  // this warpgroup's 256 channels
  float sc[kScoreRegs] = {};  // S of this warpgroup's page of the pair, then its P in FP32
  uint32_t probs[4][4];       // that P in BF16, A fragments
  float max0 = -INFINITY, max1 = -INFINITY;  // the running maxima after the last page
  float sum0 = 0.0f, sum1 = 0.0f;            // this warpgroup's pages' P, this thread's keys
  // The products' operands, as descriptors made once: Q's content boxes, each page tile of the
  // pair, this warpgroup's four value boxes of each, the two P boxes.
  const uint64_t q_descriptor = wgmma_descriptor(base);
  const uint64_t first_tile = wgmma_descriptor(tile(0));  // the second L::kTileBytes on
  const uint32_t values = warpgroup * (kLatentDim / 128) * L::kBoxBytes;  // its 4 value boxes
  const uint64_t value_descriptors[2] = {wgmma_descriptor_mn(tile(0) + values, L::kBoxBytes),
                                         wgmma_descriptor_mn(tile(1) + values, L::kBoxBytes)};
  const uint64_t even_probs = wgmma_descriptor(base + L::kEvenProbOffset);
  const uint64_t odd_probs = wgmma_descriptor(base + L::kOddProbOffset);
  // S of page i (this warpgroup's of its pair) over the boxes [kFirst, kEnd).
  const auto scores = [&]<int kFirst, int kEnd>(int i) {
    issue_scores<kFirst, kEnd>(sc, q_rope, q_descriptor,
                               descriptor_at(first_tile, (i % 2) * L::kTileBytes),
                               &box_full[(i % 2) * L::kBoxes], static_cast<uint32_t>((i / 2) & 1));
  };
  // The first pair's S; every S takes the boxes in the order of their copies for the next pair:
  // the RoPE box first (its first product overwrites the accumulators), then the left values,
  // then the right.
  if (warpgroup < run.num_pages) {
    scores.template operator()<L::kRopeBox, L::kBoxes>(warpgroup);
    scores.template operator()<0, L::kRopeBox>(warpgroup);
  }
  wgmma_wait<0>();
  wgmma_fence_registers(sc);

  for (int a = 0; a < run.num_pages; a += 2) {
    const int b = a + 1;
    const bool has_b = b < run.num_pages, has_next = a + 2 < run.num_pages,
               has_next_b = b + 2 < run.num_pages;
    const int key_a = (item.page_begin + a) * kPageTokens, key_b = key_a + kPageTokens;
    const int valid_a = run.seq_len - key_a, valid_b = run.seq_len - key_b;
    if (warpgroup == 0) {
      // Page a's softmax; m_a to warpgroup 1 (with page a's tail as zeros: its P V reads them).
      float max_a0, max_a1, scale_a0, scale_a1;
      page_softmax(sc, key_a, key_a + kPageTokens - 1 > run.block_last, run.last0, run.last1,
                   p.scale_log2, max0, max1, max_a0, max_a1, scale_a0, scale_a1, sum0, sum1, probs);
      if (lane % 4 == 0) even_max[r0] = max_a0, even_max[r1] = max_a1;
      if (valid_a < kPageTokens) {
        zero_tail_values(tile_bytes(0), valid_a);
        named_barrier(kFirstWarpgroupOnly, 128);
      }
      named_barrier_arrive(kEvenMaxReady, L::kThreads);
      copy_boxes(has_next, a + 2, L::kRopeBox, L::kBoxes);  // S(a) is done
      // O_L to m_a, then P_a V_a,L (P from the registers).
      warpgroup_detail::rescale_output(o, scale_a0, scale_a1);
      issue_values(o, probs, value_descriptors[0]);
      // m_b from warpgroup 1: P_a for its half rescaled to m_b, then rounded.
      named_barrier(kOddMaxReady, L::kThreads);
      const float max_b0 = odd_max[r0], max_b1 = odd_max[r1];
      const float scale_b0 = rescale_between(max_a0, max_b0);
      const float scale_b1 = rescale_between(max_a1, max_b1);
      store_probs(base_bytes + L::kEvenProbOffset, sc, scale_b0, scale_b1, r0, r1);
      fence_proxy_async_shared();
      named_barrier_arrive(kEvenProbsReady, L::kThreads);
      wgmma_wait<0>();
      wgmma_fence_registers(o);
      copy_boxes(has_next, a + 2, 0, L::kRopeBox / 2);  // P_a V_a,L is done
      // O_L to m_b, then P_b V_b,L (P_b from warpgroup 1); the next page a's S behind it, page
      // b's left values copied again once P_b V_b,L is done.
      max0 = max_b0, max1 = max_b1;
      sum0 *= scale_b0, sum1 *= scale_b1;
      warpgroup_detail::rescale_output(o, scale_b0, scale_b1);
      if (has_b) {
        named_barrier(kOddProbsReady, L::kThreads);
        issue_values(o, odd_probs, value_descriptors[1]);
      }
      if (has_next) scores.template operator()<L::kRopeBox, L::kBoxes>(a + 2);
      if (has_b) {
        if (has_next) {
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        wgmma_fence_registers(o);
        copy_boxes(has_next_b, b + 2, 0, L::kRopeBox / 2);
      }
      if (has_next) scores.template operator()<0, L::kRopeBox>(a + 2);
      wgmma_wait<0>();  // in each branch: no product in flight where the two join (ptxas C7515)
      wgmma_fence_registers(sc);
      wgmma_fence_registers(o);
    } else {
      // m_a from warpgroup 0; page b's softmax against it; m_b to warpgroup 0.
      named_barrier(kEvenMaxReady, L::kThreads);
      const float max_a0 = even_max[r0], max_a1 = even_max[r1];
      const float scale_a0 = rescale_between(max0, max_a0);
      const float scale_a1 = rescale_between(max1, max_a1);
      sum0 *= scale_a0, sum1 *= scale_a1;
      float max_b0 = max_a0, max_b1 = max_a1, scale_b0 = 1.0f, scale_b1 = 1.0f;
      if (has_b) {
        page_softmax(sc, key_b, key_b + kPageTokens - 1 > run.block_last, run.last0, run.last1,
                     p.scale_log2, max_a0, max_a1, max_b0, max_b1, scale_b0, scale_b1, sum0, sum1,
                     probs);
      }
      if (lane % 4 == 0) odd_max[r0] = max_b0, odd_max[r1] = max_b1;
      if (has_b && valid_b < kPageTokens) {
        zero_tail_values(tile_bytes(1), valid_b);
        named_barrier(kSecondWarpgroupOnly, 128);
      }
      named_barrier_arrive(kOddMaxReady, L::kThreads);
      copy_boxes(has_next_b, b + 2, L::kRopeBox, L::kBoxes);  // S(b) is done
      max0 = max_b0, max1 = max_b1;
      // O_R to m_b (through m_a), then P_b V_b,R (P from the registers), P_b to warpgroup 0.
      warpgroup_detail::rescale_output(o, scale_a0 * scale_b0, scale_a1 * scale_b1);
      // Then P_a V_a,R (P_a from warpgroup 0, rescaled to m_b) queued behind it, so that the
      // tensor cores have this warpgroup's second product before its first is done; page b's
      // right values copied again once the first is done, the next page b's S behind the second,
      // page a's right values copied again once the second is done.
      if (has_b) {
        issue_values(o, probs, value_descriptors[1]);
        store_probs(base_bytes + L::kOddProbOffset, probs, r0, r1);
        fence_proxy_async_shared();
        named_barrier_arrive(kOddProbsReady, L::kThreads);
        named_barrier(kEvenProbsReady, L::kThreads);
        issue_values(o, even_probs, value_descriptors[0]);
        wgmma_wait<1>();
        copy_boxes(has_next_b, b + 2, L::kRopeBox / 2, L::kRopeBox);
      } else {
        named_barrier(kEvenProbsReady, L::kThreads);
        issue_values(o, even_probs, value_descriptors[0]);
      }
      if (has_next_b) {
        scores.template operator()<L::kRopeBox, L::kBoxes>(b + 2);
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      wgmma_fence_registers(o);
      copy_boxes(has_next, a + 2, L::kRopeBox / 2, L::kRopeBox);
      if (has_next_b) scores.template operator()<0, L::kRopeBox>(b + 2);
      wgmma_wait<0>();
      wgmma_fence_registers(sc);
      wgmma_fence_registers(o);
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_fence_registers(probs[k]);
    }
  }
  warpgroup_detail::store_rows<1>(p, item, run, max0, max1, sum0, sum1, o, sum_exchange);
}

}  // namespace quantmla::gpu
