// The warpgroup decode kernel (decode_warpgroup.cu): BF16 content and RoPE, 64 query rows a block
// on the warpgroup tensor-core instructions, for the head counts where the tiled kernel's
// mma.sync tiles are compute-bound (docs/benchmarks.md: 0.27x FlashMLA at 128 heads).
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/decode_kernel.cuh"

namespace quantmla::gpu {

struct WarpgroupLayout {
  static constexpr int kThreads = 256;                // two warpgroups
  static constexpr int kRows = 64;                    // query rows a block: wgmma's M
  static constexpr int kStepKeys = kPageTokens;       // keys of one online-softmax step
  static constexpr int kBlocksPerSm = 1;              // the tiles take all the shared memory
  static constexpr int kRecordBytes = 2 * kKeyDim;    // [c ; k_pe], BF16 both
  static constexpr int kColumnBlocks = kKeyDim / 64;  // tensor-map boxes of 64 channels
  static constexpr int kBlockBytes = 64 * 128;        // a box of 64 rows
  static constexpr int kTileBytes = kColumnBlocks * kBlockBytes;  // Q, or a page of keys
  static constexpr int kStages = 2;                               // pages in flight
  static constexpr int kProbBytes = kBlockBytes;            // P: 64 rows x 64 keys, BF16, one box
  static constexpr int kExchangeBytes = 2 * 2 * kRows * 4;  // [max, sum][warpgroup][row] FP32
  static constexpr int kBarrierBytes = (1 + kStages) * 8;
  // + 1024: the swizzle needs 1024-byte-aligned boxes, the dynamic allocation only promises 16.
  static constexpr int kSharedBytes =
      1024 + (1 + kStages) * kTileBytes + kProbBytes + kExchangeBytes + kBarrierBytes;
  static_assert(kKeyDim % 64 == 0 && kLatentDim == 2 * 256, "two warpgroups of 256 channels");
  static_assert(kStepKeys == 64, "a page is one box of keys and one k-block of P");
  static_assert(kSharedBytes <= kSharedLimit, "fits an SM's shared memory");
};

// Launches the kernel over `blocks` work items (p.items; padding items exit at once). batch: the
// sequences of p.q ([batch, s_q, num_heads, kKeyDim]). Throws InvalidArgument when the records
// are not BF16 [c ; k_pe], CudaError on CUDA errors.
void launch_decode_warpgroup(const DecodeKernelParams& p, int batch, int blocks,
                             cudaStream_t stream);

}  // namespace quantmla::gpu
