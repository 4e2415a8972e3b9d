// The transposed decode kernel for a BF16 cache (decode_transposed.cu): its launch.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/decode_kernel.cuh"

namespace quantmla::gpu {

// The kernel over `blocks` work items of `row_tiles` (1 or 2) 16-row tiles of query rows
// (p.items; padding items exit at once). Throws InvalidArgument for records of another size than a
// BF16 cache's or another tile count, CudaError on CUDA errors.
void launch_decode_transposed(const DecodeKernelParams& p, int row_tiles, int blocks,
                              cudaStream_t stream);

}  // namespace quantmla::gpu
