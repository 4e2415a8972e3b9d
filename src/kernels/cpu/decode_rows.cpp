// AVX2 decoders of every path format, one per layout tag of quant/path_dispatch.h. Each computes
// what the scalar codec computes, in the same order and with the same roundings (scale * code,
// then + min; FP16 parameters widened exactly by F16C), so the output is bit-identical to
// decode_path. The file is built with -ffp-contract=off and its kernels without the FMA target, so
// no multiply-add can be fused into one rounding behind our back.
#include "kernels/cpu/decode_rows.h"

#include <cpuid.h>
#include <immintrin.h>

#include <cstddef>
#include <cstring>
#include <limits>
#include <string>

#include "quant/codec_kernels.h"
#include "quant/format_checks.h"
#include "quant/kept_pairs.h"
#include "quant/path_dispatch.h"
#include "quantmla/cache_format.h"
#include "quantmla/error.h"

namespace quantmla::cpu {
namespace {

// Rejects what decode_path would reject and strides that make rows overlap; the message names the
// numbers.
void check_rows(const PathFormat& format, int64_t record_stride_bytes, int64_t count, int64_t width,
                int64_t out_stride) {
  const int64_t record_bytes = format.encoded_bytes(width);
  const auto error = [&](const std::string& what) {
    return InvalidArgument("decode_rows (" + format.to_string() + ", width " +
                           std::to_string(width) + "): " + what);
  };
  if (count < 0) throw error("negative count " + std::to_string(count));
  if (count > 1 && record_stride_bytes < record_bytes) {
    throw error("record stride " + std::to_string(record_stride_bytes) + " bytes is below the " +
                std::to_string(record_bytes) + " bytes of one encoded vector");
  }
  if (count > 1 && out_stride < width) {
    throw error("output stride " + std::to_string(out_stride) + " is below the width");
  }
}

// --- AVX2 + F16C ------------------------------------------------------------------------------

// 32 codes, one byte each, in channel order.
struct CodeBytes {
  __m128i channels_0_15;
  __m128i channels_16_31;
};

// The 32 codes of kBits bits that start at `codes` (kBits * 4 bytes, lowest channel in the lowest
// bits of a byte).
template <int kBits>
__attribute__((target("avx2,f16c"))) inline CodeBytes unpack_codes32(const uint8_t* codes) {
  if constexpr (kBits == 8) {
    return {_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))};
  } else if constexpr (kBits == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i nibble = _mm_set1_epi8(0x0f);
    const __m128i even = _mm_and_si128(bytes, nibble);                    // channels 2i
    const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);  // channels 2i + 1
    return {_mm_unpacklo_epi8(even, odd), _mm_unpackhi_epi8(even, odd)};
  } else {
    static_assert(kBits == 2);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
    const __m128i pair = _mm_set1_epi8(0x03);
    // field[j] holds channel 4i + j of byte i.
    const __m128i field0 = _mm_and_si128(bytes, pair);
    const __m128i field1 = _mm_and_si128(_mm_srli_epi16(bytes, 2), pair);
    const __m128i field2 = _mm_and_si128(_mm_srli_epi16(bytes, 4), pair);
    const __m128i field3 = _mm_and_si128(_mm_srli_epi16(bytes, 6), pair);
    const __m128i fields01 = _mm_unpacklo_epi8(field0, field1);
    const __m128i fields23 = _mm_unpacklo_epi8(field2, field3);
    return {_mm_unpacklo_epi16(fields01, fields23), _mm_unpackhi_epi16(fields01, fields23)};
  }
}

// Bytes 0..7 and 8..15 of 16 code bytes as int32 lanes.
__attribute__((target("avx2,f16c"))) inline __m256i codes_0_7(__m128i bytes) {
  return _mm256_cvtepu8_epi32(bytes);
}
__attribute__((target("avx2,f16c"))) inline __m256i codes_8_15(__m128i bytes) {
  return _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));
}

// Broadcast of the FP16 value at `bytes`, widened exactly.
__attribute__((target("avx2,f16c"))) inline __m256 broadcast_f16(const uint8_t* bytes) {
  return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(load_le16(bytes))));
}

__attribute__((target("avx2,f16c"))) inline void decode_row(F32Path, const uint8_t* record,
                                                            int64_t width, float* out) {
  std::memcpy(out, record, static_cast<size_t>(width) * sizeof(float));
}

__attribute__((target("avx2,f16c"))) inline void decode_row(Bf16Path, const uint8_t* record,
                                                            int64_t width, float* out) {
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 2 * i));
    _mm256_storeu_ps(out + i,
                     _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
  }
  for (; i < width; ++i) {  // widths that are no multiple of 8 (test shapes)
    const uint32_t bits =
        static_cast<uint32_t>(record[2 * i]) << 16 | static_cast<uint32_t>(record[2 * i + 1]) << 24;
    std::memcpy(out + i, &bits, sizeof(bits));
  }
}

// e4m3 codes (int32 lanes) to the FP32 values of e4m3_to_f32, by integer arithmetic on the bits:
// a gather from a 256-entry table costs several times more. Normal codes keep their exponent and
// mantissa bits, rebiased; subnormals (m * 2^-9, m < 8) come from an exact int -> float conversion
// and a power-of-two product that never meets a subnormal float, whatever MXCSR says about them.
__attribute__((target("avx2,f16c"))) inline __m256 e4m3_to_f32x8(__m256i codes) {
  constexpr int kBiasShift = (127 - 7) << 23;  // e4m3 exponent bias 7, FP32 127
  const __m256i magnitude = _mm256_and_si256(codes, _mm256_set1_epi32(0x7f));
  const __m256i normal =
      _mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(kBiasShift));
  const __m256 subnormal =
      _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(0x1p-9f));  // m < 8 there
  const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude);
  const __m256i is_nan = _mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7f));
  __m256 value =
      _mm256_blendv_ps(_mm256_castsi256_ps(normal), subnormal, _mm256_castsi256_ps(is_subnormal));
  value = _mm256_blendv_ps(value, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                           _mm256_castsi256_ps(is_nan));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

template <int kGroup>
__attribute__((target("avx2,f16c"))) inline void decode_row(Fp8Path<kGroup>, const uint8_t* record,
                                                            int64_t width, float* out) {
  const uint8_t* scales = record + width;  // Fp8Record::scales
  for (int64_t start = 0; start < width; start += kGroup, scales += sizeof(float)) {
    const __m256 scale =
        _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(load_le32(scales))));
    for (int64_t i = start; i < start + kGroup; i += 8) {
      const __m256i codes =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(record + i)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(e4m3_to_f32x8(codes), scale));
    }
  }
}

template <int kBits, int kGroup>
__attribute__((target("avx2,f16c"))) inline void decode_row(UniformIntPath<kBits, kGroup>,
                                                            const uint8_t* record, int64_t width,
                                                            float* out) {
  const uint8_t* codes = record;                          // UniformIntRecord::codes
  const uint8_t* scale_min = record + width * kBits / 8;  // UniformIntRecord::scale_min
  for (int64_t start = 0; start < width; start += kGroup, scale_min += 4) {
    const __m128 pair = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_le32(scale_min))));
    const __m256 scale = _mm256_broadcastss_ps(pair);
    const __m256 minimum = _mm256_broadcastss_ps(_mm_movehdup_ps(pair));
    for (int64_t i = start; i < start + kGroup; i += 32) {
      const CodeBytes bytes = unpack_codes32<kBits>(codes + i * kBits / 8);
      const __m256i lanes[4] = {codes_0_7(bytes.channels_0_15), codes_8_15(bytes.channels_0_15),
                                codes_0_7(bytes.channels_16_31), codes_8_15(bytes.channels_16_31)};
      for (int k = 0; k < 4; ++k) {
        const __m256 code = _mm256_cvtepi32_ps(lanes[k]);
        _mm256_storeu_ps(out + i + 8 * k, _mm256_add_ps(_mm256_mul_ps(scale, code), minimum));
      }
    }
  }
}

__attribute__((target("avx2,f16c"))) inline void decode_row(Q8_0Path, const uint8_t* record,
                                                            int64_t width, float* out) {
  for (int64_t start = 0; start < width; start += kGgmlBlockValues, record += sizeof(Q8_0Block)) {
    const __m256 d = broadcast_f16(record + offsetof(Q8_0Block, d));
    const uint8_t* qs = record + offsetof(Q8_0Block, qs);
    for (int j = 0; j < kGgmlBlockValues; j += 8) {
      const __m256i q =
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + j)));
      _mm256_storeu_ps(out + start + j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
    }
  }
}

__attribute__((target("avx2,f16c"))) inline void decode_row(Q4_0Path, const uint8_t* record,
                                                            int64_t width, float* out) {
  const __m128i low_nibbles = _mm_set1_epi8(0x0f);
  const __m256i offset = _mm256_set1_epi32(8);
  for (int64_t start = 0; start < width; start += kGgmlBlockValues, record += sizeof(Q4_0Block)) {
    const __m256 d = broadcast_f16(record + offsetof(Q4_0Block, d));
    const __m128i qs =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(record + offsetof(Q4_0Block, qs)));
    // Elements 0..15 sit in the low nibbles, 16..31 in the high ones.
    const __m128i halves[2] = {_mm_and_si128(qs, low_nibbles),
                               _mm_and_si128(_mm_srli_epi16(qs, 4), low_nibbles)};
    const __m256i lanes[4] = {codes_0_7(halves[0]), codes_8_15(halves[0]), codes_0_7(halves[1]),
                              codes_8_15(halves[1])};
    for (int k = 0; k < 4; ++k) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(lanes[k], offset));
      _mm256_storeu_ps(out + start + 8 * k, _mm256_mul_ps(q, d));
    }
  }
}

template <typename Path>
__attribute__((target("avx2,f16c"))) void decode_rows_avx2(Path path, const uint8_t* record,
                                                           int64_t record_stride_bytes,
                                                           int64_t count, int64_t width, float* out,
                                                           int64_t out_stride) {
  for (int64_t row = 0; row < count; ++row) {
    decode_row(path, record + row * record_stride_bytes, width, out + row * out_stride);
  }
}

bool has_avx2_f16c() {
  // F16C from CPUID leaf 1 (ECX bit 29): clang before 15 has no "f16c" for __builtin_cpu_supports.
  static const bool supported = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) != 0 &&
           (c & bit_F16C) != 0;
  }();
  return supported;
}

}  // namespace

void decode_rows(const PathFormat& format, const uint8_t* first_record, int64_t record_stride_bytes,
                 int64_t count, int64_t width, float* out, int64_t out_stride) {
  if (!has_avx2_f16c()) {
    return decode_rows_reference(format, first_record, record_stride_bytes, count, width, out,
                                 out_stride);
  }
  check_rows(format, record_stride_bytes, count, width, out_stride);
  visit_path_format(format, [&](auto path) {
    decode_rows_avx2(path, first_record, record_stride_bytes, count, width, out, out_stride);
  });
  // Kept BF16 pairs: the base record decoded above, their channels now overwritten as decode_path
  // does. A few scalar stores per row; the base kernels stay one per layout.
  if (!format.bf16_pairs.empty()) {
    const int64_t offset = kept_pairs_offset(format, width);
    for (int64_t row = 0; row < count; ++row) {
      restore_kept_pairs(format.bf16_pairs, first_record + row * record_stride_bytes + offset,
                         out + row * out_stride);
    }
  }
}

void decode_rows_reference(const PathFormat& format, const uint8_t* first_record,
                           int64_t record_stride_bytes, int64_t count, int64_t width, float* out,
                           int64_t out_stride) {
  check_rows(format, record_stride_bytes, count, width, out_stride);
  for (int64_t row = 0; row < count; ++row) {
    decode_path(format, first_record + row * record_stride_bytes, width, out + row * out_stride);
  }
}

}  // namespace quantmla::cpu
