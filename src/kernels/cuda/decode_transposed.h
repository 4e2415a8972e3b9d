// The transposed decode kernel (decode_transposed.cu): which record formats it reads, and its
// launch.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/decode_kernel.cuh"

namespace quantmla::gpu {

// A BF16 cache (content and RoPE key), copied as tiles, and int4 and int2 content (either group,
// either RoPE format), copied raw and dequantized: the compile-time twin of decode_kernels.h's
// transposed_kernel_reads.
template <class Content>
inline constexpr bool kTransposedConvertsContent = false;
template <int kBits, int kGroup>
inline constexpr bool kTransposedConvertsContent<ContentInt<kBits, kGroup>> = true;
template <class Content, class Rope>
inline constexpr bool kTransposedReads =
    (Content::kIsBf16 && Rope::kIsBf16) || kTransposedConvertsContent<Content>;

// The kernel over `blocks` work items of `row_tiles` (1 or 2) 16-row tiles of query rows
// (p.items; padding items exit at once), for a format it reads (kTransposedReads: instantiated for
// those only, decode_transposed.cu). Throws InvalidArgument for records of another size than the
// format's or another tile count, CudaError on CUDA errors.
template <class Content, class Rope>
void launch_decode_transposed(const DecodeKernelParams& p, int row_tiles, int blocks,
                              cudaStream_t stream);

}  // namespace quantmla::gpu
