// In-memory layout of one encoded path vector of `kWidth` values, per codec, as encode_path writes
// it (include/quantmla/cache_format.h). The sizes are checked against the formulas of
// PathFormat::encoded_bytes here for the production widths and in tests/test_decode_rows.cpp for
// every format the parser accepts, so a codec and its SIMD decoder cannot drift apart unnoticed.
// Multi-byte fields are little-endian: the structs describe the bytes on x86 hosts only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace quantmla {

// Channels per scale of the fixed-group codecs.
inline constexpr int kFp8Group = 128;
inline constexpr int kGgmlBlockValues = 32;

template <int kWidth>
struct F32Record {
  float values[kWidth];
};

template <int kWidth>
struct Bf16Record {
  uint16_t values[kWidth];  // the top half of the FP32 bits, rounded to nearest even
};

// e4m3 codes of every channel, then one FP32 scale per kGroup (128, or 64 on the RoPE path).
template <int kGroup, int kWidth>
requires(kWidth % kGroup == 0) struct Fp8Record {
  uint8_t codes[kWidth];
  float scales[kWidth / kGroup];
};

// int8 / int4 / int2: every code first (lowest channel in the lowest bits of a byte), then per
// group an FP16 {scale, min} pair.
template <int kBits, int kGroup, int kWidth>
requires((kBits == 8 || kBits == 4 || kBits == 2) && kWidth % kGroup == 0) struct UniformIntRecord {
  static constexpr int kCodeBytes = kWidth * kBits / 8;
  uint8_t codes[kCodeBytes];
  uint16_t scale_min[kWidth / kGroup][2];
};

// A uniform-int record that keeps kPairs frequency pairs in BF16 (PathFormat::bf16_pairs): the
// base record unchanged, the kept channels' codes included (stored but ignored: 4 bits per kept
// channel at int4, paid so that the SIMD decoder runs unchanged and patches the kept channels
// after), then per kept pair, ascending, the BF16 values of channels 2i and 2i + 1.
inline constexpr int kBf16PairBytes = 4;
template <int kBits, int kGroup, int kWidth, int kPairs>
requires(kWidth % kGroup == 0 && kPairs >= 1 &&
         2 * kPairs <= kWidth) struct UniformIntKeptPairsRecord {
  UniformIntRecord<kBits, kGroup, kWidth> base;
  uint16_t pairs[kPairs][2];
};

// ggml's block_q8_0: value j = d * qs[j].
struct Q8_0Block {
  uint16_t d;  // FP16
  int8_t qs[kGgmlBlockValues];
};

// ggml's block_q4_0: value j = d * ((qs[j] & 15) - 8), value j + 16 = d * ((qs[j] >> 4) - 8).
struct Q4_0Block {
  uint16_t d;  // FP16
  uint8_t qs[kGgmlBlockValues / 2];
};

template <typename Block, int kWidth>
requires(kWidth % kGgmlBlockValues == 0) struct GgmlRecord {
  Block blocks[kWidth / kGgmlBlockValues];
};
template <int kWidth>
using Q8_0Record = GgmlRecord<Q8_0Block, kWidth>;
template <int kWidth>
using Q4_0Record = GgmlRecord<Q4_0Block, kWidth>;

// Production widths (DeepSeek's kv_lora_rank and qk_rope_head_dim): content 512, RoPE 64. The
// records are packed back to back in a cache page, so none of them may carry padding.
static_assert(sizeof(Q8_0Block) == 34 && sizeof(Q4_0Block) == 18);

static_assert(sizeof(F32Record<512>) == 2048 && sizeof(F32Record<64>) == 256);
static_assert(sizeof(Bf16Record<512>) == 1024 && sizeof(Bf16Record<64>) == 128);
static_assert(sizeof(Fp8Record<kFp8Group, 512>) == 512 + 4 * 4);
static_assert(sizeof(Fp8Record<kFp8Group / 2, 64>) == 64 + 1 * 4);

static_assert(sizeof(UniformIntRecord<8, 32, 512>) == 512 + 16 * 4);
static_assert(sizeof(UniformIntRecord<8, 64, 512>) == 512 + 8 * 4);
static_assert(sizeof(UniformIntRecord<8, 128, 512>) == 512 + 4 * 4);
static_assert(sizeof(UniformIntRecord<4, 32, 512>) == 256 + 16 * 4);
static_assert(sizeof(UniformIntRecord<4, 64, 512>) == 256 + 8 * 4);
static_assert(sizeof(UniformIntRecord<4, 128, 512>) == 256 + 4 * 4);
static_assert(sizeof(UniformIntRecord<2, 32, 512>) == 128 + 16 * 4);
static_assert(sizeof(UniformIntRecord<2, 64, 512>) == 128 + 8 * 4);
static_assert(sizeof(UniformIntRecord<2, 128, 512>) == 128 + 4 * 4);
// RoPE: g128 does not divide 64 channels.
static_assert(sizeof(UniformIntRecord<8, 32, 64>) == 64 + 2 * 4);
static_assert(sizeof(UniformIntRecord<8, 64, 64>) == 64 + 1 * 4);
static_assert(sizeof(UniformIntRecord<4, 32, 64>) == 32 + 2 * 4);
static_assert(sizeof(UniformIntRecord<4, 64, 64>) == 32 + 1 * 4);
static_assert(sizeof(UniformIntRecord<2, 32, 64>) == 16 + 2 * 4);
static_assert(sizeof(UniformIntRecord<2, 64, 64>) == 16 + 1 * 4);
// The {scale, min} pairs follow the codes without a gap (the decoders find them at width * bits /
// 8).
using Int2Rope = UniformIntRecord<2, 32, 64>;
static_assert(offsetof(Int2Rope, scale_min) == Int2Rope::kCodeBytes);
// The production RoPE format with the two highest-energy pairs kept ("int4:g64:bf16pairs=I+J"):
// 36 bytes of base record, then 2 x 4 bytes of BF16 pairs.
using Int4RopeTwoPairs = UniformIntKeptPairsRecord<4, 64, 64, 2>;
static_assert(sizeof(Int4RopeTwoPairs) == 44);  // 36 + 2 x kBf16PairBytes
static_assert(offsetof(Int4RopeTwoPairs, pairs) == sizeof(UniformIntRecord<4, 64, 64>));
static_assert(sizeof(UniformIntKeptPairsRecord<2, 32, 64, 3>) == 24 + 3 * kBf16PairBytes);

static_assert(sizeof(Q8_0Record<512>) == 16 * 34 && sizeof(Q8_0Record<64>) == 2 * 34);
static_assert(sizeof(Q4_0Record<512>) == 16 * 18 && sizeof(Q4_0Record<64>) == 2 * 18);

}  // namespace quantmla
