// Uniform-int paths that keep a few frequency pairs in BF16 (PathFormat::bf16_pairs): the encoder
// around encode_uniform_int and the patch that the scalar and SIMD decoders apply after decoding
// the base record.
#pragma once

#include <cstdint>
#include <vector>

#include "quantmla/cache_format.h"

namespace quantmla {

// Encodes `width` values in `format` (int8/int4/int2 with kept pairs, accepted by
// check_path_width): the base record with the kept channels left out of their group's range, then
// the kept pairs' BF16 values at kept_pairs_offset(format, width).
void encode_uniform_int_kept_pairs(const PathFormat& format, const float* values, int64_t width,
                                   uint8_t* out);

// Overwrites the kept channels of a decoded vector with the BF16 values at `stored` (the encoded
// vector + kept_pairs_offset): pair k's channels 2i and 2i + 1 from bytes 4k and 4k + 2.
void restore_kept_pairs(const std::vector<int>& pairs, const uint8_t* stored, float* values);

}  // namespace quantmla
