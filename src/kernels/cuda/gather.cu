// Dequantize-on-read of whole rows: a block takes 16 records, one thread per (record, 64-channel
// chunk), the content chunks through the decode kernel's decoders (tile column order mapped back
// to channels), the RoPE part as the ninth chunk with its kept BF16 pairs written over their
// channels; the rows are put together in shared memory (the channel order scatters single
// values) and stored with 16-byte writes.
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
constexpr int kRecordsPerBlock = 16;
constexpr int kThreads = kRecordsPerBlock * kChunksPerRecord;
constexpr int kRowVectors = kKeyDim / 8;  // 16-byte pieces of an output row

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
  __shared__ __align__(16) uint16_t rows[kRecordsPerBlock][kKeyDim];
  wait_for_previous_kernel();
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRecordsPerBlock;
  const int record = threadIdx.x / kChunksPerRecord;
  const int chunk = threadIdx.x % kChunksPerRecord;
  const int64_t t = first_row + record;
  if (t < p.num_tokens) {
    const int64_t pos = p.first + t;
    const int64_t page = p.block_table[pos / kPageTokens];
    const uint8_t* rec = p.pool + (page * kPageTokens + pos % kPageTokens) * p.record_bytes;
    uint16_t* row = rows[record];
    uint4 v[8];
    if (chunk < kContentChunks) {
      Content::chunk(rec, chunk, v);
      store_columns<Content::kPairSpan>(v, row + 64 * chunk);
    } else {
      const uint8_t* rope = rec + Content::kBytes;
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = Rope::unit(rope, u);
      store_columns<Rope::kPairSpan>(v, row + kLatentDim);
      for (int n = 0; n < p.kept.count; ++n) {
        const uint32_t stored = Rope::kept_pair(rope, n);
        row[kLatentDim + 2 * p.kept.pairs[n]] = static_cast<uint16_t>(stored);
        row[kLatentDim + 2 * p.kept.pairs[n] + 1] = static_cast<uint16_t>(stored >> 16);
      }
    }
  }
  __syncthreads();
  const int64_t valid = p.num_tokens - first_row;
  for (int i = threadIdx.x; i < kRecordsPerBlock * kRowVectors; i += kThreads) {
    const int r = i / kRowVectors, column = i % kRowVectors;
    if (r >= valid) break;
    *reinterpret_cast<uint4*>(p.out + (first_row + r) * p.out_stride + column * 8) =
        *reinterpret_cast<const uint4*>(&rows[r][column * 8]);
  }
}

}  // namespace

void mla_gather(const CacheFormat& format, const MlaGatherParams& params, void* stream_handle) {
  if (params.num_tokens < 0 || params.first < 0 || params.out_stride < kKeyDim ||
      params.out_stride % 8 != 0 || reinterpret_cast<uintptr_t>(params.out) % 16 != 0) {
    throw InvalidArgument(
        "GPU gather: first " + std::to_string(params.first) + ", num_tokens " +
        std::to_string(params.num_tokens) + ", out_stride " + std::to_string(params.out_stride) +
        " (need first, num_tokens >= 0, out_stride >= " + std::to_string(kKeyDim) +
        " and a multiple of 8, out 16-byte aligned)");
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
      static_cast<unsigned>((params.num_tokens + kRecordsPerBlock - 1) / kRecordsPerBlock);
  visit_gpu_format(format, [&](auto content, auto rope) {
    launch_kernel(mla_gather_kernel<decltype(content), decltype(rope)>, blocks, kThreads, 0, stream,
                  kernel);
    QUANTMLA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quantmla::gpu
