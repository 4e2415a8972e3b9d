// Host side of the GPU decode: the plan (schedule + device buffers), argument checks, the launch
// through the format switch, and the combine kernel that merges split sequences.
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_schedule.h"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/dispatch.cuh"
#include "quantmla/cache.h"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"

namespace quantmla::gpu {

// The GPU pages hold the CPU paged cache's pages.
static_assert(kPageTokens == quantmla::kPageTokens);

namespace {

struct CombineKernelParams {
  const float* partial_out;  // [num_partials, rows_per_block, kLatentDim]
  const float* partial_lse;  // [num_partials, rows_per_block]
  const CombineItem* items;  // [gridDim.x]
  uint16_t* out;             // [batch, s_q, num_heads, kLatentDim] BF16
  float* lse;                // [batch, s_q, num_heads] or null
  int rows_per_block;
  int rows_per_seq;
};

constexpr int kCombineThreads = kLatentDim / 4;

// One block per (sequence, row tile, row): out = sum_s w_s out_s / sum_s w_s with
// w_s = exp(lse_s - max lse), each thread 4 columns.
__global__ void __launch_bounds__(kCombineThreads)
    mla_combine_kernel(const __grid_constant__ CombineKernelParams p) {
  extern __shared__ float weights[];  // [num_splits]
  const CombineItem item = p.items[blockIdx.x];
  const int r = blockIdx.y;
  const float* lse =
      p.partial_lse + static_cast<int64_t>(item.first_partial) * p.rows_per_block + r;
  float max_lse = -INFINITY;
  for (int s = 0; s < item.num_splits; ++s) max_lse = fmaxf(max_lse, lse[s * p.rows_per_block]);
  for (int s = threadIdx.x; s < item.num_splits; s += blockDim.x) {
    const float l = lse[s * p.rows_per_block];
    weights[s] = l == -INFINITY ? 0.0f : expf(l - max_lse);
  }
  __syncthreads();
  const float* partial =
      p.partial_out +
      (static_cast<int64_t>(item.first_partial) * p.rows_per_block + r) * kLatentDim +
      4 * threadIdx.x;
  const int64_t split_stride = static_cast<int64_t>(p.rows_per_block) * kLatentDim;
  float total = 0.0f;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
  for (int s = 0; s < item.num_splits; ++s) {
    const float w = weights[s];
    total += w;
    const float4 v = *reinterpret_cast<const float4*>(partial + s * split_stride);
    acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
  }
  const float inverse = 1.0f / total;
  const int64_t row =
      static_cast<int64_t>(item.batch) * p.rows_per_seq + item.row_tile * p.rows_per_block + r;
  uint2 packed;
  packed.x = bf16x2_bits(__floats2bfloat162_rn(acc.x * inverse, acc.y * inverse));
  packed.y = bf16x2_bits(__floats2bfloat162_rn(acc.z * inverse, acc.w * inverse));
  *reinterpret_cast<uint2*>(p.out + row * kLatentDim + 4 * threadIdx.x) = packed;
  if (threadIdx.x == 0 && p.lse != nullptr) p.lse[row] = max_lse + logf(total);
}

}  // namespace

struct MlaDecodePlan::State {
  State(const CacheFormat& plan_format, DecodeSchedule plan_schedule, int plan_batch, int plan_s_q,
        int plan_heads)
      : format(plan_format),
        schedule(std::move(plan_schedule)),
        batch(plan_batch),
        s_q(plan_s_q),
        num_heads(plan_heads),
        items(schedule.items),
        combines(schedule.combines),
        partial_out(partial_rows() * kLatentDim),
        partial_lse(partial_rows()) {}

  size_t partial_rows() const {
    return static_cast<size_t>(schedule.num_partials) * schedule.rows_per_block;
  }

  CacheFormat format;
  DecodeSchedule schedule;
  int batch;
  int s_q;
  int num_heads;
  DeviceArray<WorkItem> items;        // the schedule's, on the device
  DeviceArray<CombineItem> combines;  // likewise
  DeviceArray<float> partial_out;     // [num_partials, rows_per_block, kLatentDim]
  DeviceArray<float> partial_lse;     // [num_partials, rows_per_block]
};

MlaDecodePlan::MlaDecodePlan(const CacheFormat& format, const std::vector<int32_t>& seq_lens,
                             int s_q, int num_heads, int pages_per_split) {
  int device = 0;
  int num_sms = 0;
  QUANTMLA_CUDA_CHECK(cudaGetDevice(&device));
  QUANTMLA_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  int blocks_per_sm = 1;
  const bool two_tiles = row_tiles_per_block(s_q, num_heads) == 2;
  visit_gpu_format(format, [&](auto content, auto rope) {
    using Content = decltype(content);
    using Rope = decltype(rope);
    blocks_per_sm = two_tiles ? DecodeLayout<Content, Rope, 2>::kBlocksPerSm
                              : DecodeLayout<Content, Rope, 1>::kBlocksPerSm;
  });
  state_ = std::make_unique<State>(
      format, plan_decode(seq_lens, s_q, num_heads, num_sms, blocks_per_sm, pages_per_split),
      static_cast<int>(seq_lens.size()), s_q, num_heads);
}

MlaDecodePlan::~MlaDecodePlan() = default;
MlaDecodePlan::MlaDecodePlan(MlaDecodePlan&&) noexcept = default;
MlaDecodePlan& MlaDecodePlan::operator=(MlaDecodePlan&&) noexcept = default;

int MlaDecodePlan::num_blocks() const { return static_cast<int>(state_->schedule.items.size()); }
int MlaDecodePlan::max_splits() const { return state_->schedule.max_splits; }

void mla_decode(const CacheFormat& format, const MlaDecodeParams& params, const MlaDecodePlan& plan,
                void* stream_handle) {
  const MlaDecodePlan::State& state = plan.state();
  if (!(format == state.format)) {
    throw InvalidArgument("GPU decode: format " + format.to_string() +
                          " but the plan was made for " + state.format.to_string());
  }
  if (params.batch != state.batch || params.s_q != state.s_q ||
      params.num_heads != state.num_heads) {
    throw InvalidArgument("GPU decode: params batch " + std::to_string(params.batch) + ", s_q " +
                          std::to_string(params.s_q) + ", heads " +
                          std::to_string(params.num_heads) + " but the plan was made for " +
                          std::to_string(state.batch) + ", " + std::to_string(state.s_q) + ", " +
                          std::to_string(state.num_heads));
  }
  if (params.q == nullptr || params.pool == nullptr || params.block_table == nullptr ||
      params.seq_lens == nullptr || params.out == nullptr) {
    throw InvalidArgument("GPU decode: q, pool, block_table, seq_lens and out must be set");
  }
  if (params.block_table_stride < state.schedule.max_pages) {
    throw InvalidArgument(
        "GPU decode: block_table_stride " + std::to_string(params.block_table_stride) + " < " +
        std::to_string(state.schedule.max_pages) + " pages of the longest sequence");
  }
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  DecodeKernelParams kernel{};
  kernel.q = params.q;
  kernel.pool = params.pool;
  kernel.block_table = params.block_table;
  kernel.block_table_stride = params.block_table_stride;
  kernel.seq_lens = params.seq_lens;
  kernel.out = params.out;
  kernel.lse = params.lse;
  kernel.partial_out = state.partial_out.data();
  kernel.partial_lse = state.partial_lse.data();
  kernel.items = state.items.data();
  kernel.s_q = params.s_q;
  kernel.num_heads = params.num_heads;
  kernel.record_bytes = static_cast<int>(format.record_bytes(kLatentDim, kRopeDim));
  kernel.scale_log2 = params.softmax_scale * static_cast<float>(M_LOG2E);
  kernel.kept = kept_pairs_of(format.rope);
  const DecodeSchedule& schedule = state.schedule;
  visit_gpu_format(format, [&](auto content, auto rope) {
    launch_decode<decltype(content), decltype(rope)>(
        kernel, schedule.row_tiles_per_block, static_cast<int>(schedule.items.size()), stream);
  });
  if (!schedule.combines.empty()) {
    CombineKernelParams combine{state.partial_out.data(),
                                state.partial_lse.data(),
                                state.combines.data(),
                                params.out,
                                params.lse,
                                schedule.rows_per_block,
                                params.s_q * params.num_heads};
    const dim3 grid(static_cast<unsigned>(schedule.combines.size()),
                    static_cast<unsigned>(schedule.rows_per_block));
    mla_combine_kernel<<<grid, kCombineThreads, schedule.max_splits * sizeof(float), stream>>>(
        combine);
    QUANTMLA_CUDA_CHECK_LAUNCH();
  }
}

bool device_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace quantmla::gpu
