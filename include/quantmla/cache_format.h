// Storage formats of the two MLA cache paths (content latent c, RoPE key k_pe), chosen per path by
// one spec string, e.g. "content=int4:g64,rope=int4:g64:clip0.95". DESIGN §3.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace quantmla {

enum class Codec {
  kF32,   // 4 bytes per value, exact
  kBF16,  // 2 bytes per value, round to nearest even
  kFP8,   // e4m3 (OCP "fn": max 448, no inf) codes + one FP32 scale per `group` (128) channels
  kInt8,  // asymmetric uniform per group: codes in [0, 2^b - 1], FP16 scale + FP16 min per group
  kInt4,
  kInt2,
  kQ8_0,  // llama.cpp block: FP16 d, 32 x int8 q, value = d * q
  kQ4_0,  // llama.cpp block: FP16 d, 16 bytes of (q + 8) nibbles, value = d * (nibble - 8)
};

struct PathFormat {
  Codec codec = Codec::kBF16;
  int group = 0;      // channels per scale: int* 32|64|128, fp8 128, q8_0/q4_0 32, 0 for f32/bf16
  float clip = 1.0f;  // int* only: the group's [min, max] is scaled by this ratio, in (0, 1]
  // int* only: frequency pairs i (channels 2i and 2i + 1) stored in BF16 after the base record,
  // sorted and unique. On the RoPE key one or two high-energy pairs would otherwise set their
  // group's range and cost the other pairs most of their resolution (DESIGN §9). The "= {}" spares
  // aggregate initializations that leave it out ({codec, group, clip}) GCC's
  // -Wmissing-field-initializers.
  std::vector<int> bf16_pairs = {};

  // Bits per code (32, 16, 8, 4, 2).
  int bits() const;
  // Bytes of one encoded vector of `width` values, scales and kept BF16 pairs included. Throws
  // InvalidArgument when width is not a multiple of the group or a kept pair lies beyond it.
  int64_t encoded_bytes(int64_t width) const;
  // Canonical spelling: "f32", "bf16", "fp8", "int4:g64", "int4:g64:clip0.9", "q4_0",
  // "int4:g64:clip0.9:bf16pairs=5+21" (clip before pairs, pairs ascending).
  std::string to_string() const;
  // Parses one path's spelling (the part after "content=" / "rope="). Throws InvalidArgument
  // naming the text and what is accepted.
  static PathFormat parse(std::string_view text);
  bool operator==(const PathFormat&) const = default;
};

struct CacheFormat {
  PathFormat content;  // default bf16
  PathFormat rope;     // default bf16

  // Exact FP32 on both paths: the reference every other format is measured against.
  static CacheFormat f32() { return {{Codec::kF32}, {Codec::kF32}}; }

  // "content=SPEC,rope=SPEC" (either key may be left out and defaults to bf16; keys may come in
  // either order; "f32" alone means both paths f32). Throws InvalidArgument.
  static CacheFormat parse(std::string_view spec);
  std::string to_string() const;  // "content=int4:g64,rope=bf16"
  // Bytes of one token's record in one layer: content then RoPE, no padding between or after.
  int64_t record_bytes(int64_t kv_lora_rank, int64_t rope_dim) const;
  bool operator==(const CacheFormat&) const = default;
};

// Encodes `width` values into `out` (format.encoded_bytes(width) bytes) and back. Layouts:
// - f32 / bf16: values in channel order, little-endian.
// - int8/int4/int2: all codes first, packed little-endian within a byte with the lowest channel in
//   the lowest bits (int4: byte i = ch 2i | ch 2i+1 << 4); then per group {FP16 scale, FP16 min}.
//   scale = (max' - min') / (2^b - 1) with max' = clip * max, min' = clip * min; scale and min are
//   rounded to FP16 first and the codes computed with the rounded values:
//   q = clamp(round_half_even((x - min) / scale), 0, 2^b - 1); value = scale * q + min.
//   With bf16_pairs, the kept channels play no part in their group's min and max (the encoder
//   quantizes them as the lowest other value of the group, or 0 in a group of kept channels only)
//   and their codes are ignored on decoding; after the {scale, min} pairs come, per kept pair in
//   ascending order, the BF16 values (round to nearest even, NaN kept) of channels 2i and 2i + 1.
// - fp8: all e4m3 codes, then one FP32 scale per group (absmax / 448; 1 when the group is zero).
// - q8_0 / q4_0: consecutive llama.cpp blocks (ggml's quantize_row_q8_0 / q4_0 rounding; q4_0
//   packs element j in the low nibble and j + 16 in the high nibble of byte j).
void encode_path(const PathFormat& format, const float* values, int64_t width, uint8_t* out);
void decode_path(const PathFormat& format, const uint8_t* in, int64_t width, float* values);

// OCP FP8 e4m3 ("e4m3fn") scalar conversions: round to nearest even, saturate to +-448, NaN kept.
uint8_t f32_to_e4m3(float value);
float e4m3_to_f32(uint8_t code);

}  // namespace quantmla
