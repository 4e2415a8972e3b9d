// Dequantize-on-read of whole rows: one thread per (record, 64-channel chunk), the content chunks
// through the decode kernel's decoders (tile column order mapped back to channels), the RoPE part
// as the ninth chunk with its kept BF16 pairs written over their channels.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/launch.cuh"
#include "quantmla/gpu_mla.h"

namespace quantmla::gpu {
namespace {

struct GatherKernelParams {
  const uint8_t* pool;         // [pages, kPageTokens, record_bytes]
  const int32_t* block_table;  // [pages of the sequence]
  int64_t first;
  int64_t num_tokens;
  uint16_t* out;  // [num_tokens, kKeyDim] BF16, row stride out_stride
  int64_t out_stride;
  int record_bytes;
  KeptPairs kept;
};

constexpr int kContentChunks = kLatentDim / 64;
constexpr int kChunksPerRecord = kContentChunks + 1;  // + the RoPE part (64 channels)
constexpr int kThreads = 128;

template <int kSpan>
__device__ __forceinline__ void store_columns(const uint4 (&v)[8], uint16_t* out) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const uint32_t words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      out[channel_of_column<kSpan>(8 * u + e)] =
          static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2)));
    }
  }
}

template <class Content, class Rope>
__global__ void __launch_bounds__(kThreads)
    mla_gather_kernel(const __grid_constant__ GatherKernelParams p) {
  wait_for_previous_kernel();
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (task >= p.num_tokens * kChunksPerRecord) return;
  const int64_t t = task / kChunksPerRecord;
  const int chunk = static_cast<int>(task % kChunksPerRecord);
  const int64_t pos = p.first + t;
  const int64_t page = p.block_table[pos / kPageTokens];
  const uint8_t* rec = p.pool + (page * kPageTokens + pos % kPageTokens) * p.record_bytes;
  uint16_t* out = p.out + t * p.out_stride;
  uint4 v[8];
  if (chunk < kContentChunks) {
    Content::chunk(rec, chunk, v);
    store_columns<Content::kPairSpan>(v, out + 64 * chunk);
    return;
  }
  const uint8_t* rope = rec + Content::kBytes;
#pragma unroll
  for (int u = 0; u < 8; ++u) v[u] = Rope::unit(rope, u);
  out += kLatentDim;
  store_columns<Rope::kPairSpan>(v, out);
  for (int n = 0; n < p.kept.count; ++n) {
    const uint32_t stored = Rope::kept_pair(rope, n);
    out[2 * p.kept.pairs[n]] = static_cast<uint16_t>(stored);
    out[2 * p.kept.pairs[n] + 1] = static_cast<uint16_t>(stored >> 16);
  }
}

}  // namespace

void mla_gather(const CacheFormat& format, const MlaGatherParams& params, void* stream_handle) {
  if (params.num_tokens < 0 || params.first < 0 || params.out_stride < kKeyDim) {
    throw InvalidArgument(
        "GPU gather: first " + std::to_string(params.first) + ", num_tokens " +
        std::to_string(params.num_tokens) + ", out_stride " + std::to_string(params.out_stride) +
        " (need first, num_tokens >= 0 and out_stride >= " + std::to_string(kKeyDim) + ")");
  }
  if (params.num_tokens == 0) return;
  if (params.pool == nullptr || params.block_table == nullptr || params.out == nullptr) {
    throw InvalidArgument("GPU gather: pool, block_table and out must be set");
  }
  const GatherKernelParams kernel{params.pool,
                                  params.block_table,
                                  params.first,
                                  params.num_tokens,
                                  params.out,
                                  params.out_stride,
                                  static_cast<int>(format.record_bytes(kLatentDim, kRopeDim)),
                                  kept_pairs_of(format.rope)};
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  const auto blocks =
      static_cast<unsigned>((params.num_tokens * kChunksPerRecord + kThreads - 1) / kThreads);
  visit_gpu_format(format, [&](auto content, auto rope) {
    launch_kernel(mla_gather_kernel<decltype(content), decltype(rope)>, blocks, kThreads, 0, stream,
                  kernel);
    QUANTMLA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quantmla::gpu
