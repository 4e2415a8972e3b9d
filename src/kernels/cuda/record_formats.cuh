// Device side of the cache record formats (src/quant/records.h): one type per path format, with
// the decoder the attention kernel uses (8 channels to 8 BF16 values) and the encoder of the
// quantize-on-write kernel (one warp per record, each lane a run of channels). The dispatch switch
// in dispatch.cuh picks the types; the byte layouts are those of encode_path (cache_format.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "quantmla/gpu_mla.h"

namespace quantmla::gpu {

// RoPE frequency pairs kept in BF16 after the int4 record, ascending (PathFormat::bf16_pairs).
struct KeptPairs {
  int count;
  int pairs[kMaxKeptPairs];
};

// Records are packed back to back, so only 4-byte alignment holds for them (every supported record
// size is a multiple of 4).
__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
__device__ __forceinline__ void store_u32(uint8_t* p, uint32_t v) {
  *reinterpret_cast<uint32_t*>(p) = v;
}
__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ __nv_bfloat162 bf16x2_from_bits(uint32_t v) {
  return *reinterpret_cast<__nv_bfloat162*>(&v);
}

// Two codes placed in the low bits of each 16-bit half -> BF16 pair scale * code + min. 0x4300 |
// code is the BF16 value 128 + code (exact below 128); subtracting 128 is exact too, so the only
// roundings are those of scale and min to BF16 and of the fused multiply-add.
inline constexpr uint32_t kCodeBias = 0x43004300u;  // BF16 128.0 twice, as bits
// Two int4 or two int2 codes, one in the low bits of each half (the masks of biased_codes, shifted
// by a code's position for the fragment kernel's subnormal operands of the scores and the values).
inline constexpr uint32_t kInt4Pair = 0x000f000fu, kInt2Pair = 0x00030003u;

// (bits & mask) | bias in one LOP3 (the compiler emits an AND and an OR): with bits shifted so
// that two codes sit in the low bits of the halves and bias kCodeBias, the BF16 pair 128 + code.
__device__ __forceinline__ uint32_t biased_codes(uint32_t bits, uint32_t mask = kInt4Pair,
                                                 uint32_t bias = kCodeBias) {
  uint32_t biased;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(biased) : "r"(bits), "r"(mask), "r"(bias));
  return biased;
}

// The pair 128 + code (as bits) -> scale * code + min.
__device__ __forceinline__ uint32_t dequantize_biased_pair(uint32_t biased, __nv_bfloat162 scale,
                                                           __nv_bfloat162 minimum) {
  const __nv_bfloat162 codes = __hsub2(bf16x2_from_bits(biased), bf16x2_from_bits(kCodeBias));
  return bf16x2_bits(__hfma2(codes, scale, minimum));
}

// A uniform-int group's stored word {FP16 scale, FP16 min} -> BF16 {scale, min}: the one rounding
// every decoder applies to them.
__device__ __forceinline__ __nv_bfloat162 scale_min_bf16(uint32_t bits) {
  return __floats2bfloat162_rn(
      __half2float(__ushort_as_half(static_cast<uint16_t>(bits & 0xffffu))),
      __half2float(__ushort_as_half(static_cast<uint16_t>(bits >> 16))));
}

// {FP16 scale, FP16 min} of a uniform-int group -> BF16 pairs (scale, scale) and (min, min).
__device__ __forceinline__ void load_scale_min(const uint8_t* p, __nv_bfloat162& scale,
                                               __nv_bfloat162& minimum) {
  const __nv_bfloat162 both = scale_min_bf16(load_u32(p));
  scale = __low2bfloat162(both);
  minimum = __high2bfloat162(both);
}

// Tile column order. Decoding writes each BF16 pair where the codes make it cheapest: a 32-bit
// word of int4 codes gives pairs (channel j, j + 4) with one shift and one mask, int2 pairs
// (j, j + 8). So a path of "pair span" S stores channel 2S b + j + S e at tile column 2S b + 2j + e
// (S = 1: channel order). The kernel loads Q and writes the output through the same map.
template <int kSpan>
__host__ __device__ constexpr int channel_of_column(int column) {
  const int block = column / (2 * kSpan);
  const int offset = column % (2 * kSpan);
  return 2 * kSpan * block + offset / 2 + kSpan * (offset % 2);
}
template <int kSpan>
__host__ __device__ constexpr int column_of_channel(int channel) {
  const int block = channel / (2 * kSpan);
  const int offset = channel % (2 * kSpan);
  return 2 * kSpan * block + (offset < kSpan ? 2 * offset : 2 * (offset - kSpan) + 1);
}
static_assert(channel_of_column<4>(1) == 4 && column_of_channel<4>(4) == 1);
static_assert(channel_of_column<8>(15) == 15 && channel_of_column<8>(3) == 9);
static_assert(channel_of_column<1>(7) == 7 && column_of_channel<1>(7) == 7);

// 8 int4 codes (one 32-bit word, channel i at bits 4i) -> 4 BF16 pairs (i, i + 4), i = 0..3.
__device__ __forceinline__ uint4 dequantize_int4_word(uint32_t w, __nv_bfloat162 scale,
                                                      __nv_bfloat162 minimum) {
  uint32_t r[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    r[j] = dequantize_biased_pair(biased_codes(w >> (4 * j), kInt4Pair), scale, minimum);
  }
  return make_uint4(r[0], r[1], r[2], r[3]);
}

// 16 int2 codes (one 32-bit word, channel i at bits 2i) -> 8 BF16 pairs (i, i + 8), i = 0..7.
__device__ __forceinline__ void dequantize_int2_word(uint32_t w, __nv_bfloat162 scale,
                                                     __nv_bfloat162 minimum, uint4& lo, uint4& hi) {
  uint32_t r[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    r[j] = dequantize_biased_pair(biased_codes(w >> (2 * j), kInt2Pair), scale, minimum);
  }
  lo = make_uint4(r[0], r[1], r[2], r[3]);
  hi = make_uint4(r[4], r[5], r[6], r[7]);
}

// ---- Encoding helpers (the CPU codec's arithmetic, operation by operation, without contraction).

// Min and max over the kLanes aligned lanes of a group.
template <int kLanes>
__device__ __forceinline__ void group_range(float& lowest, float& highest) {
#pragma unroll
  for (int offset = 1; offset < kLanes; offset <<= 1) {
    lowest = fminf(lowest, __shfl_xor_sync(0xffffffffu, lowest, offset));
    highest = fmaxf(highest, __shfl_xor_sync(0xffffffffu, highest, offset));
  }
}

struct UniformIntParams {
  float scale;
  float minimum;
  uint32_t scale_min_bits;  // FP16 scale | FP16 min << 16, as stored
};

template <int kBits>
__device__ __forceinline__ UniformIntParams uniform_int_params(float lowest, float highest,
                                                               float clip) {
  constexpr float kTopCode = static_cast<float>((1 << kBits) - 1);
  const float range = __fsub_rn(__fmul_rn(clip, highest), __fmul_rn(clip, lowest));
  const __half scale_half = __float2half_rn(__fdiv_rn(range, kTopCode));
  const __half min_half = __float2half_rn(__fmul_rn(clip, lowest));
  UniformIntParams p;
  p.scale = __half2float(scale_half);
  p.minimum = __half2float(min_half);
  p.scale_min_bits = static_cast<uint32_t>(__half_as_ushort(scale_half)) |
                     static_cast<uint32_t>(__half_as_ushort(min_half)) << 16;
  return p;
}

template <int kBits>
__device__ __forceinline__ uint32_t quantize_code(float value, const UniformIntParams& p) {
  constexpr float kTopCode = static_cast<float>((1 << kBits) - 1);
  if (!(p.scale > 0.0f)) return 0;
  float level = __fdiv_rn(__fsub_rn(value, p.minimum), p.scale);
  level = level > 0.0f ? level : 0.0f;
  level = fminf(level, kTopCode);
  return __float2uint_rn(level);
}

// ---- Content path (512 channels). Decoding: 8 tile columns at a time (in the order of
// kPairSpan). Encoding: lane l holds channels [16l, 16l + 16).

// Decoding by chunk: chunk c = channels [64 c, 64 c + 64) -> 8 units of 8 BF16 values, so that a
// group's scale is converted once.
struct ContentBf16 {
  static constexpr int kBytes = kLatentDim * 2;
  static constexpr bool kIsBf16 = true;
  static constexpr int kPairSpan = 1;
  __device__ static uint4 unit(const uint8_t* rec, int u) {
    const uint8_t* p = rec + 16 * u;
    return make_uint4(load_u32(p), load_u32(p + 4), load_u32(p + 8), load_u32(p + 12));
  }
  __device__ static void chunk(const uint8_t* rec, int c, uint4 (&out)[8]) {
#pragma unroll
    for (int u = 0; u < 8; ++u) out[u] = unit(rec, 8 * c + u);
  }
  __device__ static void encode(uint8_t* rec, const float (&x)[16], int lane, float /*clip*/) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      store_u32(rec + 32 * lane + 4 * i,
                bf16x2_bits(__floats2bfloat162_rn(x[2 * i], x[2 * i + 1])));
    }
  }
};

// e4m3 codes, then one FP32 scale per 128 channels.
struct ContentFp8 {
  static constexpr int kGroup = 128;
  static constexpr int kCodeBytes = kLatentDim;
  static constexpr int kBytes = kCodeBytes + kLatentDim / kGroup * 4;
  static constexpr bool kIsBf16 = false;
  static constexpr int kPairSpan = 1;
  __device__ static void chunk(const uint8_t* rec, int c, uint4 (&out)[8]) {
    const float scale = __uint_as_float(load_u32(rec + kLatentDim + 4 * (c * 64 / kGroup)));
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const uint32_t words[2] = {load_u32(rec + 64 * c + 8 * u),
                                 load_u32(rec + 64 * c + 8 * u + 4)};
      uint32_t r[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const auto two = static_cast<__nv_fp8x2_storage_t>(words[j / 2] >> (16 * (j % 2)));
        const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3)));
        r[j] = bf16x2_bits(__floats2bfloat162_rn(v.x * scale, v.y * scale));
      }
      out[u] = make_uint4(r[0], r[1], r[2], r[3]);
    }
  }
  __device__ static void encode(uint8_t* rec, const float (&x)[16], int lane, float /*clip*/) {
    constexpr int kLanes = kGroup / 16;
    float absmax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) absmax = fmaxf(absmax, fabsf(x[i]));
#pragma unroll
    for (int offset = 1; offset < kLanes; offset <<= 1) {
      absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, offset));
    }
    float scale = __fdiv_rn(absmax, 448.0f);
    if (!(scale > 0.0f)) scale = 1.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t code =
            __nv_cvt_float_to_fp8(__fdiv_rn(x[4 * i + j], scale), __NV_SATFINITE, __NV_E4M3);
        word |= code << (8 * j);
      }
      store_u32(rec + 16 * lane + 4 * i, word);
    }
    if (lane % kLanes == 0)
      store_u32(rec + kLatentDim + 4 * (lane / kLanes), __float_as_uint(scale));
  }
};

template <int kBits, int kGroup>
struct ContentInt {
  static_assert((kBits == 4 || kBits == 2) && (kGroup == 64 || kGroup == 128));
  static constexpr int kCodeBytes = kLatentDim * kBits / 8;
  static constexpr int kBytes = kCodeBytes + kLatentDim / kGroup * 4;
  static constexpr bool kIsBf16 = false;
  static constexpr int kPairSpan = kBits == 4 ? 4 : 8;
  static constexpr int kCodeBits = kBits;
  static constexpr int kGroupChannels = kGroup;
  __device__ static void chunk(const uint8_t* rec, int c, uint4 (&out)[8]) {
    __nv_bfloat162 scale, minimum;
    load_scale_min(rec + kCodeBytes + 4 * (c * 64 / kGroup), scale, minimum);
    const uint8_t* codes = rec + 8 * kBits * c;
    if constexpr (kBits == 4) {
#pragma unroll
      for (int u = 0; u < 8; ++u)
        out[u] = dequantize_int4_word(load_u32(codes + 4 * u), scale, minimum);
    } else {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        dequantize_int2_word(load_u32(codes + 4 * w), scale, minimum, out[2 * w], out[2 * w + 1]);
      }
    }
  }
  __device__ static void encode(uint8_t* rec, const float (&x)[16], int lane, float clip) {
    constexpr int kLanes = kGroup / 16;
    float lowest = x[0], highest = x[0];
#pragma unroll
    for (int i = 1; i < 16; ++i) {
      lowest = fminf(lowest, x[i]);
      highest = fmaxf(highest, x[i]);
    }
    group_range<kLanes>(lowest, highest);
    const UniformIntParams p = uniform_int_params<kBits>(lowest, highest, clip);
    constexpr int kCodesPerWord = 32 / kBits;
#pragma unroll
    for (int w = 0; w < 16 / kCodesPerWord; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < kCodesPerWord; ++j) {
        word |= quantize_code<kBits>(x[w * kCodesPerWord + j], p) << (kBits * j);
      }
      store_u32(rec + 2 * kBits * lane + 4 * w, word);
    }
    if (lane % kLanes == 0) store_u32(rec + kCodeBytes + 4 * (lane / kLanes), p.scale_min_bits);
  }
};

// ---- RoPE path (64 channels). Decoding: unit u = tile columns [8u, 8u + 8). Encoding: lane l
// holds channels 2l and 2l + 1, frequency pair l.

struct RopeBf16 {
  static constexpr int kMaxBytes = kRopeDim * 2;
  static constexpr bool kIsBf16 = true;
  static constexpr int kPairSpan = 1;
  // unit u (channels 8u..8u+7) as load_unit's stored words, then dequantize_unit's BF16 values:
  // a kernel can issue the loads early and hide their latency behind other work.
  using Unit = uint4;
  __device__ static Unit load_unit(const uint8_t* rec, int u) { return ContentBf16::unit(rec, u); }
  __device__ static uint4 dequantize_unit(Unit words) { return words; }
  __device__ static uint4 unit(const uint8_t* rec, int u) { return load_unit(rec, u); }
  __device__ static uint32_t kept_pair(const uint8_t*, int) { return 0; }  // never kept: no pairs
  __device__ static void encode(uint8_t* rec, float x0, float x1, int lane, float,
                                const KeptPairs&) {
    store_u32(rec + 4 * lane, bf16x2_bits(__floats2bfloat162_rn(x0, x1)));
  }
};

// int4, one group of 64, then the kept pairs' BF16 values.
struct RopeInt4 {
  static constexpr int kCodeBytes = kRopeDim / 2;
  static constexpr int kBaseBytes = kCodeBytes + 4;
  static constexpr int kMaxBytes = kBaseBytes + 4 * kMaxKeptPairs;
  static constexpr bool kIsBf16 = false;
  static constexpr int kPairSpan = 4;
  // As RopeBf16's: the group's {scale, min} word and the unit's word of codes.
  struct Unit {
    uint32_t scale_min, codes;
  };
  __device__ static Unit load_unit(const uint8_t* rec, int u) {
    return {load_u32(rec + kCodeBytes), load_u32(rec + 4 * u)};
  }
  __device__ static uint4 dequantize_unit(Unit words) {
    const __nv_bfloat162 both = scale_min_bf16(words.scale_min);
    return dequantize_int4_word(words.codes, __low2bfloat162(both), __high2bfloat162(both));
  }
  // Not dequantize_unit(load_unit(...)): the tiled kernel's machine code stays as it was measured.
  __device__ static uint4 unit(const uint8_t* rec, int u) {
    __nv_bfloat162 scale, minimum;
    load_scale_min(rec + kCodeBytes, scale, minimum);
    return dequantize_int4_word(load_u32(rec + 4 * u), scale, minimum);
  }
  // The BF16 pair of the n-th kept frequency pair (the decoder overwrites its two channels).
  __device__ static uint32_t kept_pair(const uint8_t* rec, int n) {
    return load_u32(rec + kBaseBytes + 4 * n);
  }
  __device__ static void encode(uint8_t* rec, float x0, float x1, int lane, float clip,
                                const KeptPairs& kept) {
    int kept_slot = -1;
    for (int n = 0; n < kept.count; ++n) {
      if (kept.pairs[n] == lane) kept_slot = n;
    }
    // Kept channels play no part in the range and are quantized as the group's lowest other value
    // (0 when every pair is kept), as the CPU encoder does.
    float lowest = kept_slot < 0 ? fminf(x0, x1) : INFINITY;
    float highest = kept_slot < 0 ? fmaxf(x0, x1) : -INFINITY;
    group_range<32>(lowest, highest);
    if (lowest == INFINITY) lowest = highest = 0.0f;
    const UniformIntParams p = uniform_int_params<4>(lowest, highest, clip);
    const float v0 = kept_slot < 0 ? x0 : lowest;
    const float v1 = kept_slot < 0 ? x1 : lowest;
    rec[lane] = static_cast<uint8_t>(quantize_code<4>(v0, p) | quantize_code<4>(v1, p) << 4);
    if (lane == 0) store_u32(rec + kCodeBytes, p.scale_min_bits);
    if (kept_slot >= 0) {
      store_u32(rec + kBaseBytes + 4 * kept_slot, bf16x2_bits(__floats2bfloat162_rn(x0, x1)));
    }
  }
};

}  // namespace quantmla::gpu
