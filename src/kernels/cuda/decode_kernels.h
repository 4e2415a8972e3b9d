// The two GPU decode kernels and which formats each reads (host code, no CUDA): the plan's kernel
// choice (decode.cu) and the GPU test's coverage of both kernels read the same predicate.
#pragma once

#include <cstdint>

#include "quantmla/cache_format.h"

namespace quantmla::gpu {

// The tiled kernel (decode_kernel.cuh, every format, 16 or 32 rows a block) and the
// fragment one (decode_fragments.cuh, content int4 or int2 g64 or fp8, 16 rows a block).
enum class DecodeKernel { kTiled, kFragments };

// The content formats the fragment kernel reads: the one statement of them, for the plan at run
// time and for decode_fragments.cuh's kFragmentContent at compile time.
constexpr bool fragments_kernel_reads(Codec codec, int64_t group) {
  return ((codec == Codec::kInt4 || codec == Codec::kInt2) && group == 64) ||
         (codec == Codec::kFP8 && group == 128);
}
inline bool fragments_kernel_reads(const CacheFormat& format) {
  return fragments_kernel_reads(format.content.codec, format.content.group);
}

}  // namespace quantmla::gpu
