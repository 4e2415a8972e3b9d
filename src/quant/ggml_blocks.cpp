// llama.cpp's q8_0 and q4_0 blocks, with the rounding of ggml's reference quantizers so that the
// bytes match what llama.cpp would store for the same values.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "quant/codec_kernels.h"
#include "quant/rounding.h"
#include "quantmla/dtype.h"

namespace quantmla {
namespace {

constexpr int kBlockValues = 32;
constexpr int kQ8BlockBytes = 2 + kBlockValues;
constexpr int kQ4BlockBytes = 2 + kBlockValues / 2;

}  // namespace

void encode_q8_0(const float* values, int64_t width, uint8_t* out) {
  for (int64_t start = 0; start < width; start += kBlockValues, out += kQ8BlockBytes) {
    const float* x = values + start;
    float absmax = 0.0f;
    for (int j = 0; j < kBlockValues; ++j) absmax = std::max(absmax, std::fabs(x[j]));
    // ggml quantizes with the FP32 d and stores it rounded to FP16.
    const float d = absmax / 127.0f;
    const float inverse_d = d != 0.0f ? 1.0f / d : 0.0f;
    store_le16(out, f32_to_f16(d));
    for (int j = 0; j < kBlockValues; ++j) {
      const int code = round_half_away_from_zero(x[j] * inverse_d);
      out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(code));
    }
  }
}

void decode_q8_0(const uint8_t* in, int64_t width, float* values) {
  for (int64_t start = 0; start < width; start += kBlockValues, in += kQ8BlockBytes) {
    const float d = f16_to_f32(load_le16(in));
    for (int j = 0; j < kBlockValues; ++j) {
      values[start + j] = d * static_cast<float>(static_cast<int8_t>(in[2 + j]));
    }
  }
}

void encode_q4_0(const float* values, int64_t width, uint8_t* out) {
  constexpr int kHalf = kBlockValues / 2;
  for (int64_t start = 0; start < width; start += kBlockValues, out += kQ4BlockBytes) {
    const float* x = values + start;
    // The value of largest magnitude, sign kept (the first one on a tie), maps to code 0: d is
    // chosen so that it lands exactly on -8 steps.
    float absmax = 0.0f;
    float extreme = 0.0f;
    for (int j = 0; j < kBlockValues; ++j) {
      if (absmax < std::fabs(x[j])) {
        absmax = std::fabs(x[j]);
        extreme = x[j];
      }
    }
    const float d = extreme / -8.0f;
    const float inverse_d = d != 0.0f ? 1.0f / d : 0.0f;
    store_le16(out, f32_to_f16(d));
    // ggml rounds by adding 8.5 and truncating; the opposite extreme reaches 16 and is clamped.
    const auto code = [&](float value) {
      return std::min(15, static_cast<int>(value * inverse_d + 8.5f));
    };
    for (int j = 0; j < kHalf; ++j) {
      out[2 + j] = static_cast<uint8_t>(code(x[j]) | code(x[j + kHalf]) << 4);
    }
  }
}

void decode_q4_0(const uint8_t* in, int64_t width, float* values) {
  constexpr int kHalf = kBlockValues / 2;
  for (int64_t start = 0; start < width; start += kBlockValues, in += kQ4BlockBytes) {
    const float d = f16_to_f32(load_le16(in));
    float* x = values + start;
    for (int j = 0; j < kHalf; ++j) {
      x[j] = static_cast<float>((in[2 + j] & 0x0f) - 8) * d;
      x[j + kHalf] = static_cast<float>((in[2 + j] >> 4) - 8) * d;
    }
  }
}

}  // namespace quantmla
