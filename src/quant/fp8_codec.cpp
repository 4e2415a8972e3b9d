// OCP FP8 e4m3 ("e4m3fn") scalar conversions and the grouped fp8 codec built on them.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "quant/codec_kernels.h"
#include "quant/rounding.h"
#include "quantmla/cache_format.h"

namespace quantmla {
namespace {

constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3MaxCode = 0x7e;
constexpr uint8_t kE4M3NaNCode = 0x7f;
constexpr float kE4M3MinNormal = 0x1p-6f;
constexpr float kE4M3SubnormalSteps = 0x1p9f;                 // subnormals are multiples of 2^-9
constexpr uint32_t kF32ToE4M3ExponentShift = (127 - 7) << 3;  // bias difference, in code units

// sign | exponent (4 bits, bias 7) | mantissa (3 bits); exponent 0 holds the subnormals m * 2^-9;
// S.1111.111 is NaN and there is no infinity.
constexpr std::array<float, 256> build_e4m3_values() {
  std::array<float, 256> values{};
  for (uint32_t code = 0; code < 256; ++code) {
    const uint32_t exponent = (code >> 3) & 0xfu;
    const uint32_t mantissa = code & 0x7u;
    float magnitude;
    if ((code & 0x7fu) == kE4M3NaNCode) {
      magnitude = std::numeric_limits<float>::quiet_NaN();
    } else if (exponent == 0) {
      magnitude = static_cast<float>(mantissa) / kE4M3SubnormalSteps;
    } else {
      magnitude = std::bit_cast<float>(((code & 0x7fu) + kF32ToE4M3ExponentShift) << 20);
    }
    values[code] = (code & 0x80u) ? -magnitude : magnitude;
  }
  return values;
}
constexpr std::array<float, 256> kE4M3Values = build_e4m3_values();

}  // namespace

uint8_t f32_to_e4m3(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const float magnitude = std::fabs(value);
  if (std::isnan(value)) return sign | kE4M3NaNCode;
  // Saturate (inf included): the "fn" variant has no infinity to overflow into.
  if (magnitude >= kE4M3Max) return sign | kE4M3MaxCode;
  if (magnitude < kE4M3MinNormal) {
    // Scaling by 2^9 is exact; rounding 7.5+ up to 8 yields 0x08, the smallest normal, as it
    // should.
    return sign |
           static_cast<uint8_t>(round_half_even_nonnegative(magnitude * kE4M3SubnormalSteps));
  }
  // Keep float's exponent and top 3 mantissa bits, rounding the 20 dropped bits to nearest even
  // without a branch (random values mispredict one): adding half - 1, plus 1 where the kept part is
  // odd, carries into the kept bits exactly when the dropped part is above half, or half with an
  // odd kept part. A carry out of the mantissa moves to the next binade, which is right; below 448
  // none passes it.
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  const uint32_t kept = (magnitude_bits + 0x7ffffu + ((magnitude_bits >> 20) & 1u)) >> 20;
  return sign | static_cast<uint8_t>(kept - kF32ToE4M3ExponentShift);
}

float e4m3_to_f32(uint8_t code) { return kE4M3Values[code]; }

void encode_fp8(int group, const float* values, int64_t width, uint8_t* out) {
  uint8_t* scales = out + width;
  for (int64_t start = 0; start < width; start += group) {
    const float* x = values + start;
    float absmax = 0.0f;
    for (int i = 0; i < group; ++i) absmax = std::max(absmax, std::fabs(x[i]));
    float scale = absmax / kE4M3Max;
    // An all-zero group (or one so small that the scale underflows) keeps scale 1 instead of
    // dividing by zero.
    if (!(scale > 0.0f)) scale = 1.0f;
    for (int i = 0; i < group; ++i) out[start + i] = f32_to_e4m3(x[i] / scale);
    store_le32(scales, std::bit_cast<uint32_t>(scale));
    scales += 4;
  }
}

void decode_fp8(int group, const uint8_t* in, int64_t width, float* values) {
  const uint8_t* scales = in + width;
  for (int64_t start = 0; start < width; start += group) {
    const float scale = std::bit_cast<float>(load_le32(scales));
    scales += 4;
    for (int i = 0; i < group; ++i) values[start + i] = e4m3_to_f32(in[start + i]) * scale;
  }
}

}  // namespace quantmla
