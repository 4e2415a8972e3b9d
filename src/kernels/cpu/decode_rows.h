// Batched decoding of encoded cache path vectors to FP32: the inner loop of a compressed cache's
// attention tiles.
#pragma once

#include <cstdint>

#include "quantmla/cache_format.h"

namespace quantmla::cpu {

// Decodes `count` vectors of `width` values in `format`, the first at `first_record` and each
// next one record_stride_bytes further, into rows of `out` out_stride floats apart. Output bits
// equal decode_path's for every value (NaNs may differ in payload only). Uses AVX2 + F16C when
// the CPU has them. Throws InvalidArgument for a format/width that decode_path rejects, a negative
// count, or strides that would overlap consecutive records or rows.
void decode_rows(const PathFormat& format, const uint8_t* first_record, int64_t record_stride_bytes,
                 int64_t count, int64_t width, float* out, int64_t out_stride);

// The same contract as a plain loop over decode_path: the oracle of decode_rows.
void decode_rows_reference(const PathFormat& format, const uint8_t* first_record,
                           int64_t record_stride_bytes, int64_t count, int64_t width, float* out,
                           int64_t out_stride);

}  // namespace quantmla::cpu
