// The fragment-dequantizing decode kernel (issue 15's second kernel) for int4 or int2 g64 content:
// the tensor cores' operands are built in registers straight from the raw records, with no BF16
// tile in shared memory (the tiled kernel's dequantized tile cost more shared-memory traffic a page
// than the whole budget of a 3x speed-up: docs/gpu-kernels.md).
//
// One block per WorkItem of 16 query rows. Warp 4 is the producer: its lane 0 streams whole pages
// (64 records) into a ring of shared-memory stages with bulk copies that complete on a barrier per
// stage, and refills a stage when the consumers have freed it. Once a page has landed, the
// producer's lanes rewrite its FP16 {scale, min} words as BF16 pairs in place and zero the records
// past the sequence's end (arbitrary pool bytes, which could decode to NaN and poison P V even
// where P is 0), then mark the stage ready. Warps 0-3 consume, per page:
//   1. Scores, transposed: S^T = K Q^T (M = 16 keys a warp, N = the 16 rows, K = 576 channels in
//      36 k-steps). Each A fragment is dequantized from the key's code words (fragment_maps.h: lane
//      t takes words 2t, 2t + 1 of a group, one shift and mask a BF16 pair); the B fragments of Q
//      are stored once per block in fragment order (one 16-byte load a k-step).
//   2. Online softmax per row (the rows are S^T's columns): the page's maximum over the four warps
//      through shared memory, P = exp2 in FP32, rounded to BF16 into P^T in shared memory.
//   3. Output, transposed: O^T += V^T P^T (M = 128 channels a warp, two g64 groups; K = the page's
//      64 keys; N = the 16 rows). A fragment rows 16 j + g, +8 of a group are the two nibbles of
//      byte j of code word g, so a byte of each of four keys gives one register pair.
// Int2 g64 content the same way with fragment_maps.h's int2 maps: one code word of a key a group
// for the scores (a shift by two bits a register), and for V^T two bytes of each of four keys a
// pair of m-tiles.
// The values are those of the tiled kernel's tile (bf16(code x bf16(scale) + bf16(min)), one
// rounding) and P rounds as there, against each page's running maximum, so the kernel-arithmetic
// reference (tests/gpu/decode_reference.h) checks both with keys_per_step = 64.
#pragma once

#include <cstdint>
#include <type_traits>

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

template <class ContentType, class Rope>
struct FragmentLayout {
  using Content = ContentType;
  static_assert(kFragmentContent<Content>);
  static constexpr bool kInt2 = std::is_same_v<Content, ContentInt<2, 64>>;
  static constexpr int kConsumerWarps = 4;
  static constexpr int kConsumers = 32 * kConsumerWarps;
  static constexpr int kThreads = kConsumers + 32;  // and one producer warp
  static constexpr int kRows = 16;
  static constexpr int kStepKeys = kPageTokens;   // keys per softmax step
  static constexpr int kKeySteps = kKeyDim / 16;  // k-steps of the scores: 32 content, 4 RoPE
  static constexpr int kMaxRecordBytes = Content::kBytes + Rope::kMaxBytes;
  static constexpr int kStageBytes = (kPageTokens * kMaxRecordBytes + 127) / 128 * 128;
  static constexpr int kQueryBytes = kKeySteps * 32 * 16;  // Q's B fragments, 16 bytes a lane
  static constexpr int kProbStride =
      kPageTokens + 8;  // BF16; 144-byte rows: ldmatrix conflict-free
  static constexpr int kProbBytes = kRows * kProbStride * 2;
  static constexpr int kExchangeBytes = kConsumerWarps * kRows * 4;
  static constexpr int kFixedBytes = kQueryBytes + kProbBytes + kExchangeBytes;
  static constexpr int kBlocksPerSm = 2;
  static constexpr int kFitStages = (kSharedLimitTwoBlocks - kFixedBytes - 96) / kStageBytes;
  static constexpr int kStages = kFitStages < 4 ? kFitStages : 4;
  static constexpr int kSharedBytes = kStages * kStageBytes + kFixedBytes + 3 * kStages * 8;
  // {scale, min} words of a record: one per content group, and the int4 RoPE key's.
  static constexpr int kScaleWords = kLatentDim / 64 + (Rope::kIsBf16 ? 0 : 1);
  static_assert(kStages >= 2 && kSharedBytes <= kSharedLimitTwoBlocks);
  static_assert(kStageBytes % 128 == 0 && kQueryBytes % 128 == 0 && kProbBytes % 16 == 0);
};

// The producer's work on a landed page: records past `valid` zeroed (codes, scales and minimums 0
// decode to 0), the valid records' FP16 {scale, min} words rewritten as BF16 {scale, min}
// (scale_min_bf16, the tiled kernel's rounding), so the consumers convert nothing.
template <class Layout>
__device__ __forceinline__ void prepare_page(uint8_t* page, int valid, int record_bytes, int lane) {
  using Content = typename Layout::Content;
  uint32_t* const tail = reinterpret_cast<uint32_t*>(page + valid * record_bytes);
  const int tail_words = (kPageTokens - valid) * record_bytes / 4;
  for (int w = lane; w < tail_words; w += 32) tail[w] = 0;
  for (int u = lane; u < valid * Layout::kScaleWords; u += 32) {
    const int r = u / Layout::kScaleWords;
    const int k = u % Layout::kScaleWords;
    const int offset =
        k < kLatentDim / 64 ? Content::kCodeBytes + 4 * k : Content::kBytes + RopeInt4::kCodeBytes;
    uint32_t* const word = reinterpret_cast<uint32_t*>(page + r * record_bytes + offset);
    *word = bf16x2_bits(scale_min_bf16(*word));
  }
}

// The masks of biased_codes: two int4 or two int2 codes, one in the low bits of each half.
constexpr uint32_t kInt4Pair = 0x000f000fu, kInt2Pair = 0x00030003u;

// (bits & mask) | kCodeBias in one LOP3 (the compiler emits an AND and an OR): with bits shifted so
// that two codes sit in the low bits of the halves, the BF16 pair 128 + code.
__device__ __forceinline__ uint32_t biased_codes(uint32_t bits, uint32_t mask = kInt4Pair) {
  uint32_t biased;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(biased) : "r"(bits), "r"(mask), "r"(kCodeBias));
  return biased;
}

__device__ __forceinline__ uint32_t with_half(uint32_t pair, int e, uint32_t value) {
  return e == 0 ? (pair & 0xffff0000u) | (value & 0xffffu) : (pair & 0xffffu) | (value << 16);
}

template <class ContentType, class Rope>
__global__ void __launch_bounds__(FragmentLayout<ContentType, Rope>::kThreads,
                                  FragmentLayout<ContentType, Rope>::kBlocksPerSm)
    mla_decode_fragments_kernel(const __grid_constant__ DecodeKernelParams p) {
  using L = FragmentLayout<ContentType, Rope>;
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

  wait_for_previous_kernel();
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

  if (tid == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbarrier_init(full + s, 1);
      mbarrier_init(ready + s, 1);
      mbarrier_init(empty + s, L::kConsumerWarps);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the last block-wide barrier: the producer leaves after its loop

  if (warp == L::kConsumerWarps) {
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
      prepare_page<L>(stages + stage * L::kStageBytes,
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

  // Q's B fragments in k-step order: for k-step ks and lane l, {b0, b1} of rows 0-7, then of rows
  // 8-15, in the channel order of fragment_maps.h.
  const int rows_per_seq = p.s_q * p.num_heads;
  const int first_row = item.row_tile * L::kRows;
  {
    const uint16_t* q =
        p.q + (static_cast<int64_t>(item.batch) * rows_per_seq + first_row) * kKeyDim;
    for (int i = tid; i < L::kKeySteps * 32; i += L::kConsumers) {
      const int ks = i / 32;
      const int s = ks % 4;
      const int fg = (i % 32) / 4;
      const int ft = i % 4;
      uint32_t r[4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const uint16_t* row = q + (8 * n + fg) * kKeyDim;
        if (ks >= 32 && Rope::kIsBf16) {
          // Channel order: register h holds channels (c, c + 1), c = bf16_key_channel(s, t, h, 0).
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            r[2 * n + h] = *reinterpret_cast<const uint32_t*>(row + kLatentDim +
                                                              bf16_key_channel(s, ft, h, 0));
          }
        } else {
          // Registers h = 0, 1 hold channels (c + h, c + h + d): two words, two byte permutes;
          // d = 4 for int4 codes (the RoPE key's included), 8 for int2 content.
          const bool int2 = L::kInt2 && ks < 32;
          const int c = (ks < 32 ? 64 * (ks / 4) : kLatentDim) +
                        (int2 ? int2_key_channel(s, ft, 0, 0) : int4_key_channel(s, ft, 0, 0));
          const uint32_t first = *reinterpret_cast<const uint32_t*>(row + c);
          const uint32_t second = *reinterpret_cast<const uint32_t*>(row + c + (int2 ? 8 : 4));
          r[2 * n] = __byte_perm(first, second, 0x5410);
          r[2 * n + 1] = __byte_perm(first, second, 0x7632);
        }
      }
      q_frags[i] = make_uint4(r[0], r[1], r[2], r[3]);
    }
  }

  // This thread's four rows (S^T's and O^T's columns): n-tile n, half e -> row 8n + 2t + e.
  int limit[2][2];  // keys visible to the row: those before it
  float row_max[2][2], row_sum[2][2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      limit[n][e] = seq_len - p.s_q + (first_row + 8 * n + 2 * t + e) / p.num_heads + 1;
      row_max[n][e] = -INFINITY;
      row_sum[n][e] = 0.0f;  // this thread's keys only; summed over the block at the end
    }
  }
  float acc[2][4][2][4] = {};       // O^T: [group of the warp][m-tile][n-tile][register]
  named_barrier(1, L::kConsumers);  // Q's fragments are in place

  for (int i = 0; i < num_pages; ++i) {
    const int stage_index = i % L::kStages;
    uint8_t* const stage = stages + stage_index * L::kStageBytes;
    const int key0 = (item.page_begin + i) * kPageTokens;
    mbarrier_wait(ready + stage_index, (i / L::kStages) & 1);

    // 1. Scores of keys 16 warp + g and + 8 against the 16 rows; even and odd k-steps accumulate
    // apart so that consecutive MMAs do not wait on each other.
    float sc[2][2][4] = {};
    {
      const uint8_t* const rec_lo = stage + (16 * warp + g) * p.record_bytes;
      const uint8_t* const rec_hi = rec_lo + 8 * p.record_bytes;
      const uint4* const qf = q_frags + lane;
#pragma unroll
      for (int group = 0; group < 9; ++group) {
        constexpr bool kRopeBf16 = Rope::kIsBf16;
        const bool coded = group < 8 || !kRopeBf16;
        uint32_t lo[2] = {0, 0}, hi[2] = {0, 0};
        __nv_bfloat162 s_lo{}, m_lo{}, s_hi{}, m_hi{};
        const bool int2 = L::kInt2 && group < 8;
        if (coded) {
          const int scales =
              group < 8 ? Content::kCodeBytes + 4 * group : Content::kBytes + RopeInt4::kCodeBytes;
          if (int2) {
            // Word t of the group's 4 (16 bytes a group).
            lo[0] = load_u32(rec_lo + 16 * group + 4 * t);
            hi[0] = load_u32(rec_hi + 16 * group + 4 * t);
          } else {
            const int codes = group < 8 ? 32 * group : Content::kBytes;
            lo[0] = load_u32(rec_lo + codes + 8 * t);
            lo[1] = load_u32(rec_lo + codes + 8 * t + 4);
            hi[0] = load_u32(rec_hi + codes + 8 * t);
            hi[1] = load_u32(rec_hi + codes + 8 * t + 4);
          }
          const __nv_bfloat162 sm_lo = bf16x2_from_bits(load_u32(rec_lo + scales));
          const __nv_bfloat162 sm_hi = bf16x2_from_bits(load_u32(rec_hi + scales));
          s_lo = __low2bfloat162(sm_lo);
          m_lo = __high2bfloat162(sm_lo);
          s_hi = __low2bfloat162(sm_hi);
          m_hi = __high2bfloat162(sm_hi);
        }
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t a[4];
          if (int2) {
            const int shift = int2_key_shift(s, 0);
            a[0] = dequantize_biased_pair(biased_codes(lo[0] >> shift, kInt2Pair), s_lo, m_lo);
            a[1] = dequantize_biased_pair(biased_codes(hi[0] >> shift, kInt2Pair), s_hi, m_hi);
            a[2] =
                dequantize_biased_pair(biased_codes(lo[0] >> (shift + 2), kInt2Pair), s_lo, m_lo);
            a[3] =
                dequantize_biased_pair(biased_codes(hi[0] >> (shift + 2), kInt2Pair), s_hi, m_hi);
          } else if (coded) {
            const int shift = 4 * int4_key_nibble(s, 0, 0);
            a[0] = dequantize_biased_pair(biased_codes(lo[s >> 1] >> shift), s_lo, m_lo);
            a[1] = dequantize_biased_pair(biased_codes(hi[s >> 1] >> shift), s_hi, m_hi);
            a[2] = dequantize_biased_pair(biased_codes(lo[s >> 1] >> (shift + 4)), s_lo, m_lo);
            a[3] = dequantize_biased_pair(biased_codes(hi[s >> 1] >> (shift + 4)), s_hi, m_hi);
            if (group == 8) {
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
          } else {
            const int offset = Content::kBytes + 2 * (16 * s + 2 * t);
            a[0] = load_u32(rec_lo + offset);
            a[1] = load_u32(rec_hi + offset);
            a[2] = load_u32(rec_lo + offset + 16);
            a[3] = load_u32(rec_hi + offset + 16);
          }
          const uint4 b = qf[32 * (4 * group + s)];
          mma_bf16_16x8x16(sc[s & 1][0], a, b.x, b.y);
          mma_bf16_16x8x16(sc[s & 1][1], a, b.z, b.w);
        }
      }
    }

    // 2. Online softmax: sc[.][n][e] is key g, sc[.][n][2 + e] key g + 8, of row 8n + 2t + e.
    float x[2][4];
    float page_max[2][2];
    const int key_lo = key0 + 16 * warp + g;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float s_lo = sc[0][n][e] + sc[1][n][e];
        const float s_hi = sc[0][n][2 + e] + sc[1][n][2 + e];
        x[n][e] = key_lo < limit[n][e] ? s_lo * p.scale_log2 : -INFINITY;
        x[n][2 + e] = key_lo + 8 < limit[n][e] ? s_hi * p.scale_log2 : -INFINITY;
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
        const float p_lo = exp2f(x[n][e] - reference);
        const float p_hi = exp2f(x[n][2 + e] - reference);
        row_sum[n][e] = row_sum[n][e] * alpha[n][e] + (p_lo + p_hi);
        uint16_t* const prob_row = probs + row * L::kProbStride + 16 * warp + g;
        prob_row[0] = __bfloat16_as_ushort(__float2bfloat16_rn(p_lo));
        prob_row[8] = __bfloat16_as_ushort(__float2bfloat16_rn(p_hi));
      }
    }
    named_barrier(1, L::kConsumers);  // P^T complete

    // 3. O^T += V^T P^T over this warp's groups 2 warp, 2 warp + 1.
#pragma unroll
    for (int gl = 0; gl < 2; ++gl)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            acc[gl][j][n][e] *= alpha[n][e];
            acc[gl][j][n][2 + e] *= alpha[n][e];
          }
#pragma unroll
    for (int ks = 0; ks < kPageTokens / 16; ++ks) {
      uint32_t b[4];  // rows 0-7: keys 16 ks + [0, 8), [8, 16); rows 8-15: the same
      ldmatrix_x4(b, shared_address(probs + (8 * (lane / 16) + lane % 8) * L::kProbStride +
                                    16 * ks + 8 * ((lane / 8) % 2)));
      const uint8_t* const keys = stage + (16 * ks + 2 * t) * p.record_bytes;
      const int rb = p.record_bytes;
#pragma unroll
      for (int gl = 0; gl < 2; ++gl) {
        const int group = 2 * warp + gl;
        const uint8_t* const scales = keys + Content::kCodeBytes + 4 * group;
        // BF16 {scale, min} of keys 2t, 2t + 1 (and + 8, + 9) -> the pairs (scale, scale), (min,
        // min) of two keys.
        const uint32_t sm0 = load_u32(scales), sm1 = load_u32(scales + rb);
        const uint32_t sm8 = load_u32(scales + 8 * rb), sm9 = load_u32(scales + 9 * rb);
        const __nv_bfloat162 scale01 = bf16x2_from_bits(__byte_perm(sm0, sm1, 0x5410));
        const __nv_bfloat162 min01 = bf16x2_from_bits(__byte_perm(sm0, sm1, 0x7632));
        const __nv_bfloat162 scale89 = bf16x2_from_bits(__byte_perm(sm8, sm9, 0x5410));
        const __nv_bfloat162 min89 = bf16x2_from_bits(__byte_perm(sm8, sm9, 0x7632));
        if constexpr (L::kInt2) {
          // Byte g % 4 of words g / 4 (m-tiles 0, 1) and g / 4 + 2 (m-tiles 2, 3) of two keys in
          // bytes 0 and 2; m-tile j's rows g and g + 8 are the codes at int2_value_shift(j) and
          // 2 more (fragment_maps.h).
          const uint8_t* const codes = keys + 16 * group + 4 * (g / 4);
          const uint32_t select = (g % 4) | (4 + g % 4) << 8;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint8_t* const word = codes + 8 * half;
            const uint32_t x01 = __byte_perm(load_u32(word), load_u32(word + rb), select);
            const uint32_t x89 =
                __byte_perm(load_u32(word + 8 * rb), load_u32(word + 9 * rb), select);
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              const int j = 2 * half + jj;
              const int shift = int2_value_shift(j);
              uint32_t a[4];
              a[0] = dequantize_biased_pair(biased_codes(x01 >> shift, kInt2Pair), scale01, min01);
              a[1] = dequantize_biased_pair(biased_codes(x01 >> (shift + 2), kInt2Pair), scale01,
                                            min01);
              a[2] = dequantize_biased_pair(biased_codes(x89 >> shift, kInt2Pair), scale89, min89);
              a[3] = dequantize_biased_pair(biased_codes(x89 >> (shift + 2), kInt2Pair), scale89,
                                            min89);
              mma_bf16_16x8x16(acc[gl][j][0], a, b[0], b[1]);
              mma_bf16_16x8x16(acc[gl][j][1], a, b[2], b[3]);
            }
          }
        } else {
          const uint8_t* const codes = keys + 32 * group + 4 * g;
          const uint32_t w0 = load_u32(codes), w1 = load_u32(codes + rb);
          const uint32_t w8 = load_u32(codes + 8 * rb), w9 = load_u32(codes + 9 * rb);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            // Byte j of two keys' code word g in bytes 0 and 2: low nibbles row g, high row g + 8.
            const uint32_t x01 = __byte_perm(w0, w1, j | (4 + j) << 8);
            const uint32_t x89 = __byte_perm(w8, w9, j | (4 + j) << 8);
            uint32_t a[4];
            a[0] = dequantize_biased_pair(biased_codes(x01), scale01, min01);
            a[1] = dequantize_biased_pair(biased_codes(x01 >> 4), scale01, min01);
            a[2] = dequantize_biased_pair(biased_codes(x89), scale89, min89);
            a[3] = dequantize_biased_pair(biased_codes(x89 >> 4), scale89, min89);
            mma_bf16_16x8x16(acc[gl][j][0], a, b[0], b[1]);
            mma_bf16_16x8x16(acc[gl][j][1], a, b[2], b[3]);
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbarrier_arrive(empty + stage_index);  // this warp is done with the stage
  }

  // Channel of an output column's row g of m-tile j (row g + 8 is the next channel).
  const auto value_channel = [](int j, int row) {
    return L::kInt2 ? int2_value_channel(j, row) : int4_value_channel(j, row);
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
  named_barrier(1, L::kConsumers);
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 8 * n + 2 * t + e;
      total[n][e] = exchange[row];
#pragma unroll
      for (int w = 1; w < L::kConsumerWarps; ++w) total[n][e] += exchange[w * L::kRows + row];
    }
  }

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
      if (item.partial < 0) {
        uint16_t* const out =
            p.out + (static_cast<int64_t>(item.batch) * rows_per_seq + row) * kLatentDim;
#pragma unroll
        for (int gl = 0; gl < 2; ++gl) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int channel = 64 * (2 * warp + gl) + value_channel(j, g);
            *reinterpret_cast<uint32_t*>(out + channel) = bf16x2_bits(
                __floats2bfloat162_rn(acc[gl][j][n][e] * inverse, acc[gl][j][n][2 + e] * inverse));
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
                make_float2(acc[gl][j][n][e] * inverse, acc[gl][j][n][2 + e] * inverse);
          }
        }
        if (warp == 0 && g == 0) p.partial_lse[item.partial * L::kRows + local_row] = lse;
      }
    }
  }
}

// One launch (instantiated per content format in decode_fragments_<content>.cu).
template <class Content, class Rope>
void launch_decode_fragments(const DecodeKernelParams& params, int blocks, cudaStream_t stream) {
  using Layout = FragmentLayout<Content, Rope>;
  launch_large_shared<mla_decode_fragments_kernel<Content, Rope>>(
      blocks, Layout::kThreads, Layout::kSharedBytes, stream, params);
}
// Compiled once each, in decode_fragments_int4_g64.cu and decode_fragments_int2_g64.cu.
extern template void launch_decode_fragments<ContentInt<4, 64>, RopeBf16>(const DecodeKernelParams&,
                                                                          int, cudaStream_t);
extern template void launch_decode_fragments<ContentInt<4, 64>, RopeInt4>(const DecodeKernelParams&,
                                                                          int, cudaStream_t);
extern template void launch_decode_fragments<ContentInt<2, 64>, RopeBf16>(const DecodeKernelParams&,
                                                                          int, cudaStream_t);
extern template void launch_decode_fragments<ContentInt<2, 64>, RopeInt4>(const DecodeKernelParams&,
                                                                          int, cudaStream_t);

}  // namespace quantmla::gpu
