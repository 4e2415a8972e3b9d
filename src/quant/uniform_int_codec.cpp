// int8 / int4 / int2: asymmetric uniform quantization per group with FP16 scale and min (DESIGN
// §3).
#include <algorithm>
#include <cstdint>

#include "quant/codec_kernels.h"
#include "quant/rounding.h"
#include "quantmla/dtype.h"

namespace quantmla {
namespace {

// Groups are multiples of 32 channels, so every group starts on a byte boundary of the codes.
template <int kBits>
void encode_groups(int group, float clip, const float* values, int64_t width, uint8_t* out) {
  constexpr int kCodesPerByte = 8 / kBits;
  constexpr float kTopCode = static_cast<float>((1 << kBits) - 1);
  uint8_t* codes = out;
  uint8_t* scales = out + width * kBits / 8;
  for (int64_t start = 0; start < width; start += group) {
    const float* x = values + start;
    float lowest = x[0];
    float highest = x[0];
    for (int i = 1; i < group; ++i) {
      lowest = std::min(lowest, x[i]);
      highest = std::max(highest, x[i]);
    }
    const uint16_t scale_bits = f32_to_f16((clip * highest - clip * lowest) / kTopCode);
    const uint16_t min_bits = f32_to_f16(clip * lowest);
    // Codes are computed against the stored (FP16-rounded) scale and min, which the decoder sees.
    const float scale = f16_to_f32(scale_bits);
    const float minimum = f16_to_f32(min_bits);
    // A zero scale (a constant group, or a range below FP16's smallest subnormal) would divide by
    // zero: every code is 0 and the group decodes to its min.
    const bool has_range = scale > 0.0f;
    const auto quantize = [&](float value) -> uint32_t {
      if (!has_range) return 0;
      float level = (value - minimum) / scale;
      level = level > 0.0f ? level : 0.0f;  // also maps NaN to code 0
      level = std::min(level, kTopCode);
      return static_cast<uint32_t>(round_half_even_nonnegative(level));
    };
    for (int i = 0; i < group; i += kCodesPerByte) {
      uint32_t byte = 0;
      for (int j = 0; j < kCodesPerByte; ++j) byte |= quantize(x[i + j]) << (j * kBits);
      *codes++ = static_cast<uint8_t>(byte);
    }
    store_le16(scales, scale_bits);
    store_le16(scales + 2, min_bits);
    scales += 4;
  }
}

template <int kBits>
void decode_groups(int group, const uint8_t* in, int64_t width, float* values) {
  constexpr int kCodesPerByte = 8 / kBits;
  constexpr uint32_t kCodeMask = (1u << kBits) - 1u;
  const uint8_t* codes = in;
  const uint8_t* scales = in + width * kBits / 8;
  for (int64_t start = 0; start < width; start += group) {
    const float scale = f16_to_f32(load_le16(scales));
    const float minimum = f16_to_f32(load_le16(scales + 2));
    scales += 4;
    float* x = values + start;
    for (int i = 0; i < group; i += kCodesPerByte) {
      const uint32_t byte = *codes++;
      for (int j = 0; j < kCodesPerByte; ++j) {
        const auto code = static_cast<float>((byte >> (j * kBits)) & kCodeMask);
        x[i + j] = scale * code + minimum;
      }
    }
  }
}

}  // namespace

void encode_uniform_int(int bits, int group, float clip, const float* values, int64_t width,
                        uint8_t* out) {
  switch (bits) {
    case 8:
      return encode_groups<8>(group, clip, values, width, out);
    case 4:
      return encode_groups<4>(group, clip, values, width, out);
    default:
      return encode_groups<2>(group, clip, values, width, out);
  }
}

void decode_uniform_int(int bits, int group, const uint8_t* in, int64_t width, float* values) {
  switch (bits) {
    case 8:
      return decode_groups<8>(group, in, width, values);
    case 4:
      return decode_groups<4>(group, in, width, values);
    default:
      return decode_groups<2>(group, in, width, values);
  }
}

}  // namespace quantmla
