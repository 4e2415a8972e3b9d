// Launch of the decode kernel for one pair of record formats. Each content format's pair of
// instantiations lives in its own decode_<format>.cu so that they compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_kernel.cuh"
#include "kernels/cuda/decode_seesaw.cuh"
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

// The warpgroup kernels over `blocks` work items (p.items; padding items exit at once): a BF16
// cache's on the seesaw schedule (decode_seesaw.cuh), the other formats' on the page schedule
// (decode_warpgroup.cuh). batch: the sequences of p.q ([batch, s_q, num_heads, kKeyDim]). Throws
// InvalidArgument for a format that does not fit (kWarpgroupFits) or records of another size than
// the format's, CudaError on CUDA errors.
template <class Content, class Rope>
void launch_decode_warpgroup(const DecodeKernelParams& p, int batch, int blocks,
                             int shortest_run_pages, cudaStream_t stream) {
  using L = WarpgroupLayout<Content, Rope>;
  if constexpr (!kWarpgroupFits<Content, Rope>) {
    throw InvalidArgument(
        "GPU decode, warpgroup kernel: this format's pages do not fit beside the "
        "tiles (BF16 content with an int4 RoPE key, FP8 content with a BF16 one)");
  } else {
    const int rows_per_seq = p.s_q * p.num_heads;
    const int max_record = Content::kBytes + Rope::kMaxBytes;
    const bool records_fit = L::kDirect ? p.record_bytes == max_record
                                        : p.record_bytes <= max_record && p.record_bytes % 4 == 0;
    if (!records_fit || rows_per_seq < 1 || batch < 1) {
      throw InvalidArgument("GPU decode, warpgroup kernel: records of " +
                            std::to_string(p.record_bytes) + " bytes (the format's at most " +
                            std::to_string(max_record) + "), s_q " + std::to_string(p.s_q) +
                            " x heads " + std::to_string(p.num_heads) + ", batch " +
                            std::to_string(batch));
    }
    // Boxes of 64 channels by 64 rows: Q's rows of a block, a BF16 page's records.
    const int box[] = {64, L::kRows};
    const int64_t q_dims[] = {kKeyDim, static_cast<int64_t>(batch) * rows_per_seq};
    const int64_t strides[] = {kKeyDim};
    const CUtensorMap q_map = bf16_tensor_map(p.q, 2, q_dims, strides, box);
    if constexpr (L::kDirect) {
      const int64_t pool_dims[] = {kKeyDim, warpgroup_detail::kPoolMapRecords};
      const CUtensorMap pool_map = bf16_tensor_map(p.pool, 2, pool_dims, strides, box);
      if (shortest_run_pages >= kSeesawL2PrefetchMinPages) {
        launch_large_shared<mla_decode_seesaw_kernel<Content, Rope, true>>(
            blocks, SeesawLayout::kThreads, SeesawLayout::kSharedBytes, stream, p, q_map, pool_map);
      } else {
        launch_large_shared<mla_decode_seesaw_kernel<Content, Rope, false>>(
            blocks, SeesawLayout::kThreads, SeesawLayout::kSharedBytes, stream, p, q_map, pool_map);
      }
    } else {
      launch_large_shared<mla_decode_warpgroup_kernel<Content, Rope>>(
          blocks, L::kThreads, L::kSharedBytes, stream, p, q_map);
    }
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
                                                           int, cudaStream_t);                  \
  template void launch_decode_warpgroup<Content, RopeInt4>(const DecodeKernelParams&, int, int, \
                                                           int, cudaStream_t);                  \
  }
