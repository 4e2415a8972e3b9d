// Validation shared by the size computation (cache_format.cpp) and the codecs (codecs.cpp), so
// that a hand-built PathFormat is checked as strictly as a parsed one.
#pragma once

#include <cstdint>

#include "quantmla/cache_format.h"

namespace quantmla {

// Throws InvalidArgument unless `format` has a group and clip its codec allows and `width` is a
// non-negative multiple of that group.
void check_path_width(const PathFormat& format, int64_t width);

}  // namespace quantmla
