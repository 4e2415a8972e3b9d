// Quantize-on-write: one warp encodes one token's (c, k_pe) into its record in the paged pool;
// write_cache_and_queries runs rope_queries' work in the same launch (decode steps).
#include <cuda_runtime.h>

#include <climits>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/rotary.cuh"
#include "kernels/cuda/write_queries.h"
#include "quantmla/gpu_mla.h"

namespace quantmla::gpu {
namespace {

struct WriteKernelParams {
  const float* c;     // [num_tokens, kLatentDim], row stride c_stride
  const float* k_pe;  // [num_tokens, kRopeDim], row stride k_pe_stride
  int64_t c_stride;
  int64_t k_pe_stride;
  const float* norm_weight;  // [kLatentDim] or null
  float norm_eps;
  const float* inv_freq;  // [kRopeDim / 2] or null
  float attention_factor;
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

// One token's record, by one whole warp.
template <class Content, class Rope>
__device__ __forceinline__ void write_token(const WriteKernelParams& p, int64_t token, int lane) {
  const int64_t pos = p.positions[token];
  const int32_t page = p.block_table[p.seq_ids[token] * p.block_table_stride + pos / kPageTokens];
  uint8_t* rec =
      p.pool + (static_cast<int64_t>(page) * kPageTokens + pos % kPageTokens) * p.record_bytes;
  float x[16];
  const float* c = p.c + token * p.c_stride + 16 * lane;
  if (reinterpret_cast<uintptr_t>(c) % 16 == 0) {  // the runner's rows: four 16-byte loads
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = reinterpret_cast<const float4*>(c)[i];
      x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = c[i];
  }
  if (p.norm_weight != nullptr) {  // as rms_norm_kernel: squares summed in double
    double sum_squares = 0.0;
#pragma unroll
    for (int i = 0; i < 16; ++i) sum_squares += static_cast<double>(x[i]) * x[i];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      sum_squares += __shfl_xor_sync(0xffffffffu, sum_squares, offset);
    }
    const float inv_rms =
        static_cast<float>(1.0 / sqrt(sum_squares / static_cast<double>(kLatentDim) + p.norm_eps));
#pragma unroll
    for (int i = 0; i < 16; ++i)
      x[i] = __fmul_rn(p.norm_weight[16 * lane + i], __fmul_rn(x[i], inv_rms));
  }
  Content::encode(rec, x, lane, p.content_clip);
  float k0 = p.k_pe[token * p.k_pe_stride + 2 * lane];
  float k1 = p.k_pe[token * p.k_pe_stride + 2 * lane + 1];
  if (p.inv_freq != nullptr) {  // as rope_kernel: frequency pair `lane`
    const float angle = __fmul_rn(static_cast<float>(pos), p.inv_freq[lane]);
    float sin_value = 0.0f, cos_value = 0.0f;
    sincosf(angle, &sin_value, &cos_value);
    cos_value = __fmul_rn(cos_value, p.attention_factor);
    sin_value = __fmul_rn(sin_value, p.attention_factor);
    const float even = k0, odd = k1;
    k0 = __fsub_rn(__fmul_rn(even, cos_value), __fmul_rn(odd, sin_value));
    k1 = __fadd_rn(__fmul_rn(odd, cos_value), __fmul_rn(even, sin_value));
  }
  Rope::encode(rec + Content::kBytes, k0, k1, lane, p.rope_clip, p.kept);
}

template <class Content, class Rope>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    mla_write_kernel(const __grid_constant__ WriteKernelParams p) {
  wait_for_previous_kernel();
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (token >= p.num_tokens) return;  // whole warps: the shuffles see full warps
  write_token<Content, Rope>(p, token, static_cast<int>(threadIdx.x % 32));
}

// The cache write's blocks first, then rope_queries' (token, head) pairs, a warp each.

template <class Content, class Rope>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    write_and_queries_kernel(const __grid_constant__ WriteKernelParams p,
                             const __grid_constant__ RopeQueriesParams q, int write_blocks,
                             int query_heads, bool query_vectors) {
  wait_for_previous_kernel();
  if (static_cast<int>(blockIdx.x) < write_blocks) {
    const int64_t token = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
    if (token < p.num_tokens)
      write_token<Content, Rope>(p, token, static_cast<int>(threadIdx.x % 32));
    return;
  }
  const int64_t pair =
      (static_cast<int64_t>(blockIdx.x) - write_blocks) * kWarpsPerBlock + threadIdx.x / 32;
  if (pair >= q.tokens * query_heads) return;
  rope_query_head(q, pair / query_heads, static_cast<int>(pair % query_heads),
                  static_cast<int>(threadIdx.x % 32), 32, query_vectors);
}

void check_write(const MlaWriteParams& params) {
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
  if (params.c_stride < kLatentDim || params.k_pe_stride < kRopeDim) {
    throw InvalidArgument("GPU write: c_stride " + std::to_string(params.c_stride) +
                          " and k_pe_stride " + std::to_string(params.k_pe_stride) +
                          " must be at least the rows' widths " + std::to_string(kLatentDim) +
                          " and " + std::to_string(kRopeDim));
  }
}

WriteKernelParams kernel_params(const CacheFormat& format, const MlaWriteParams& params) {
  return {params.c,
          params.k_pe,
          params.c_stride,
          params.k_pe_stride,
          params.norm_weight,
          params.norm_eps,
          params.inv_freq,
          params.attention_factor,
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
}

unsigned write_blocks(int64_t tokens) {
  return static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

void mla_write(const CacheFormat& format, const MlaWriteParams& params, void* stream_handle) {
  check_write(params);
  if (params.num_tokens == 0) return;
  const WriteKernelParams kernel = kernel_params(format, params);
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  visit_gpu_format(format, [&](auto content, auto rope) {
    launch_kernel(mla_write_kernel<decltype(content), decltype(rope)>,
                  write_blocks(params.num_tokens), 32 * kWarpsPerBlock, 0, stream, kernel);
    QUANTMLA_CUDA_CHECK_LAUNCH();
  });
}

void write_cache_and_queries(const CacheFormat& format, const MlaWriteParams& params,
                             const RopeQueriesParams& queries, cudaStream_t stream) {
  check_write(params);
  check_rope_queries(queries);
  if (params.num_tokens != queries.tokens) {
    throw InvalidArgument("write_cache_and_queries: " + std::to_string(params.num_tokens) +
                          " tokens to write, " + std::to_string(queries.tokens) + " queries");
  }
  if (params.num_tokens == 0) return;
  const WriteKernelParams kernel = kernel_params(format, params);
  const int heads = queries.decode_q != nullptr ? queries.heads_padded : queries.heads;
  const unsigned writes = write_blocks(params.num_tokens);
  const int64_t blocks = writes + (queries.tokens * heads + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > INT_MAX) {
    throw ShapeError("write_cache_and_queries: " + std::to_string(queries.tokens) + " tokens of " +
                     std::to_string(heads) + " heads are too many blocks");
  }
  visit_gpu_format(format, [&](auto content, auto rope) {
    launch_kernel(write_and_queries_kernel<decltype(content), decltype(rope)>,
                  static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0, stream, kernel, queries,
                  static_cast<int>(writes), heads, rope_queries_vectorizable(queries));
    QUANTMLA_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace quantmla::gpu
