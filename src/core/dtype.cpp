#include "quantmla/dtype.h"

#include <array>
#include <cstring>

namespace quantmla {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DTypeInfo, 10> kDTypes = {{
    {DType::kF64, "F64", 8},
    {DType::kF32, "F32", 4},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kI64, "I64", 8},
    {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
}};

// kDTypes is indexed by the enumerator value.
constexpr bool table_matches_enum() {
  for (size_t i = 0; i < kDTypes.size(); ++i) {
    if (static_cast<size_t>(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(table_matches_enum());

const DTypeInfo& info(DType dtype) { return kDTypes[static_cast<size_t>(dtype)]; }

constexpr uint32_t kF32SignMask = 0x80000000u;
constexpr uint32_t kF32ExponentBias = 127;
constexpr uint32_t kF16ExponentBias = 15;
constexpr uint16_t kF16Infinity = 0x7c00u;
constexpr uint16_t kF16QuietBit = 0x0200u;

}  // namespace

size_t dtype_size(DType dtype) { return info(dtype).size; }

std::string_view dtype_name(DType dtype) { return info(dtype).name; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (const DTypeInfo& entry : kDTypes) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;

  if (exponent == 0x1f) {
    // Inf stays inf; a NaN keeps its payload (and so its quiet/signalling bit).
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign);
    // Subnormal half: every one is a normal float. Shift the leading 1 up to the implicit position.
    int32_t unbiased = 1 - static_cast<int32_t>(kF16ExponentBias);
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --unbiased;
    }
    mantissa &= 0x3ffu;
    const uint32_t f32_exponent = static_cast<uint32_t>(unbiased + kF32ExponentBias);
    return std::bit_cast<float>(sign | (f32_exponent << 23) | (mantissa << 13));
  }
  const uint32_t f32_exponent = exponent - kF16ExponentBias + kF32ExponentBias;
  return std::bit_cast<float>(sign | (f32_exponent << 23) | (mantissa << 13));
}

uint16_t f32_to_f16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits & kF32SignMask) >> 16);
  const uint32_t exponent = (bits >> 23) & 0xffu;
  const uint32_t mantissa = bits & 0x7fffffu;

  if (exponent == 0xff) {
    if (mantissa == 0) return sign | kF16Infinity;
    // Keep the top payload bits and force the quiet bit so the result cannot collapse into inf
    // (hardware F16C conversion behaves the same way).
    return sign | kF16Infinity | kF16QuietBit | static_cast<uint16_t>(mantissa >> 13);
  }

  const int32_t unbiased = static_cast<int32_t>(exponent) - static_cast<int32_t>(kF32ExponentBias);
  if (unbiased > 15) return sign | kF16Infinity;

  // Express the result as an integer count of half-precision units before rounding: for normals the
  // unit is one mantissa step, for subnormals 2^-24. `shift` is how many low bits are dropped.
  uint32_t significand;
  uint32_t shift;
  uint32_t biased_part;
  if (unbiased >= -14) {
    significand = mantissa;
    shift = 13;
    biased_part = static_cast<uint32_t>(unbiased + static_cast<int32_t>(kF16ExponentBias)) << 10;
  } else {
    // Float subnormals and anything below half the smallest half subnormal round to zero.
    if (exponent == 0 || unbiased < -25) return sign;
    significand = mantissa | 0x800000u;
    shift = static_cast<uint32_t>(-unbiased - 1);
    biased_part = 0;
  }

  uint32_t result = biased_part + (significand >> shift);
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1);
  // A carry out of the mantissa bumps the exponent, which is exactly right (up to inf at the top).
  if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
  return sign | static_cast<uint16_t>(result);
}

}  // namespace quantmla
