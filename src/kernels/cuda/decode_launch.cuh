// Launch of the decode kernel for one pair of record formats. Each content format's pair of
// instantiations lives in its own decode_<format>.cu so that they compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_kernel.cuh"
#include "kernels/cuda/decode_warpgroup.cuh"
#include "kernels/cuda/launch.cuh"

namespace quantmla::gpu {

template <class Content, class Rope, int kRowTiles>
void launch_decode_tiles(const DecodeKernelParams& params, int blocks, cudaStream_t stream) {
  using Layout = DecodeLayout<Content, Rope, kRowTiles>;
  launch_large_shared<mla_decode_kernel<Content, Rope, kRowTiles>>(
      blocks, Layout::kThreads, Layout::kSharedBytes, stream, params);
}

template <class Content, class Rope>
void launch_decode(const DecodeKernelParams& params, int row_tiles_per_block, int blocks,
                   cudaStream_t stream) {
  if (row_tiles_per_block == 2) {
    launch_decode_tiles<Content, Rope, 2>(params, blocks, stream);
  } else {
    launch_decode_tiles<Content, Rope, 1>(params, blocks, stream);
  }
}

}  // namespace quantmla::gpu

// Explicit instantiations for one content format with both RoPE formats: the tiled kernel and the
// warpgroup one.
#define QUANTMLA_INSTANTIATE_DECODE(Content)                                                    \
  namespace quantmla::gpu {                                                                     \
  template void launch_decode<Content, RopeBf16>(const DecodeKernelParams&, int, int,           \
                                                 cudaStream_t);                                 \
  template void launch_decode<Content, RopeInt4>(const DecodeKernelParams&, int, int,           \
                                                 cudaStream_t);                                 \
  template void launch_decode_warpgroup<Content, RopeBf16>(const DecodeKernelParams&, int, int, \
                                                           cudaStream_t);                       \
  template void launch_decode_warpgroup<Content, RopeInt4>(const DecodeKernelParams&, int, int, \
                                                           cudaStream_t);                       \
  }
