// Validation shared by the size computation (cache_format.cpp) and the codecs (codecs.cpp), so
// that a hand-built PathFormat is checked as strictly as a parsed one.
#pragma once

#include <cstdint>

#include "quantmla/cache_format.h"

namespace quantmla {

// Throws InvalidArgument unless `format` has a group and clip its codec allows, `width` is a
// non-negative multiple of that group, and its kept BF16 pairs (int* only) are ascending, unique
// and inside the width.
void check_path_width(const PathFormat& format, int64_t width);

// Where the kept BF16 pairs start in an encoded vector: the size of the base record (codes and
// scales) of `format`. Checks like check_path_width.
int64_t kept_pairs_offset(const PathFormat& format, int64_t width);

}  // namespace quantmla
