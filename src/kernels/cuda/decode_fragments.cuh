// The fragment decode kernel (issue 15's second kernel) for int4 or int2 g64 and fp8 content: the
// tensor cores multiply with the codes themselves, built in registers straight from the raw
// records, with no dequantized tile in shared memory (the tiled kernel's BF16 tile cost more
// shared-memory traffic a page than the whole budget of a 3x speed-up: docs/gpu-kernels.md), and
// each group's scale and minimum are applied where they cost least: to the scores' partial sums and
// to P.
//
// One block per WorkItem of 16 query rows. Warp 4 is the producer: its lane 0 streams whole pages
// (64 records) into a ring of shared-memory stages with bulk copies that complete on a barrier per
// stage, and refills a stage when the consumers have freed it. Once a page has landed, the
// producer's lanes zero the records past the sequence's end (arbitrary pool bytes, which could
// hold NaN scales and poison P V even where P is 0) and rewrite an int4 RoPE key's FP16
// {scale, min} word as BF16, then mark the stage ready. The three-block form (int content, long
// contexts: decode.cu chooses) has no producer warp, so that three blocks of 168 registers fit on
// an SM: thread 0 issues the first copies, the warp that is the last to be done with a stage
// refills it, the warps zero a last page's tail themselves (only the {scale, min} words: masked
// int codes are finite whatever their bits) and convert the RoPE key's {scale, min} where they
// read it. Warps 0-3 consume, per page:
//   1. Scores, transposed: S^T = K Q^T (M = 16 keys a warp, N = the 16 rows). A content group g
//      contributes scale_g (Q . codes) + min_g sum(Q): its four k-steps multiply the codes as FP16
//      subnormals (one mask puts code * 2^(p - 24) in each half; fragment_maps.h), by Q in FP16
//      with channel c divided by 2^p(c) and each row scaled by a power of two 2^e_r that keeps it
//      in FP16's range; the group's partial sums are then scaled by the key's scale times 2^24 in
//      FP32. (Subnormal operands' products keep a 24-bit window below the largest of an MMA's: the
//      reference allows the scores that, as it does the values.) The minimums of all eight groups
//      take one more MMA (A = the keys' FP16 minimums, B = each row's group sums of Q, split into
//      two FP16 halves). The RoPE key is dequantized to BF16 as in the tiled kernel and multiplies
//      Q in BF16 (times 2^e_r).
//   2. Online softmax per row (the rows are S^T's columns): the page's maximum over the four warps
//      through shared memory, P = exp2 in FP32, rounded to FP16 into P^T in shared memory; the
//      row sums add the rounded P.
//   3. Output, transposed: O^T += V^T P^T (M = 128 channels a warp, two g64 groups; K = the page's
//      64 keys; N = the 16 rows). An A fragment is the codes as FP16 subnormals (one mask: code *
//      2^(p - 24)), the B fragment P times the key's group scale (one HMUL2 per register pair, FP16
//      rounding); A fragment rows 16 j + g, +8 of a group are the two nibbles of byte j of code
//      word g, so a byte of each of four keys gives one register pair. Each warp adds its own 16
//      keys' sum(P min_g) for all eight groups with one MMA (A = the minimums), summed over the
//      warps at the end, when 2^(24 - p) restores each output channel.
// Int2 g64 content the same way with fragment_maps.h's int2 maps: one code word of a key a group
// for the scores, and for V^T two bytes of each of four keys a pair of m-tiles.
// Fp8 content (e4m3 codes, an FP32 scale a group of 128 channels, no minimums): an e4m3 pair
// converts exactly to an FP16 pair in one instruction, so the scores multiply Q in FP16 (times
// 2^e_r) by the codes' values as they are, a lane's k-step being one word of each of its two keys
// (fragment_maps.h's fp8 maps), and the group's partial sums take the key's FP32 scale; for V^T
// each warp takes one group, one byte permute of two keys' words and two conversions giving the
// registers of two m-tiles. An FP32 scale does not fit the FP16 B operand (absmax / 448 is below
// FP16's normal range for a group under ~0.03), so P is multiplied by fp16(scale / 2^E), E the
// largest scale exponent of the warp's group over the block's pages so far: when a page raises
// E, the accumulators are multiplied by the power of two 2^(E_old - E) with the softmax's rescale,
// and the outputs by 2^E at the end.
// The kernel-arithmetic reference (tests/gpu/decode_reference.h, MlaDecodePlan::Operands::
// kFp16Codes) follows these roundings: scores up to FP32 sums and the subnormal products' window,
// P in FP16, P * scale in FP16.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/decode_kernel.cuh"
#include "kernels/cuda/decode_kernels.h"
#include "kernels/cuda/fragment_maps.h"
#include "kernels/cuda/launch.cuh"

namespace quantmla::gpu {

// The content formats the kernel reads: decode_kernels.h's fragments_kernel_reads.
template <class Content>
inline constexpr bool kFragmentContent = false;
template <int kBits, int kGroup>
inline constexpr bool kFragmentContent<ContentInt<kBits, kGroup>> =
    fragments_kernel_reads(kBits == 4 ? Codec::kInt4 : Codec::kInt2, kGroup);
template <>
inline constexpr bool kFragmentContent<ContentFp8> = fragments_kernel_reads(Codec::kFP8,
                                                                            ContentFp8::kGroup);
// Those of its three-block form: decode_kernels.h's fragments_three_blocks_reads.
template <class Content>
inline constexpr bool kFragmentsThreeBlocksContent = false;
template <int kBits, int kGroup>
inline constexpr bool kFragmentsThreeBlocksContent<ContentInt<kBits, kGroup>> =
    fragments_three_blocks_reads(kBits == 4 ? Codec::kInt4 : Codec::kInt2, kGroup);

// kThreeBlocks: the form without a producer warp, three blocks an SM (int content).
template <class ContentType, class Rope, bool kThreeBlocks = false>
struct FragmentLayout {
  using Content = ContentType;
  static_assert(kFragmentContent<Content>);
  static_assert(!kThreeBlocks || kFragmentsThreeBlocksContent<Content>);
  static constexpr bool kInt2 = std::is_same_v<Content, ContentInt<2, 64>>;
  static constexpr bool kFp8 = std::is_same_v<Content, ContentFp8>;
  static constexpr bool kProducer = !kThreeBlocks;
  static constexpr int kConsumerWarps = 4;
  static constexpr int kConsumers = 32 * kConsumerWarps;
  // A fifth warp (the producer) would leave room for two blocks only: with 168 registers, three
  // warps fill each of an SM's four 16,384-register files.
  static constexpr int kThreads = kConsumers + (kProducer ? 32 : 0);
  static constexpr int kRows = 16;
  static constexpr int kStepKeys = kPageTokens;    // keys per softmax step
  static constexpr int kKeySteps = kKeyDim / 16;   // k-steps of the scores: 32 content, 4 RoPE
  static constexpr int kGroups = kLatentDim / 64;  // int content's groups (fp8: Q's prologue units)
  static constexpr int kMaxRecordBytes = Content::kBytes + Rope::kMaxBytes;
  static constexpr int kStageBytes = (kPageTokens * kMaxRecordBytes + 127) / 128 * 128;
  static constexpr int kQueryBytes = kKeySteps * 32 * 16;  // Q's B fragments, 16 bytes a lane
  static constexpr int kProbStride =
      kPageTokens + 8;  // FP16; 144-byte rows: ldmatrix conflict-free
  static constexpr int kProbBytes = kRows * kProbStride * 2;
  static constexpr int kExchangeBytes = kConsumerWarps * kRows * 4;
  static constexpr int kFixedBytes = kQueryBytes + kProbBytes + kExchangeBytes;
  static constexpr int kBlocksPerSm = kThreeBlocks ? 3 : 2;
  static constexpr int kLimit = kThreeBlocks ? kSharedLimitThreeBlocks : kSharedLimitTwoBlocks;
  // 8 bytes a stage for each of its barriers: full, ready and empty with a producer; without,
  // full and a count of the warps done with the stage.
  static constexpr int kBarrierBytes = (kProducer ? 3 : 2) * 8;
  static constexpr int kFitStages = (kLimit - kFixedBytes) / (kStageBytes + kBarrierBytes);
  static constexpr int kStages = kFitStages < 4 ? kFitStages : 4;
  static constexpr int kSharedBytes = kStages * (kStageBytes + kBarrierBytes) + kFixedBytes;
  static_assert(kStages >= 2 && kSharedBytes <= kLimit);
  static_assert(kStageBytes % 128 == 0 && kQueryBytes % 128 == 0 && kProbBytes % 16 == 0);
  // P^T's buffer is scratch before the first page (each row's largest |Q| and its group sums of Q)
  // and after the last (each warp's sum(P min) of the eight groups).
  static_assert(kProbBytes >= (kRows + kRows * kGroups) * 4 &&
                kProbBytes >= kConsumerWarps * kGroups * kRows * 4);
  static_assert(kConsumers == kRows * kGroups);  // the Q prologue: a thread a row and group
};

// The producer's work on a landed page: records past `valid` zeroed (codes, scales and minimums 0
// give the value 0), and an int4 RoPE key's FP16 {scale, min} word rewritten as BF16
// (scale_min_bf16, the tiled kernel's rounding) for the BF16 RoPE product.
template <class Layout, class Rope>
__device__ __forceinline__ void prepare_page(uint8_t* page, int valid, int record_bytes, int lane) {
  using Content = typename Layout::Content;
  uint32_t* const tail = reinterpret_cast<uint32_t*>(page + valid * record_bytes);
  const int tail_words = (kPageTokens - valid) * record_bytes / 4;
  for (int w = lane; w < tail_words; w += 32) tail[w] = 0;
  if constexpr (!Rope::kIsBf16) {
    for (int r = lane; r < valid; r += 32) {
      uint32_t* const word = reinterpret_cast<uint32_t*>(page + r * record_bytes + Content::kBytes +
                                                         RopeInt4::kCodeBytes);
      *word = bf16x2_bits(scale_min_bf16(*word));
    }
  }
}

// What a subnormal code operand's products are multiplied by to restore the code's units.
constexpr float kSubnormalCodeUnit = 16777216.0f;  // 2^24

__device__ __forceinline__ uint32_t with_half(uint32_t pair, int e, uint32_t value) {
  return e == 0 ? (pair & 0xffff0000u) | (value & 0xffffu) : (pair & 0xffffu) | (value << 16);
}

__device__ __forceinline__ uint32_t f16x2_bits(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float f16_low(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<uint16_t>(bits & 0xffffu)));
}

// Two e4m3 codes (the low 16 bits: the first in the low byte) -> their FP16 pair, exact (one
// cvt.rn.f16x2.e4m3x2 on sm_89 and later).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t bits) {
  const __half2_raw pair =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(pair.x) | static_cast<uint32_t>(pair.y) << 16;
}

// 2^k as a float, for -126 <= k <= 127 (a multiplication by it is exact).
__device__ __forceinline__ float power_of_two(int k) { return __uint_as_float((127 + k) << 23); }

// A BF16 pair times 2^k (exact in BF16's exponent range).
__device__ __forceinline__ uint32_t bf16x2_times_power(uint32_t bits, int k) {
  const float lo = __uint_as_float(bits << 16) * power_of_two(k);
  const float hi = __uint_as_float(bits & 0xffff0000u) * power_of_two(k);
  return bf16x2_bits(__floats2bfloat162_rn(lo, hi));
}

// P^T's B fragment registers times the FP16 scale pairs of k indices 2t, 2t + 1 (registers 0, 2)
// and 2t + 8, 2t + 9 (registers 1, 3): one HMUL2 each, FP16 rounding.
struct ScaledProbs {
  uint32_t r[4];
  __device__ __forceinline__ ScaledProbs(const uint32_t (&b)[4], uint32_t scale01,
                                         uint32_t scale89) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 scaled =
          __hmul2(*reinterpret_cast<const __half2*>(&b[i]),
                  *reinterpret_cast<const __half2*>(i % 2 == 0 ? &scale01 : &scale89));
      r[i] = *reinterpret_cast<const uint32_t*>(&scaled);
    }
  }
  __device__ __forceinline__ uint32_t operator[](int i) const { return r[i]; }
};

// Scores += a group's partial sums times its keys' scales (rows g and g + 8 of S^T: the low and the
// high key).
__device__ __forceinline__ void add_group_scores(float (&sc)[2][4], const float (&part)[2][4],
                                                 float scale_lo, float scale_hi) {
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    sc[n][0] = fmaf(scale_lo, part[n][0], sc[n][0]);
    sc[n][1] = fmaf(scale_lo, part[n][1], sc[n][1]);
    sc[n][2] = fmaf(scale_hi, part[n][2], sc[n][2]);
    sc[n][3] = fmaf(scale_hi, part[n][3], sc[n][3]);
  }
}

template <class ContentType, class Rope, bool kThreeBlocks>
__global__ void __launch_bounds__(FragmentLayout<ContentType, Rope, kThreeBlocks>::kThreads,
                                  FragmentLayout<ContentType, Rope, kThreeBlocks>::kBlocksPerSm)
    mla_decode_fragments_kernel(const __grid_constant__ DecodeKernelParams p) {
  using L = FragmentLayout<ContentType, Rope, kThreeBlocks>;
  using Content = typename L::Content;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* const stages = smem;
  uint4* const q_frags = reinterpret_cast<uint4*>(smem + L::kStages * L::kStageBytes);
  uint16_t* const probs =
      reinterpret_cast<uint16_t*>(smem + L::kStages * L::kStageBytes + L::kQueryBytes);
  float* const exchange = reinterpret_cast<float*>(probs + L::kProbBytes / 2);  // [warp][row]
  uint64_t* const full = reinterpret_cast<uint64_t*>(exchange + L::kExchangeBytes / 4);
  uint64_t* const ready = full + L::kStages;   // converted by the producer
  uint64_t* const empty = ready + L::kStages;  // freed by the consumers
  // Without a producer: how many warps are done with each stage.
  int* const released = reinterpret_cast<int*>(full + L::kStages);

  // With the pool ready (MlaDecodeParams::pool_ready) the first pages are requested while the
  // previous kernel runs, and the producer never waits; the consumers wait before they read Q.
  if (!p.pool_ready) wait_for_previous_kernel();
  const WorkItem item = p.items[blockIdx.x];
  // A plan in a workspace launches a fixed grid (CUDA graphs); its unused items are padding.
  if (item.batch < 0) return;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int seq_len = p.seq_lens[item.batch];
  const int num_pages = item.page_end - item.page_begin;
  const uint32_t page_bytes = kPageTokens * p.record_bytes;

  // Without a producer, page i into its stage by one thread, everything read again from the
  // parameters and the item in global memory (so that the page loop keeps no more registers live
  // for its refills).
  const auto issue_page = [&](int i) {
    const int stage = i % L::kStages;
    const uint32_t bytes = kPageTokens * p.record_bytes;
    const WorkItem& own = p.items[blockIdx.x];
    const int32_t page = p.block_table[own.batch * p.block_table_stride + own.page_begin + i];
    mbarrier_arrive_expect_bytes(full + stage, bytes);
    bulk_copy_to_shared(stages + stage * L::kStageBytes,
                        p.pool + static_cast<int64_t>(page) * bytes, bytes, full + stage);
  };
  if (tid == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbarrier_init(full + s, 1);
      if constexpr (L::kProducer) {
        mbarrier_init(ready + s, 1);
        mbarrier_init(empty + s, L::kConsumerWarps);
      } else {
        released[s] = 0;
      }
    }
    fence_barrier_init();
    if constexpr (!L::kProducer) {
      for (int i = 0; i < min(L::kStages, num_pages); ++i) issue_page(i);
    }
  }
  __syncthreads();  // the last block-wide barrier: the producer leaves after its loop

  if (L::kProducer && warp == L::kConsumerWarps) {
    // issue_page's twin, from the item's registers, and the producer issues the first stages
    // too: a variant where thread 0 issued them with issue_page (two dependent global reads
    // before the block's barrier) and the producer refilled with it ran every format's serving
    // shapes 3-14% slower (2026-12-06, benchmarks.md).
    const int32_t* const pages =
        p.block_table + item.batch * p.block_table_stride + item.page_begin;
    const auto issue = [&](int i) {
      const int stage = i % L::kStages;
      mbarrier_arrive_expect_bytes(full + stage, page_bytes);
      bulk_copy_to_shared(stages + stage * L::kStageBytes,
                          p.pool + static_cast<int64_t>(pages[i]) * page_bytes, page_bytes,
                          full + stage);
    };
    if (lane == 0) {
      for (int i = 0; i < min(L::kStages, num_pages); ++i) issue(i);
    }
    for (int i = 0; i < num_pages; ++i) {
      const int stage = i % L::kStages;
      mbarrier_wait(full + stage, (i / L::kStages) & 1);
      prepare_page<L, Rope>(stages + stage * L::kStageBytes,
                            min(kPageTokens, seq_len - (item.page_begin + i) * kPageTokens),
                            p.record_bytes, lane);
      fence_proxy_async_shared();  // these writes before any later bulk copy into the stage
      __syncwarp();
      if (lane == 0) {
        mbarrier_arrive(ready + stage);
        // The stage of page i - 1 refills with page i - 1 + kStages once the consumers free it;
        // meanwhile they work on page i, which is ready.
        const int next = i - 1 + L::kStages;
        if (i >= 1 && next < num_pages) {
          mbarrier_wait(empty + (i - 1) % L::kStages, ((i - 1) / L::kStages) & 1);
          issue(next);
        }
      }
      __syncwarp();
    }
    return;
  }

  if (p.pool_ready) wait_for_previous_kernel();
  const int rows_per_seq = p.s_q * p.num_heads;
  const int first_row = item.row_tile * L::kRows;
  const uint16_t* const q =
      p.q + (static_cast<int64_t>(item.batch) * rows_per_seq + first_row) * kKeyDim;
  float* const row_peak = reinterpret_cast<float*>(probs);  // [row]
  float* const group_sums = row_peak + L::kRows;            // [row][group]
  // Each row's power of two 2^e_r (max |Q content| 2^e_r in [256, 512) unless |e_r| > 100, so that
  // Q's content channels, divided by up to 2^8 for their codes' positions, and their group sums, up
  // to 2^15, are FP16 numbers) and its group sums of Q in FP32, through P^T's buffer: thread r * 8
  // + group reads row r's 64 channels of the group.
  {
    const int row = tid / L::kGroups, group = tid % L::kGroups;
    const uint4* const chunk = reinterpret_cast<const uint4*>(q + row * kKeyDim + 64 * group);
    float peak = 0.0f, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint4 v = chunk[i];
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float lo = __uint_as_float(words[w] << 16),
                    hi = __uint_as_float(words[w] & 0xffff0000u);
        peak = fmaxf(peak, fmaxf(fabsf(lo), fabsf(hi)));
        sum += lo;
        sum += hi;
      }
    }
#pragma unroll
    for (int offset = 1; offset < L::kGroups; offset <<= 1) {
      peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, offset));
    }
    if (group == 0) row_peak[row] = peak;
    group_sums[row * L::kGroups + group] = sum;
  }
  named_barrier(1, L::kConsumers);
  const auto row_exponent = [&](int row) {
    const float peak = row_peak[row];
    return peak > 0.0f ? max(min(8 - ilogbf(peak), 100), -100) : 0;
  };
  // Q's B fragments in k-step order: for k-step ks and lane l, {b0, b1} of rows 0-7, then of rows
  // 8-15, in the channel order of fragment_maps.h; content in FP16, the RoPE key in BF16. Warp w
  // writes k-steps w, w + 4, ..., w + 32 (the last the RoPE key's), three at a time, reading all of
  // a three's channels of Q first (read-only path) so that the reads are in flight together: a
  // loop that read and converted one k-step at a time waited for each read (the largest stall of a
  // short sequence's launch in Nsight Compute's samples, 2026-12-06: docs/benchmarks.md). Not all
  // nine at once: unrolled whole, the prologue changed the register allocation of the page loop
  // below, which then ran INT4 1-2% slower at long contexts. INT2 reads one at a time: three at
  // once made its launches 2-6% slower at serving shapes (2026-12-06, docs/benchmarks.md).
  constexpr int kContentSteps = 4 * L::kGroups;
  constexpr int kStepsAtOnce = L::kInt2 ? 1 : 3;
  static_assert(L::kKeySteps % (kStepsAtOnce * L::kConsumerWarps) == 0);
  // The channel of Q that k-step ks's register h, half e holds (this thread's lane t).
  const auto channel_of = [&](int ks, int h, int e) {
    const int s = ks % 4;
    if (ks >= kContentSteps) {
      return kLatentDim +
             (Rope::kIsBf16 ? bf16_key_channel(s, t, h, e) : int4_key_channel(s, t, h, e));
    }
    if constexpr (L::kFp8) return 128 * (ks / 8) + fp8_key_channel(ks % 8, t, h, e);
    return 64 * (ks / 4) + (L::kInt2 ? int2_key_channel(s, t, h, e) : int4_key_channel(s, t, h, e));
  };
  // The BF16 bits of k-step ks's channels of rows g and 8 + g: [n][h][e], row 8n + g.
  const auto read_step = [&](int ks, uint16_t(&bits)[2][2][2]) {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          bits[n][h][e] = __ldg(q + (8 * n + g) * kKeyDim + channel_of(ks, h, e));
  };
  // Those bits as k-step ks's fragment: content in FP16 times 2^e_r, each channel divided by 2^p of
  // its code's position (int content); the RoPE key in BF16 times 2^e_r.
  const auto write_step = [&](int ks, const uint16_t(&bits)[2][2][2]) {
    uint32_t r[4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int e_r = row_exponent(8 * n + g);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (ks >= kContentSteps) {
          r[2 * n + h] =
              bf16x2_times_power(bits[n][h][0] | static_cast<uint32_t>(bits[n][h][1]) << 16, e_r);
        } else {
          const auto scaled = [&](int e) {
            const int channel = channel_of(ks, h, e) % 64;
            const int position = L::kFp8    ? 0
                                 : L::kInt2 ? int2_key_code_position(channel)
                                            : int4_code_position(channel);
            return from_bf16_bits(bits[n][h][e]) * power_of_two(e_r - position);
          };
          r[2 * n + h] = f16x2_bits(scaled(0), scaled(1));
        }
      }
    }
    q_frags[32 * ks + lane] = make_uint4(r[0], r[1], r[2], r[3]);
  };
#pragma unroll 1
  for (int first = warp; first < L::kKeySteps; first += kStepsAtOnce * L::kConsumerWarps) {
    uint16_t bits[kStepsAtOnce][2][2][2];
#pragma unroll
    for (int j = 0; j < kStepsAtOnce; ++j) read_step(first + j * L::kConsumerWarps, bits[j]);
#pragma unroll
    for (int j = 0; j < kStepsAtOnce; ++j) write_step(first + j * L::kConsumerWarps, bits[j]);
  }
  // The minimums' B fragments (k index 2t + e: group 2t + e's sum of Q times 2^e_r, its FP16
  // rounding; 2t + 8 + e: the rest, rounded again) for rows g and 8 + g: registers, for every page.
  uint32_t min_frags[4];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int row = 8 * n + g;
    const int e_r = row_exponent(row);
    float high[2], low[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float sum = group_sums[row * L::kGroups + 2 * t + e] * power_of_two(e_r);
      high[e] = __half2float(__float2half_rn(sum));
      low[e] = sum - high[e];
    }
    min_frags[2 * n] = f16x2_bits(high[0], high[1]);
    min_frags[2 * n + 1] = f16x2_bits(low[0], low[1]);
  }

  // This thread's four rows (S^T's and O^T's columns): n-tile n, half e -> row 8n + 2t + e.
  int limit[2][2];  // keys visible to the row: those before it
  // Keys visible to some row of the block: the last row's (fp8's scale exponent).
  const int block_limit =
      seq_len - p.s_q + (min(first_row + L::kRows, rows_per_seq) - 1) / p.num_heads + 1;
  float row_max[2][2], row_sum[2][2], logit_scale[2][2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 8 * n + 2 * t + e;
      limit[n][e] = seq_len - p.s_q + (first_row + row) / p.num_heads + 1;
      row_max[n][e] = -INFINITY;
      row_sum[n][e] = 0.0f;  // this thread's keys only; summed over the block at the end
      logit_scale[n][e] = p.scale_log2 * power_of_two(-row_exponent(row));
    }
  }
  // This thread's keys of a page in the scores (A rows g and g + 8 of the warp) and their columns
  // of P^T, in the order that spreads the loads over the banks (fragment_maps.h).
  const bool spread = !L::kInt2 && !L::kFp8 && p.record_bytes / 4 % 2 == 1;
  const int key_lo = score_key(warp, g, spread);
  const int key_hi = score_key(warp, g + 8, spread);
  const int column_lo = value_column(key_lo, spread), column_hi = value_column(key_hi, spread);
  // O^T: [group of the warp (fp8: half of its group)][m-tile][n-tile][register]
  float acc[2][4][2][4] = {};
  float min_acc[2][4] = {};  // sum(P min) of group g over this warp's keys: [n-tile][register]
  int scale_exponent = 0;    // fp8: E of the warp's group, biased as in an FP32's bits
  named_barrier(1, L::kConsumers);  // Q's fragments in place, the scratch read

  const int rb = p.record_bytes;
  // Page i's stage once it has landed (without a producer, with a last page's tail made safe).
  const auto await_page = [&](int i) {
    const int stage_index = i % L::kStages;
    uint8_t* const stage = stages + stage_index * L::kStageBytes;
    const int key0 = (item.page_begin + i) * kPageTokens;
    if constexpr (L::kProducer) {
      mbarrier_wait(ready + stage_index, (i / L::kStages) & 1);
    } else {
      mbarrier_wait(full + stage_index, (i / L::kStages) & 1);
      // The records past the sequence's end (its last page only): their scores are discarded (a
      // select puts -inf), but P V multiplies their values by P = 0, so what could be NaN there
      // is zeroed first: the groups' {scale, min} words (masked int codes are finite numbers
      // whatever their bits; zero scales and minimums make the values 0).
      if (const int valid = seq_len - key0; valid < kPageTokens) {
        constexpr int kWords = (Content::kBytes - Content::kCodeBytes) / 4;
        for (int w = tid; w < (kPageTokens - valid) * kWords; w += L::kConsumers) {
          *reinterpret_cast<uint32_t*>(stage + (valid + w / kWords) * p.record_bytes +
                                       Content::kCodeBytes + 4 * (w % kWords)) = 0;
        }
        named_barrier(1, L::kConsumers);
      }
    }
    return stage;
  };

  // 1. Scores of keys 16 warp + g and + 8 against the 16 rows, in units of 2^-e_r, added to sc:
  // the content's groups, their minimums (int content) and the RoPE key.
  const auto score_fp8_groups = [&](const uint8_t* stage, float(&sc)[2][4]) {
    if constexpr (L::kFp8) {
      const uint8_t* const rec_lo = stage + key_lo * rb;
      const uint8_t* const rec_hi = stage + key_hi * rb;
      const uint4* const qf = q_frags + lane;
#pragma unroll
      for (int group = 0; group < kLatentDim / Content::kGroup; ++group) {
        const int scales = Content::kCodeBytes + 4 * group;
        const float scale_lo = __uint_as_float(load_u32(rec_lo + scales));
        const float scale_hi = __uint_as_float(load_u32(rec_hi + scales));
        float part[2][4] = {};
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const int ks = 8 * group + s;
          const uint32_t word_lo = load_u32(rec_lo + 16 * ks + 4 * t);
          const uint32_t word_hi = load_u32(rec_hi + 16 * ks + 4 * t);
          const uint32_t a[4] = {e4m3x2_to_f16x2(word_lo), e4m3x2_to_f16x2(word_hi),
                                 e4m3x2_to_f16x2(word_lo >> 16), e4m3x2_to_f16x2(word_hi >> 16)};
          const uint4 b = qf[32 * ks];
          mma_f16_16x8x16(part[0], a, b.x, b.y);
          mma_f16_16x8x16(part[1], a, b.z, b.w);
        }
        add_group_scores(sc, part, scale_lo, scale_hi);
      }
    }
  };
  // Int content's group `group`.
  const auto score_int_group = [&](const uint8_t* stage, int group, float(&sc)[2][4]) {
    if constexpr (!L::kFp8) {
      const uint8_t* const rec_lo = stage + key_lo * rb;
      const uint8_t* const rec_hi = stage + key_hi * rb;
      const uint4* const qf = q_frags + lane;
      const int scales = Content::kCodeBytes + 4 * group;
      const float scale_lo = f16_low(load_u32(rec_lo + scales)) * kSubnormalCodeUnit;
      const float scale_hi = f16_low(load_u32(rec_hi + scales)) * kSubnormalCodeUnit;
      uint32_t lo[2], hi[2];
      if constexpr (L::kInt2) {
        lo[0] = load_u32(rec_lo + 16 * group + 4 * t);  // word t of the group's 4
        hi[0] = load_u32(rec_hi + 16 * group + 4 * t);
        lo[1] = lo[0] >> 10;
        hi[1] = hi[0] >> 10;
      } else {
        lo[0] = load_u32(rec_lo + 32 * group + 8 * t);  // words 2t, 2t + 1
        lo[1] = load_u32(rec_lo + 32 * group + 8 * t + 4);
        hi[0] = load_u32(rec_hi + 32 * group + 8 * t);
        hi[1] = load_u32(rec_hi + 32 * group + 8 * t + 4);
      }
      float part[2][4] = {};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t a[4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t word_lo, word_hi, mask;
          if constexpr (L::kInt2) {
            const int shifted = int2_key_word_shift(s, h) != 0;
            word_lo = lo[shifted];
            word_hi = hi[shifted];
            mask = kInt2Pair << (int2_key_shift(s, h) - int2_key_word_shift(s, h));
          } else {
            word_lo = lo[s >> 1] >> int4_key_word_shift(s);
            word_hi = hi[s >> 1] >> int4_key_word_shift(s);
            mask = kInt4Pair << (4 * h);
          }
          a[2 * h] = word_lo & mask;  // the FP16 subnormals code * 2^(p - 24)
          a[2 * h + 1] = word_hi & mask;
        }
        const uint4 b = qf[32 * (4 * group + s)];
        mma_f16_16x8x16(part[0], a, b.x, b.y);
        mma_f16_16x8x16(part[1], a, b.z, b.w);
      }
      add_group_scores(sc, part, scale_lo, scale_hi);
    }
  };
  const auto score_int_minimums = [&](const uint8_t* stage, float(&sc)[2][4]) {
    if constexpr (!L::kFp8) {
      const uint8_t* const rec_lo = stage + key_lo * rb;
      const uint8_t* const rec_hi = stage + key_hi * rb;
      // The minimums: A columns 2t + e and 2t + 8 + e both take group 2t + e's minimum.
      const uint8_t* const words_lo = rec_lo + Content::kCodeBytes + 8 * t;
      const uint8_t* const words_hi = rec_hi + Content::kCodeBytes + 8 * t;
      uint32_t a[4];
      a[0] = a[2] = __byte_perm(load_u32(words_lo), load_u32(words_lo + 4), 0x7632);
      a[1] = a[3] = __byte_perm(load_u32(words_hi), load_u32(words_hi + 4), 0x7632);
      mma_f16_16x8x16(sc[0], a, min_frags[0], min_frags[1]);
      mma_f16_16x8x16(sc[1], a, min_frags[2], min_frags[3]);
    }
  };
  const auto score_rope = [&](const uint8_t* stage, float(&sc)[2][4]) {
    const uint8_t* const rec_lo = stage + key_lo * rb;
    const uint8_t* const rec_hi = stage + key_hi * rb;
    const uint4* const qf = q_frags + lane;
    // The RoPE key in BF16, as the tiled kernel's tile holds it.
    uint32_t lo[2] = {0, 0}, hi[2] = {0, 0};
    __nv_bfloat162 s_lo{}, m_lo{}, s_hi{}, m_hi{};
    if constexpr (!Rope::kIsBf16) {
      const int scales = Content::kBytes + RopeInt4::kCodeBytes;
      lo[0] = load_u32(rec_lo + Content::kBytes + 8 * t);
      lo[1] = load_u32(rec_lo + Content::kBytes + 8 * t + 4);
      hi[0] = load_u32(rec_hi + Content::kBytes + 8 * t);
      hi[1] = load_u32(rec_hi + Content::kBytes + 8 * t + 4);
      // {scale, min} in BF16: rewritten so by the producer, converted here without one.
      const auto scale_min = [](uint32_t word) {
        return L::kProducer ? bf16x2_from_bits(word) : scale_min_bf16(word);
      };
      const __nv_bfloat162 sm_lo = scale_min(load_u32(rec_lo + scales));
      const __nv_bfloat162 sm_hi = scale_min(load_u32(rec_hi + scales));
      s_lo = __low2bfloat162(sm_lo);
      m_lo = __high2bfloat162(sm_lo);
      s_hi = __low2bfloat162(sm_hi);
      m_hi = __high2bfloat162(sm_hi);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t a[4];
      if constexpr (Rope::kIsBf16) {
        const int offset = Content::kBytes + 2 * (16 * s + 2 * t);
        a[0] = load_u32(rec_lo + offset);
        a[1] = load_u32(rec_hi + offset);
        a[2] = load_u32(rec_lo + offset + 16);
        a[3] = load_u32(rec_hi + offset + 16);
      } else {
        const int shift = 4 * int4_key_nibble(s, 0, 0);
        a[0] = dequantize_biased_pair(biased_codes(lo[s >> 1] >> shift), s_lo, m_lo);
        a[1] = dequantize_biased_pair(biased_codes(hi[s >> 1] >> shift), s_hi, m_hi);
        a[2] = dequantize_biased_pair(biased_codes(lo[s >> 1] >> (shift + 4)), s_lo, m_lo);
        a[3] = dequantize_biased_pair(biased_codes(hi[s >> 1] >> (shift + 4)), s_hi, m_hi);
        // RoPE pairs kept in BF16 overwrite their two channels (h = 0 and 1, one half).
        for (int n = 0; n < p.kept.count; ++n) {
          const FragmentPlace place = int4_key_place(2 * p.kept.pairs[n]);
          if (place.t == t && place.s == s) {
            const int offset = Content::kBytes + RopeInt4::kBaseBytes + 4 * n;
            const uint32_t kept_lo = load_u32(rec_lo + offset);
            const uint32_t kept_hi = load_u32(rec_hi + offset);
            a[0] = with_half(a[0], place.e, kept_lo);
            a[2] = with_half(a[2], place.e, kept_lo >> 16);
            a[1] = with_half(a[1], place.e, kept_hi);
            a[3] = with_half(a[3], place.e, kept_hi >> 16);
          }
        }
      }
      const uint4 b = qf[32 * (4 * L::kGroups + s)];
      mma_bf16_16x8x16(sc[0], a, b.x, b.y);
      mma_bf16_16x8x16(sc[1], a, b.z, b.w);
    }
  };
  const auto page_scores = [&](const uint8_t* stage, float(&sc)[2][4]) {
    if constexpr (L::kFp8) {
      score_fp8_groups(stage, sc);
    } else {
#pragma unroll
      for (int group = 0; group < L::kGroups; ++group) score_int_group(stage, group, sc);
      score_int_minimums(stage, sc);
    }
    score_rope(stage, sc);
  };

  // 2. Online softmax of page i's scores into P^T (sc[n][e] is key g, sc[n][2 + e] key g + 8, of
  // row 8n + 2t + e); the accumulators rescaled (fp8: for E too).
  const auto softmax = [&](int i, const uint8_t* stage, const float(&sc)[2][4]) {
    const int key0 = (item.page_begin + i) * kPageTokens;
    float x[2][4];
    float page_max[2][2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        x[n][e] = key0 + key_lo < limit[n][e] ? sc[n][e] * logit_scale[n][e] : -INFINITY;
        x[n][2 + e] = key0 + key_hi < limit[n][e] ? sc[n][2 + e] * logit_scale[n][e] : -INFINITY;
        page_max[n][e] = fmaxf(x[n][e], x[n][2 + e]);
#pragma unroll
        for (int offset = 4; offset < 32; offset <<= 1) {
          page_max[n][e] =
              fmaxf(page_max[n][e], __shfl_xor_sync(0xffffffffu, page_max[n][e], offset));
        }
        if (g == 0) exchange[warp * L::kRows + 8 * n + 2 * t + e] = page_max[n][e];
      }
    }
    named_barrier(1, L::kConsumers);
    float alpha[2][2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = 8 * n + 2 * t + e;
        float tile_max = exchange[row];
#pragma unroll
        for (int w = 1; w < L::kConsumerWarps; ++w) {
          tile_max = fmaxf(tile_max, exchange[w * L::kRows + row]);
        }
        const float new_max = fmaxf(row_max[n][e], tile_max);
        // A row with no visible key yet keeps weight 0 everywhere instead of exp(-inf + inf).
        const float reference = new_max == -INFINITY ? 0.0f : new_max;
        alpha[n][e] = exp2f(row_max[n][e] - reference);
        row_max[n][e] = new_max;
        // exp2_flushed's zero below 2^-126 is FP16's rounding of such a weight anyway.
        const __half p_lo = __float2half_rn(exp2_flushed(x[n][e] - reference));
        const __half p_hi = __float2half_rn(exp2_flushed(x[n][2 + e] - reference));
        row_sum[n][e] = row_sum[n][e] * alpha[n][e] + (__half2float(p_lo) + __half2float(p_hi));
        uint16_t* const prob_row = probs + row * L::kProbStride;
        prob_row[column_lo] = __half_as_ushort(p_lo);
        prob_row[column_hi] = __half_as_ushort(p_hi);
      }
    }
    named_barrier(1, L::kConsumers);  // P^T complete

    float value_factor = 1.0f;  // fp8: 2^(E_old - E) when this page raises E
    if constexpr (L::kFp8) {
      // E over the page's keys that some row of the block sees: a key that all of them mask (a
      // prefill chunk's later keys) must not move the others' roundings, or a token's outputs
      // would differ between its chunk and a decode step (the batch-invariant plans).
      const int scales = Content::kCodeBytes + 4 * warp;
      const int seen = block_limit - key0;
      const uint32_t exponent =
          max(lane < seen ? load_u32(stage + lane * rb + scales) >> 23 & 0xffu : 0u,
              lane + 32 < seen ? load_u32(stage + (lane + 32) * rb + scales) >> 23 & 0xffu : 0u);
      const int raised = max(scale_exponent, static_cast<int>(__reduce_max_sync(~0u, exponent)));
      value_factor = scale_exponent - raised < -126 ? 0.0f : power_of_two(scale_exponent - raised);
      scale_exponent = raised;
    }
    // Int content: the accumulators take the page's factors only where one of the warp's rows'
    // maximum rose, since a product by 1 changes nothing (their values are 0 or normal: products
    // of codes times 2^-24 and FP16 P times scales, each at least 2^-48), and once the maxima
    // settle most pages skip these 68 products for one vote. Fp8's accumulators can be subnormal
    // (the scale exponent's factor), which the product by 1 flushes: it always rescales, so that
    // its outputs do not depend on which rows share a block (the batch-invariant test).
    bool rescaled = L::kFp8;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) rescaled |= alpha[n][e] != 1.0f;
    if (L::kFp8 || __any_sync(0xffffffffu, rescaled)) {
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          min_acc[n][e] *= alpha[n][e];
          const float rescale = alpha[n][e] * value_factor;
#pragma unroll
          for (int gl = 0; gl < 2; ++gl)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              acc[gl][j][n][e] *= rescale;
              acc[gl][j][n][2 + e] *= rescale;
            }
        }
    }
  };

  // 3. O^T += V^T P^T over this warp's groups 2 warp, 2 warp + 1 (fp8: its group `warp`).
  // P^T's B fragments of keys 16 ks + [0, 16): rows 0-7 in b[0], b[1], rows 8-15 in b[2], b[3].
  const auto load_probs = [&](int ks, uint32_t(&b)[4]) {
    ldmatrix_x4(b, shared_address(probs + (8 * (lane / 16) + lane % 8) * L::kProbStride + 16 * ks +
                                  8 * ((lane / 8) % 2)));
  };
  // The records of k-tile ks's keys at the MMA's k indices 2t, 2t + 1, 2t + 8, 2t + 9.
  const auto value_records = [&](const uint8_t* stage, int ks, const uint8_t*(&records)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      records[i] = stage + value_key(ks, 2 * t + i % 2 + 8 * (i / 2), spread) * rb;
    }
  };
  // Int content: each warp's sum(P min) of the eight groups over its own 16 keys (fp8: none).
  const auto value_int_minimums = [&](const uint8_t* stage) {
    if constexpr (!L::kFp8) {
      // k-tile `warp`: A row g (< 8) = group g's minimums of its keys, rows g + 8 zero.
      uint32_t b[4];
      load_probs(warp, b);
      const uint8_t* records[4];
      value_records(stage, warp, records);
      const int mins = Content::kCodeBytes + 4 * g;
      uint32_t a[4] = {
          __byte_perm(load_u32(records[0] + mins), load_u32(records[1] + mins), 0x7632), 0,
          __byte_perm(load_u32(records[2] + mins), load_u32(records[3] + mins), 0x7632), 0};
      mma_f16_16x8x16(min_acc[0], a, b[0], b[1]);
      mma_f16_16x8x16(min_acc[1], a, b[2], b[3]);
    }
  };
  // K-tile ks (keys 16 ks + [0, 16)) of the values.
  const auto value_tile = [&](const uint8_t* stage, int ks) {
    uint32_t b[4];
    load_probs(ks, b);
    const uint8_t* records[4];
    value_records(stage, ks, records);
    if constexpr (L::kFp8) {
      // P times fp16(scale / 2^E) of k indices 2t, 2t + 1 (b[0], b[2]) and 2t + 8, 2t + 9.
      const int scales = Content::kCodeBytes + 4 * warp;
      const float unit = power_of_two(127 - scale_exponent);
      const uint32_t scale01 = f16x2_bits(__uint_as_float(load_u32(records[0] + scales)) * unit,
                                          __uint_as_float(load_u32(records[1] + scales)) * unit);
      const uint32_t scale89 = f16x2_bits(__uint_as_float(load_u32(records[2] + scales)) * unit,
                                          __uint_as_float(load_u32(records[3] + scales)) * unit);
      const ScaledProbs pb(b, scale01, scale89);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int pair = 0; pair < 2; ++pair) {
          // Word g + 8 pair of the half: bytes 2 jj, 2 jj + 1 are m-tile 2 pair + jj's rows g
          // and g + 8 (fp8_value_channel); one permute puts a byte of two keys in each half.
          const int word = 128 * warp + 64 * half + 4 * (g + 8 * pair);
          const uint32_t w0 = load_u32(records[0] + word), w1 = load_u32(records[1] + word);
          const uint32_t w8 = load_u32(records[2] + word), w9 = load_u32(records[3] + word);
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const uint32_t select = jj == 0 ? 0x5140u : 0x7362u;
            const uint32_t x01 = __byte_perm(w0, w1, select);
            const uint32_t x89 = __byte_perm(w8, w9, select);
            const uint32_t a[4] = {e4m3x2_to_f16x2(x01), e4m3x2_to_f16x2(x01 >> 16),
                                   e4m3x2_to_f16x2(x89), e4m3x2_to_f16x2(x89 >> 16)};
            mma_f16_16x8x16(acc[half][2 * pair + jj][0], a, pb[0], pb[1]);
            mma_f16_16x8x16(acc[half][2 * pair + jj][1], a, pb[2], pb[3]);
          }
        }
      }
    } else {
#pragma unroll
      for (int gl = 0; gl < 2; ++gl) {
        const int group = 2 * warp + gl;
        // P times the FP16 scales of k indices 2t, 2t + 1 (b[0], b[2]) and 2t + 8, 2t + 9 (b[1],
        // b[3]).
        const int scales = Content::kCodeBytes + 4 * group;
        const uint32_t scale01 =
            __byte_perm(load_u32(records[0] + scales), load_u32(records[1] + scales), 0x5410);
        const uint32_t scale89 =
            __byte_perm(load_u32(records[2] + scales), load_u32(records[3] + scales), 0x5410);
        const ScaledProbs pb(b, scale01, scale89);
        if constexpr (L::kInt2) {
          // Byte g % 4 of words g / 4 (m-tiles 0, 1) and g / 4 + 2 (m-tiles 2, 3) of two keys in
          // bytes 0 and 2; m-tile j's rows g and g + 8 are the codes at int2_value_shift(j) and
          // 2 more (fragment_maps.h).
          const uint32_t select = (g % 4) | (4 + g % 4) << 8;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int word = 16 * group + 4 * (g / 4) + 8 * half;
            const uint32_t x01 =
                __byte_perm(load_u32(records[0] + word), load_u32(records[1] + word), select);
            const uint32_t x89 =
                __byte_perm(load_u32(records[2] + word), load_u32(records[3] + word), select);
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              const uint32_t mask = kInt2Pair << int2_value_shift(jj);
              uint32_t a[4] = {x01 & mask, x01 & (mask << 2), x89 & mask, x89 & (mask << 2)};
              mma_f16_16x8x16(acc[gl][2 * half + jj][0], a, pb[0], pb[1]);
              mma_f16_16x8x16(acc[gl][2 * half + jj][1], a, pb[2], pb[3]);
            }
          }
        } else {
          const int codes = 32 * group + 4 * g;
          const uint32_t w0 = load_u32(records[0] + codes), w1 = load_u32(records[1] + codes);
          const uint32_t w8 = load_u32(records[2] + codes), w9 = load_u32(records[3] + codes);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            // Byte j of two keys' code word g in bytes 0 and 2: low nibbles row g, high
            // nibbles row g + 8.
            const uint32_t x01 = __byte_perm(w0, w1, j | (4 + j) << 8);
            const uint32_t x89 = __byte_perm(w8, w9, j | (4 + j) << 8);
            uint32_t a[4] = {x01 & kInt4Pair, x01 & (kInt4Pair << 4), x89 & kInt4Pair,
                             x89 & (kInt4Pair << 4)};
            mma_f16_16x8x16(acc[gl][j][0], a, pb[0], pb[1]);
            mma_f16_16x8x16(acc[gl][j][1], a, pb[2], pb[3]);
          }
        }
      }
    }
  };
  const auto page_values = [&](const uint8_t* stage) {
    value_int_minimums(stage);
#pragma unroll
    for (int ks = 0; ks < kPageTokens / 16; ++ks) value_tile(stage, ks);
  };
  // This warp is done with page i's stage.
  const auto release = [&](int i) {
    const int stage_index = i % L::kStages;
    __syncwarp();
    if constexpr (L::kProducer) {
      if (lane == 0) mbarrier_arrive(empty + stage_index);  // this warp is done with the stage
    } else if (lane == 0 && i + L::kStages < num_pages) {
      // The last warp to be done with the stage refills it (the fences: every warp's reads of the
      // stage before the copy's writes).
      __threadfence_block();
      if (atomicAdd(released + stage_index, 1) == L::kConsumerWarps - 1) {
        released[stage_index] = 0;
        __threadfence_block();
        fence_proxy_async_shared();
        issue_page(i + L::kStages);
      }
    }
  };

  for (int i = 0; i < num_pages; ++i) {
    const uint8_t* const stage = await_page(i);
    float sc[2][4] = {};
    page_scores(stage, sc);
    softmax(i, stage, sc);
    page_values(stage);
    release(i);
  }

  // Channel of an output column's row g of m-tile j (row g + 8 is the next channel), and its
  // code's position (the subnormal code * 2^(p - 24): times 2^(24 - p) restores it).
  const auto value_channel = [](int j, int row) {
    return L::kFp8    ? fp8_value_channel(j, row)
           : L::kInt2 ? int2_value_channel(j, row)
                      : int4_value_channel(j, row);
  };
  // fp8: 2^E (a group of zero scales only has zero sums).
  const float value_unit =
      L::kFp8 && scale_exponent > 0 ? power_of_two(scale_exponent - 127) : 0.0f;
  const auto code_factor = [&](int channel) {
    if constexpr (L::kFp8) return value_unit;
    return power_of_two(
        24 - (L::kInt2 ? int2_value_code_position(channel) : int4_code_position(channel)));
  };

  // Each row's sum over its 8 lanes g and the four warps (the exchange's last readers passed the
  // barrier after P^T, so it may be written).
  float total[2][2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) {
        row_sum[n][e] += __shfl_xor_sync(0xffffffffu, row_sum[n][e], offset);
      }
      if (g == 0) exchange[warp * L::kRows + 8 * n + 2 * t + e] = row_sum[n][e];
    }
  }
  named_barrier(1, L::kConsumers);  // every warp past its last P V: P^T's buffer is scratch
  float* const min_sums = reinterpret_cast<float*>(probs);  // [warp][group][row]
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 8 * n + 2 * t + e;
      total[n][e] = exchange[row];
#pragma unroll
      for (int w = 1; w < L::kConsumerWarps; ++w) total[n][e] += exchange[w * L::kRows + row];
      min_sums[(warp * L::kGroups + g) * L::kRows + row] = min_acc[n][e];
    }
  }
  named_barrier(1, L::kConsumers);

#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int local_row = 8 * n + 2 * t + e;
      const int row = first_row + local_row;
      const float sum = total[n][e];
      const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
      const float lse =
          sum > 0.0f ? (row_max[n][e] + log2f(sum)) * 0.69314718055994531f : -INFINITY;
      float value[2][4][2];  // [group of the warp][m-tile][row g, g + 8], normalized
#pragma unroll
      for (int gl = 0; gl < 2; ++gl) {
        const int group = 2 * warp + gl;
        float min_sum = 0.0f;
#pragma unroll
        for (int w = 0; w < L::kConsumerWarps; ++w) {
          min_sum += min_sums[(w * L::kGroups + group) * L::kRows + local_row];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int channel = value_channel(j, g);
          value[gl][j][0] = (acc[gl][j][n][e] * code_factor(channel) + min_sum) * inverse;
          value[gl][j][1] = (acc[gl][j][n][2 + e] * code_factor(channel + 1) + min_sum) * inverse;
        }
      }
      if (item.partial < 0) {
        uint16_t* const out =
            p.out + (static_cast<int64_t>(item.batch) * rows_per_seq + row) * kLatentDim;
#pragma unroll
        for (int gl = 0; gl < 2; ++gl) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int channel = 64 * (2 * warp + gl) + value_channel(j, g);
            *reinterpret_cast<uint32_t*>(out + channel) =
                bf16x2_bits(__floats2bfloat162_rn(value[gl][j][0], value[gl][j][1]));
          }
        }
        if (warp == 0 && g == 0 && p.lse != nullptr) {
          p.lse[static_cast<int64_t>(item.batch) * rows_per_seq + row] = lse;
        }
      } else {
        float* const out = p.partial_out +
                           (static_cast<int64_t>(item.partial) * L::kRows + local_row) * kLatentDim;
#pragma unroll
        for (int gl = 0; gl < 2; ++gl) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int channel = 64 * (2 * warp + gl) + value_channel(j, g);
            *reinterpret_cast<float2*>(out + channel) =
                make_float2(value[gl][j][0], value[gl][j][1]);
          }
        }
        if (warp == 0 && g == 0) p.partial_lse[item.partial * L::kRows + local_row] = lse;
      }
    }
  }
}

// One launch (instantiated per content format in decode_fragments_<content>.cu): the three-block
// form where `three_blocks` (a plan's choice, for the formats of kFragmentsThreeBlocksContent).
template <class Content, class Rope, bool kThreeBlocks>
void launch_fragments_form(const DecodeKernelParams& params, int blocks, cudaStream_t stream) {
  using Layout = FragmentLayout<Content, Rope, kThreeBlocks>;
  constexpr auto kKernel = mla_decode_fragments_kernel<Content, Rope, kThreeBlocks>;
  // The plan split the work for kBlocksPerSm blocks at once on every SM.
  static const bool resident = require_resident_blocks<kKernel>(
      Layout::kThreads, Layout::kSharedBytes, Layout::kBlocksPerSm, "the fragment decode kernel");
  (void)resident;
  launch_large_shared<kKernel>(blocks, Layout::kThreads, Layout::kSharedBytes, stream, params);
}
template <class Content, class Rope>
void launch_decode_fragments(const DecodeKernelParams& params, int blocks, bool three_blocks,
                             cudaStream_t stream) {
  if constexpr (kFragmentsThreeBlocksContent<Content>) {
    if (three_blocks) return launch_fragments_form<Content, Rope, true>(params, blocks, stream);
  }
  if (three_blocks) {
    throw InvalidArgument("GPU decode (internal): no three-block fragment kernel for this content");
  }
  launch_fragments_form<Content, Rope, false>(params, blocks, stream);
}
// Compiled once each, in decode_fragments_int4_g64.cu, decode_fragments_int2_g64.cu and
// decode_fragments_fp8.cu.
extern template void launch_decode_fragments<ContentInt<4, 64>, RopeBf16>(const DecodeKernelParams&,
                                                                          int, bool, cudaStream_t);
extern template void launch_decode_fragments<ContentInt<4, 64>, RopeInt4>(const DecodeKernelParams&,
                                                                          int, bool, cudaStream_t);
extern template void launch_decode_fragments<ContentInt<2, 64>, RopeBf16>(const DecodeKernelParams&,
                                                                          int, bool, cudaStream_t);
extern template void launch_decode_fragments<ContentInt<2, 64>, RopeInt4>(const DecodeKernelParams&,
                                                                          int, bool, cudaStream_t);
extern template void launch_decode_fragments<ContentFp8, RopeBf16>(const DecodeKernelParams&, int,
                                                                   bool, cudaStream_t);
extern template void launch_decode_fragments<ContentFp8, RopeInt4>(const DecodeKernelParams&, int,
                                                                   bool, cudaStream_t);

}  // namespace quantmla::gpu
