// The two GPU decode kernels and which formats each reads (host code, no CUDA): the plan's kernel
// choice (decode.cu) and the GPU test's coverage of both kernels read the same predicate.
#pragma once

#include "quantmla/cache_format.h"

namespace quantmla::gpu {

// The tiled kernel (decode_kernel.cuh, every format, 16 or 32 rows a block) and the
// fragment-dequantizing one (decode_fragments.cuh, content int4 or int2 g64, 16 rows a block).
enum class DecodeKernel { kTiled, kFragments };

// The formats the fragment kernel reads (decode_fragments.cuh's kFragmentContent at compile time).
inline bool fragments_kernel_reads(const CacheFormat& format) {
  return (format.content.codec == Codec::kInt4 || format.content.codec == Codec::kInt2) &&
         format.content.group == 64;
}

}  // namespace quantmla::gpu
