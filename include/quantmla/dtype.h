// Element types of checkpoint tensors and scalar conversions between them.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace quantmla {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// Bytes per element.
size_t dtype_size(DType dtype);
// Safetensors spelling: "F32", "BF16", ...
std::string_view dtype_name(DType dtype);
std::optional<DType> parse_dtype(std::string_view name);

inline float bf16_to_f32(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// Round to nearest even, NaN stays NaN (as torch does).
inline uint16_t f32_to_bf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// IEEE binary16 <-> binary32, round to nearest even, subnormals and inf/NaN handled.
float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

}  // namespace quantmla
