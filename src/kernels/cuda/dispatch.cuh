// The one switch from a runtime CacheFormat to the record-format types of the GPU kernels.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda/decode_kernel.cuh"
#include "kernels/cuda/decode_kernels.h"
#include "kernels/cuda/record_formats.cuh"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"

namespace quantmla::gpu {

// Defined in decode_<content>.cu.
template <class Content, class Rope>
void launch_decode(const DecodeKernelParams& params, int row_tiles_per_block, int blocks,
                   cudaStream_t stream);

// Defined in decode_launch.cuh, instantiated in decode_<content>.cu; shortest_run_pages: the
// pages of the plan's shortest block run (a BF16 cache's pages are requested into L2 ahead of
// their copies from kSeesawL2PrefetchMinPages on).
template <class Content, class Rope>
void launch_decode_warpgroup(const DecodeKernelParams& params, int batch, int blocks,
                             int shortest_run_pages, cudaStream_t stream);

// Defined in decode_fragments.cuh, instantiated in decode_fragments_<content>.cu; three_blocks:
// its form without a producer warp (kFragmentsThreeBlocksContent).
template <class Content, class Rope>
void launch_decode_fragments(const DecodeKernelParams& params, int blocks, bool three_blocks,
                             cudaStream_t stream);

inline KeptPairs kept_pairs_of(const PathFormat& rope) {
  KeptPairs kept{};
  kept.count = static_cast<int>(rope.bf16_pairs.size());
  for (int n = 0; n < kept.count; ++n) kept.pairs[n] = rope.bf16_pairs[n];
  return kept;
}

// Calls f(Content{}, Rope{}) with the types of `format`. Throws InvalidArgument for a format
// without GPU kernels.
template <class F>
void visit_gpu_format(const CacheFormat& format, F&& f) {
  check_gpu_format(format);
  const auto with_rope = [&](auto content) {
    if (format.rope.codec == Codec::kBF16) {
      f(content, RopeBf16{});
    } else {
      f(content, RopeInt4{});
    }
  };
  const PathFormat& content = format.content;
  switch (content.codec) {
    case Codec::kBF16:
      return with_rope(ContentBf16{});
    case Codec::kFP8:
      return with_rope(ContentFp8{});
    case Codec::kInt4:
      return content.group == 64 ? with_rope(ContentInt<4, 64>{}) : with_rope(ContentInt<4, 128>{});
    case Codec::kInt2:
      return content.group == 64 ? with_rope(ContentInt<2, 64>{}) : with_rope(ContentInt<2, 128>{});
    default:
      throw InvalidArgument("cache format " + format.to_string() + " has no GPU kernel");
  }
}

}  // namespace quantmla::gpu
