// Quantize-on-write: one warp encodes one token's (c, k_pe) into its record in the paged pool.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dispatch.cuh"
#include "quantmla/gpu_mla.h"

namespace quantmla::gpu {
namespace {

struct WriteKernelParams {
  const float* c;              // [num_tokens, kLatentDim]
  const float* k_pe;           // [num_tokens, kRopeDim]
  const int32_t* seq_ids;      // [num_tokens]
  const int32_t* positions;    // [num_tokens]
  uint8_t* pool;               // [pages, kPageTokens, record_bytes]
  const int32_t* block_table;  // [sequences, block_table_stride]
  int64_t block_table_stride;
  int64_t num_tokens;
  int record_bytes;
  float content_clip;
  float rope_clip;
  KeptPairs kept;
};

constexpr int kWarpsPerBlock = 4;

template <class Content, class Rope>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    mla_write_kernel(const __grid_constant__ WriteKernelParams p) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (token >= p.num_tokens) return;  // whole warps: the shuffles below see full warps
  const int64_t pos = p.positions[token];
  const int32_t page = p.block_table[p.seq_ids[token] * p.block_table_stride + pos / kPageTokens];
  uint8_t* rec =
      p.pool + (static_cast<int64_t>(page) * kPageTokens + pos % kPageTokens) * p.record_bytes;
  float x[16];
  const float4* c = reinterpret_cast<const float4*>(p.c + token * kLatentDim + 16 * lane);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = c[i];
    x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
  }
  Content::encode(rec, x, lane, p.content_clip);
  const float2 k = reinterpret_cast<const float2*>(p.k_pe + token * kRopeDim)[lane];
  Rope::encode(rec + Content::kBytes, k.x, k.y, lane, p.rope_clip, p.kept);
}

}  // namespace

void mla_write(const CacheFormat& format, const MlaWriteParams& params, void* stream_handle) {
  if (params.num_tokens < 0) {
    throw InvalidArgument("GPU write: num_tokens " + std::to_string(params.num_tokens));
  }
  if (params.num_tokens == 0) return;
  if (params.c == nullptr || params.k_pe == nullptr || params.seq_ids == nullptr ||
      params.positions == nullptr || params.pool == nullptr || params.block_table == nullptr ||
      params.block_table_stride <= 0) {
    throw InvalidArgument(
        "GPU write: c, k_pe, seq_ids, positions, pool and block_table must be set");
  }
  WriteKernelParams kernel{params.c,
                           params.k_pe,
                           params.seq_ids,
                           params.positions,
                           params.pool,
                           params.block_table,
                           params.block_table_stride,
                           params.num_tokens,
                           static_cast<int>(format.record_bytes(kLatentDim, kRopeDim)),
                           format.content.clip,
                           format.rope.clip,
                           kept_pairs_of(format.rope)};
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  const auto blocks =
      static_cast<unsigned>((params.num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  visit_gpu_format(format, [&](auto content, auto rope) {
    mla_write_kernel<decltype(content), decltype(rope)>
        <<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(kernel);
    QUANTMLA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quantmla::gpu
