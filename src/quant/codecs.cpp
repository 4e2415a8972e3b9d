// encode_path / decode_path: checks the format and width, then hands the vector to its codec (and
// the kept BF16 pairs of a uniform-int path to quant/kept_pairs.h).
#include <bit>
#include <cstdint>

#include "quant/codec_kernels.h"
#include "quant/format_checks.h"
#include "quant/kept_pairs.h"
#include "quantmla/cache_format.h"
#include "quantmla/dtype.h"

namespace quantmla {

void encode_path(const PathFormat& format, const float* values, int64_t width, uint8_t* out) {
  check_path_width(format, width);
  switch (format.codec) {
    case Codec::kF32:
      for (int64_t i = 0; i < width; ++i) {
        store_le32(out + 4 * i, std::bit_cast<uint32_t>(values[i]));
      }
      return;
    case Codec::kBF16:
      for (int64_t i = 0; i < width; ++i) store_le16(out + 2 * i, f32_to_bf16(values[i]));
      return;
    case Codec::kFP8:
      return encode_fp8(format.group, values, width, out);
    case Codec::kInt8:
    case Codec::kInt4:
    case Codec::kInt2:
      if (!format.bf16_pairs.empty()) {
        return encode_uniform_int_kept_pairs(format, values, width, out);
      }
      return encode_uniform_int(format.bits(), format.group, format.clip, values, width, out);
    case Codec::kQ8_0:
      return encode_q8_0(values, width, out);
    case Codec::kQ4_0:
      return encode_q4_0(values, width, out);
  }
}

void decode_path(const PathFormat& format, const uint8_t* in, int64_t width, float* values) {
  check_path_width(format, width);
  switch (format.codec) {
    case Codec::kF32:
      for (int64_t i = 0; i < width; ++i) values[i] = std::bit_cast<float>(load_le32(in + 4 * i));
      return;
    case Codec::kBF16:
      for (int64_t i = 0; i < width; ++i) values[i] = bf16_to_f32(load_le16(in + 2 * i));
      return;
    case Codec::kFP8:
      return decode_fp8(format.group, in, width, values);
    case Codec::kInt8:
    case Codec::kInt4:
    case Codec::kInt2:
      decode_uniform_int(format.bits(), format.group, in, width, values);
      if (!format.bf16_pairs.empty()) {
        restore_kept_pairs(format.bf16_pairs, in + kept_pairs_offset(format, width), values);
      }
      return;
    case Codec::kQ8_0:
      return decode_q8_0(in, width, values);
    case Codec::kQ4_0:
      return decode_q4_0(in, width, values);
  }
}

}  // namespace quantmla
