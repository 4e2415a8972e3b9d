// The per-codec halves of encode_path / decode_path (src/quant/codecs.cpp), and the little-endian
// stores they share. Every function expects a format and width that check_path_width accepted.
#pragma once

#include <cstdint>

namespace quantmla {

inline void store_le16(uint8_t* out, uint16_t value) {
  out[0] = static_cast<uint8_t>(value);
  out[1] = static_cast<uint8_t>(value >> 8);
}
inline uint16_t load_le16(const uint8_t* in) {
  return static_cast<uint16_t>(in[0] | static_cast<uint16_t>(in[1]) << 8);
}
inline void store_le32(uint8_t* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}
inline uint32_t load_le32(const uint8_t* in) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= static_cast<uint32_t>(in[i]) << (8 * i);
  return value;
}

// Asymmetric uniform codes of `bits` (8, 4 or 2) per `group` channels, FP16 scale and min.
void encode_uniform_int(int bits, int group, float clip, const float* values, int64_t width,
                        uint8_t* out);
void decode_uniform_int(int bits, int group, const uint8_t* in, int64_t width, float* values);

// e4m3 codes with one FP32 scale per `group` channels.
void encode_fp8(int group, const float* values, int64_t width, uint8_t* out);
void decode_fp8(int group, const uint8_t* in, int64_t width, float* values);

// llama.cpp blocks of 32 values.
void encode_q8_0(const float* values, int64_t width, uint8_t* out);
void decode_q8_0(const uint8_t* in, int64_t width, float* values);
void encode_q4_0(const float* values, int64_t width, uint8_t* out);
void decode_q4_0(const uint8_t* in, int64_t width, float* values);

}  // namespace quantmla
