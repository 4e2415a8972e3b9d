#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "quantmla/dtype.h"

namespace quantmla {
namespace {

bool is_f16_nan(uint16_t bits) { return (bits & 0x7c00u) == 0x7c00u && (bits & 0x3ffu) != 0; }

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kF64), 8u);
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_EQ(dtype_size(DType::kI8), 1u);
  EXPECT_EQ(dtype_size(DType::kBool), 1u);
  EXPECT_EQ(dtype_name(DType::kBF16), "BF16");
  EXPECT_EQ(dtype_name(DType::kBool), "BOOL");
  for (const char* name : {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"}) {
    const auto dtype = parse_dtype(name);
    ASSERT_TRUE(dtype.has_value()) << name;
    EXPECT_EQ(dtype_name(*dtype), name);
  }
  EXPECT_FALSE(parse_dtype("bf16").has_value());
  EXPECT_FALSE(parse_dtype("F8_E4M3").has_value());
  EXPECT_FALSE(parse_dtype("").has_value());
}

TEST(DType, F16ToF32KnownValues) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0400), std::ldexp(1.0f, -14));                 // smallest normal
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));                 // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03ff), std::ldexp(1023.0f, -24));              // largest subnormal
  EXPECT_EQ(std::bit_cast<uint32_t>(f16_to_f32(0x8000)), 0x80000000u);  // -0
  EXPECT_EQ(f16_to_f32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f16_to_f32(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
}

// Every half bit pattern survives the trip through float; NaNs stay NaNs with their sign, and quiet
// NaNs keep their payload exactly.
TEST(DType, F16RoundTripIsExactForAllBitPatterns) {
  for (uint32_t pattern = 0; pattern <= 0xffffu; ++pattern) {
    const auto bits = static_cast<uint16_t>(pattern);
    const float value = f16_to_f32(bits);
    const uint16_t back = f32_to_f16(value);
    if (is_f16_nan(bits)) {
      ASSERT_TRUE(std::isnan(value)) << std::hex << pattern;
      ASSERT_TRUE(is_f16_nan(back)) << std::hex << pattern;
      ASSERT_EQ(back & 0x8000u, bits & 0x8000u) << std::hex << pattern;
      ASSERT_EQ(back, bits | 0x0200u) << std::hex << pattern;  // signalling NaNs come back quiet
    } else {
      ASSERT_EQ(back, bits) << std::hex << pattern;
    }
  }
}

// The converted value must be the nearest half, ties to even: check the neighbourhood of every
// finite half against a reference built from exact double arithmetic.
TEST(DType, F32ToF16RoundsToNearestEvenAroundEveryHalf) {
  for (uint32_t pattern = 0; pattern < 0x7c00u; ++pattern) {
    const auto bits = static_cast<uint16_t>(pattern);
    const double low = f16_to_f32(bits);
    const double high = f16_to_f32(static_cast<uint16_t>(bits + 1));  // 0x7bff+1 is inf
    if (std::isinf(high)) continue;
    const double midpoint = (low + high) / 2;
    const auto below_mid = std::nextafter(static_cast<float>(midpoint), 0.0f);
    const auto above_mid =
        std::nextafter(static_cast<float>(midpoint), std::numeric_limits<float>::infinity());
    ASSERT_EQ(static_cast<double>(static_cast<float>(midpoint)), midpoint);
    ASSERT_EQ(f32_to_f16(below_mid), bits) << std::hex << pattern;
    ASSERT_EQ(f32_to_f16(above_mid), bits + 1) << std::hex << pattern;
    const uint16_t even = (bits & 1u) ? bits + 1 : bits;
    ASSERT_EQ(f32_to_f16(static_cast<float>(midpoint)), even) << std::hex << pattern;
    ASSERT_EQ(f32_to_f16(-static_cast<float>(midpoint)), even | 0x8000u) << std::hex << pattern;
  }
}

TEST(DType, F32ToF16Ties) {
  // 1 + 2^-11 lies exactly between 1 and 1 + 2^-10: ties to the even mantissa (1.0).
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3 * 2^-11 lies between 0x3c01 and 0x3c02: ties to the even 0x3c02.
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Just above the tie rounds up.
  EXPECT_EQ(f32_to_f16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // Carry from the mantissa into the exponent: 2 - 2^-11 rounds to 2.0.
  EXPECT_EQ(f32_to_f16(2.0f - std::ldexp(1.0f, -11)), 0x4000);
}

TEST(DType, F32ToF16Overflow) {
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);  // below the midpoint to 65536
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // the tie rounds to even, which is inf
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-1e30f), 0xfc00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00);
}

TEST(DType, F32ToF16Subnormals) {
  const float smallest = std::ldexp(1.0f, -24);
  EXPECT_EQ(f32_to_f16(smallest), 0x0001);
  EXPECT_EQ(f32_to_f16(-smallest), 0x8001);
  EXPECT_EQ(f32_to_f16(smallest / 2), 0x0000);  // tie between 0 and 1 unit: even is 0
  EXPECT_EQ(f32_to_f16(-smallest / 2), 0x8000);
  EXPECT_EQ(f32_to_f16(std::nextafter(smallest / 2, 1.0f)), 0x0001);
  EXPECT_EQ(f32_to_f16(smallest * 1.5f), 0x0002);  // tie between 1 and 2 units: even is 2
  EXPECT_EQ(f32_to_f16(smallest * 2.5f), 0x0002);  // tie between 2 and 3 units: even is 2
  EXPECT_EQ(f32_to_f16(smallest / 4), 0x0000);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(f32_to_f16(std::ldexp(1023.5f, -24)), 0x0400);  // rounds up into the normals
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(std::bit_cast<uint32_t>(f16_to_f32(f32_to_f16(-0.0f))), 0x80000000u);
}

TEST(DType, F32ToF16NaN) {
  const uint16_t quiet = f32_to_f16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(is_f16_nan(quiet));
  // A NaN whose payload lives only in the low float bits must not turn into inf.
  const uint16_t low_payload = f32_to_f16(std::bit_cast<float>(0xff800001u));
  EXPECT_TRUE(is_f16_nan(low_payload));
  EXPECT_EQ(low_payload & 0x8000u, 0x8000u);
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  // 1 + 2^-8 is the midpoint between 0x3f80 and 0x3f81: ties to even 0x3f80.
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  // Midpoint between 0x3f81 and 0x3f82: ties to even 0x3f82.
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f807fffu)), 0x3f80);
  // The largest finite float rounds to inf, as in torch.
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
}

TEST(DType, Bf16NaNStaysNaN) {
  // Payload only in the dropped low bits: truncation alone would produce inf.
  const uint16_t bits = f32_to_bf16(std::bit_cast<float>(0x7f800001u));
  EXPECT_TRUE(std::isnan(bf16_to_f32(bits)));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  const uint16_t negative = f32_to_bf16(std::bit_cast<float>(0xffc00000u));
  EXPECT_TRUE(std::isnan(bf16_to_f32(negative)));
  EXPECT_EQ(negative & 0x8000u, 0x8000u);
}

TEST(DType, Bf16RoundTripIsExactForAllNonNaNPatterns) {
  for (uint32_t pattern = 0; pattern <= 0xffffu; ++pattern) {
    const auto bits = static_cast<uint16_t>(pattern);
    const float value = bf16_to_f32(bits);
    if (std::isnan(value)) {
      ASSERT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(value)))) << std::hex << pattern;
    } else {
      ASSERT_EQ(f32_to_bf16(value), bits) << std::hex << pattern;
    }
  }
}

}  // namespace
}  // namespace quantmla
