// expert_gemm.h: a block computes a 128 x 128 tile of y^T for one expert, M = 128 weight rows
// (two warpgroups of 64, wgmma's M) by N = 128 of the expert's rows, walking k in steps of 64
// through a ring of kStages shared-memory stages (cp.async, 128-byte swizzle, both operands
// K-major as stored). The grid runs an expert's token tiles fastest, then its weight tiles, so
// the blocks that read one weight tile run side by side and the second read of it hits L2 (an
// expert of ~190 rows has two token tiles; its weights, not its rows, are the bytes that count).
#include <climits>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/expert_gemm.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

constexpr int kThreads = 256;  // two warpgroups
constexpr int kTile = 128;     // weight rows (M) and token rows (N) of a block
constexpr int kStepK = 64;     // one swizzled column block
constexpr int kStages = 4;
constexpr int kBlockBytes = kTile * 128;  // 128 rows x 64 BF16
constexpr int kCopyRows = kThreads / 8;   // thread t copies chunk t % 8 of rows t / 8 + 32 i
constexpr size_t kSharedBytes = size_t{kStages} * 2 * kBlockBytes + 1024;
static_assert(kSharedBytes <= 227 * 1024, "fits an SM's shared memory");

static_assert(copies_fill_a_block_once<kThreads, kTile>(),
              "each 16-byte piece of a block copied once, swizzled");

std::string str(int64_t v) { return std::to_string(v); }

__global__ void __launch_bounds__(kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ ExpertGemmParams p) {
  wait_for_previous_kernel();
  const int e = static_cast<int>(blockIdx.z);
  const int64_t first = p.offsets[e], count = p.offsets[e + 1] - first;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTile;
  if (t0 >= count) return;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const uint16_t* w = p.w[e];
  extern __shared__ __align__(16) uint8_t shared_raw[];
  const uint32_t base = (shared_address(shared_raw) + 1023) / 1024 * 1024;
  const auto weights_stage = [&](int s) {
    return base + static_cast<uint32_t>(s) * 2 * kBlockBytes;
  };
  const auto rows_stage = [&](int s) { return weights_stage(s) + kBlockBytes; };

  const int chunk = threadIdx.x % 8, copy_row = threadIdx.x / 8;
  const uint32_t copy_offset = swizzled_chunk_offset(copy_row, chunk);
  const int64_t k_tiles = p.k / kStepK;
  // Tile kt of both operands into stage s; token rows past the expert's count are zero-filled.
  const auto load = [&](int64_t kt, int s) {
    if (kt < k_tiles) {
      const int64_t column = kt * kStepK + chunk * 8;
#pragma unroll
      for (int i = 0; i < kTile / kCopyRows; ++i) {
        const int64_t row = copy_row + kCopyRows * i;
        const uint32_t at = copy_offset + i * kCopyRows * 128;
        cp_async_16(weights_stage(s) + at, w + (m0 + row) * p.k + column, 16);
        const bool valid = t0 + row < count;
        cp_async_16(rows_stage(s) + at, p.x + (first + (valid ? t0 + row : 0)) * p.ldx + column,
                    valid ? 16 : 0);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the waits' counting uniform
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) load(s, s);

  const int warpgroup = threadIdx.x / 128;
  const uint32_t weight_rows = static_cast<uint32_t>(warpgroup) * 64 * 128;  // its 64 rows
  float d[64] = {};
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();  // tile kt has landed (this thread's copies)
    fence_proxy_async_shared();    // read by the tensor cores' proxy
    __syncthreads();  // everyone's copies; the stage loaded next was last read at kt - 1
    load(kt + kStages - 1, static_cast<int>((kt + kStages - 1) % kStages));
    const int s = static_cast<int>(kt % kStages);
    wgmma_fence_registers(d);
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < kStepK / 16; ++step) {
      wgmma_m64n128k16_ss(d, wgmma_descriptor(weights_stage(s) + weight_rows + step * 32),
                          wgmma_descriptor(rows_stage(s) + step * 32), kt > 0 || step > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_registers(d);
  }

  // d[4 j + c]: weight row 16 warp + lane / 4 (+ 8 for c >= 2) of the warpgroup's 64, token
  // column 8 j + 2 (lane % 4) + c % 2 (wgmma.cuh's accumulator layout), stored as y[token, row].
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int64_t row0 = m0 + warpgroup * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t token = t0 + 8 * j + 2 * (lane % 4) + c % 2;
      if (token < count) p.y[(first + token) * p.ldy + row0 + (c >= 2 ? 8 : 0)] = d[4 * j + c];
    }
  }
}

}  // namespace

void expert_gemm(const ExpertGemmParams& p, cudaStream_t stream) {
  if (p.num_experts < 1 || p.num_experts > 65535 || p.n < kTile || p.n % kTile != 0 ||
      p.k < kStepK || p.k % kStepK != 0 || p.ldx < p.k || p.ldx % 8 != 0 || p.ldy < p.n ||
      p.max_rows < 0) {
    throw ShapeError("expert_gemm: " + std::to_string(p.num_experts) + " experts, n " + str(p.n) +
                     ", k " + str(p.k) + ", ldx " + str(p.ldx) + ", ldy " + str(p.ldy) +
                     ", max_rows " + str(p.max_rows) +
                     " (need 1-65535 experts, n a multiple of 128, k of 64, ldx >= k a multiple "
                     "of 8, ldy >= n)");
  }
  if (p.x == nullptr || p.w == nullptr || p.offsets == nullptr || p.y == nullptr) {
    throw InvalidArgument("expert_gemm: x, w, offsets and y must be device pointers, got null");
  }
  if (reinterpret_cast<uintptr_t>(p.x) % 16 != 0) {
    throw InvalidArgument("expert_gemm: x must be 16-byte aligned");
  }
  const int64_t token_tiles = (p.max_rows + kTile - 1) / kTile;
  if (token_tiles == 0) return;
  if (token_tiles > INT32_MAX) throw ShapeError("expert_gemm: max_rows " + str(p.max_rows));
  const dim3 grid(static_cast<unsigned>(token_tiles), static_cast<unsigned>(p.n / kTile),
                  static_cast<unsigned>(p.num_experts));
  launch_large_shared<expert_gemm_kernel>(grid, kThreads, kSharedBytes, stream, p);
}

}  // namespace quantmla::gpu
