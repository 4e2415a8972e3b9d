// expert_gemm.h: a block computes a 128 x 256 tile of y^T for one expert, M = 128 weight rows
// (two warpgroups of 64, wgmma's M) by N = up to 256 of the expert's rows, walking k in steps of
// 64 through a ring of kStages shared-memory stages (cp.async, 128-byte swizzle, both operands
// K-major as stored). A token tile multiplies only its rows rounded up to 32 (wgmma N = 32, 64,
// ..., 256), so an expert of 190 rows is one tile of 192 and its weights are read once. The
// products are asynchronous: step kt's wgmma run while step kt + 1's are issued, and the copies
// run kStages - 2 steps ahead, so the one barrier of a step also tells that the stage it refills
// (last read at step kt - 2) is free. The grid runs an expert's token tiles fastest, then its
// weight tiles, so the blocks that read one weight tile (experts of more than 256 rows) run side
// by side and the second read of it hits L2. The accumulators leave through shared memory, whole
// 16-byte stores per row. Gated: the 128 weight rows are 64 of gate (warpgroup 0) and the same 64
// of up (warpgroup 1); both hand their products over in shared memory and all 256 threads write
// the activation.
#include <climits>
#include <string>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/expert_gemm.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

constexpr int kThreads = 256;                         // two warpgroups
constexpr int kTile = 128;                            // weight rows (M) of a block
constexpr int kTokens = 256;                          // token rows (N) of a block, at most
constexpr int kStepK = 64;                            // one swizzled column block
constexpr int kBlockBytes = kTile * 128;              // 128 weight rows x 64 BF16
constexpr int kStageBytes = (kTile + kTokens) * 128;  // and 256 token rows
constexpr int kCopyRows = kThreads / 8;  // thread t copies chunk t % 8 of rows t / 8 + 32 i
template <int kStages>
constexpr size_t kSharedBytes = size_t{kStages} * kStageBytes + 1024;
static_assert(kSharedBytes<4> <= 227 * 1024, "fits an SM's shared memory");

static_assert(copies_fill_a_block_once<kThreads, kTile>() &&
                  copies_fill_a_block_once<kThreads, kTokens>(),
              "each 16-byte piece of a block copied once, swizzled");

// The epilogue's FP32 tiles in the ring's bytes, [token][weight row], rows padded so that a
// warp's accumulator writes (8 consecutive weight rows of 4 tokens two apart) fall in 32 distinct
// banks: plain, one tile of 128 weight rows; gated, gate's and up's tiles of 64.
constexpr int kLdPlain = kTile + 4;
constexpr int kLdGated = kTile / 2 + 4;
constexpr int kGatedTileBytes = kTokens * kLdGated * 4;
static_assert(kTokens * kLdPlain * 4 <= 3 * kStageBytes, "plain epilogue fits 3 stages");
static_assert(2 * kGatedTileBytes <= 3 * kStageBytes, "gated epilogue fits 3 stages");
static_assert(kLdPlain % 4 == 0 && kLdGated % 4 == 0, "16-byte aligned rows");

// True when, for each accumulator index c, the 32 lanes of a warp write 32 distinct banks of a
// [token][ld] FP32 tile (lane l holds token 2 (l % 4) + c % 2 and weight row l / 4 + 8 (c >= 2),
// wgmma.cuh's layout; other j, warps and warpgroups only shift every lane alike).
constexpr bool accumulator_writes_conflict_free(int ld) {
  for (int c = 0; c < 4; ++c) {
    bool bank_used[32] = {};
    for (int lane = 0; lane < 32; ++lane) {
      const int token = 2 * (lane % 4) + c % 2, row = lane / 4 + (c >= 2 ? 8 : 0);
      const int bank = (token * ld + row) % 32;
      if (bank_used[bank]) return false;
      bank_used[bank] = true;
    }
  }
  return true;
}
static_assert(accumulator_writes_conflict_free(kLdPlain) &&
                  accumulator_writes_conflict_free(kLdGated),
              "the epilogue's accumulator writes are free of bank conflicts");

// The 4 k16 products of one step of 64 over the first n (a multiple of 32, at most kN) token rows
// (stages at shared addresses): one wgmma shape for each n, chosen by a chain of comparisons
// that is uniform over the block.
template <int kN>
__device__ __forceinline__ void multiply_step(int n, float (&d)[kTokens / 2], uint32_t weights,
                                              uint32_t rows, bool first) {
  if constexpr (kN > 32) {
    if (n < kN) return multiply_step<kN - 32>(n, d, weights, rows, first);
  }
#pragma unroll
  for (int step = 0; step < kStepK / 16; ++step) {
    wgmma_m64nk16_ss<kN>(d, wgmma_descriptor(weights + step * 32),
                         wgmma_descriptor(rows + step * 32), !first || step > 0);
  }
}

std::string str(int64_t v) { return std::to_string(v); }

template <bool kGated, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ ExpertGemmParams p) {
  static_assert(kStages >= 3, "one stage read, one refilled, one landing");
  constexpr int kLead = kStages - 2;  // steps of k copied ahead of the product
  wait_for_previous_kernel();
  const int e = static_cast<int>(blockIdx.z);
  const int64_t first = p.offsets[e], count = p.offsets[e + 1] - first;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTokens;
  if (t0 >= count) return;
  const int valid_tokens = static_cast<int>(count - t0 < kTokens ? count - t0 : kTokens);
  const int tile_n = (valid_tokens + 31) / 32 * 32;  // token rows the products cover
  // Weight row r of the block: plain, row m0 + r of w[e]; gated, gate row m0 + r (r < 64) or up
  // row n + m0 + r - 64.
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * (kGated ? kTile / 2 : kTile);
  const auto weight_row = [&](int r) -> int64_t {
    return kGated && r >= kTile / 2 ? p.n + m0 + r - kTile / 2 : m0 + r;
  };
  const uint16_t* w = p.w[e];
  extern __shared__ __align__(16) uint8_t shared_raw[];
  const uint32_t base = (shared_address(shared_raw) + 1023) / 1024 * 1024;
  const auto weights_stage = [&](int s) { return base + static_cast<uint32_t>(s) * kStageBytes; };
  const auto rows_stage = [&](int s) { return weights_stage(s) + kBlockBytes; };

  const int chunk = threadIdx.x % 8, copy_row = threadIdx.x / 8;
  const uint32_t copy_offset = swizzled_chunk_offset(copy_row, chunk);
  const int64_t k_tiles = p.k / kStepK;
  // Tile kt of both operands into stage s; token rows past the expert's count are zero-filled,
  // those past tile_n (never read) skipped.
  const auto load = [&](int64_t kt, int s) {
    if (kt < k_tiles) {
      const int64_t column = kt * kStepK + chunk * 8;
#pragma unroll
      for (int i = 0; i < kTile / kCopyRows; ++i) {
        cp_async_16(weights_stage(s) + copy_offset + i * kCopyRows * 128,
                    w + weight_row(copy_row + kCopyRows * i) * p.k + column, 16);
      }
#pragma unroll
      for (int i = 0; i < kTokens / kCopyRows; ++i) {
        const int row = copy_row + kCopyRows * i;
        const uint32_t at = copy_offset + i * kCopyRows * 128;
        const bool valid = row < valid_tokens;
        if (row < tile_n) {
          cp_async_16(rows_stage(s) + at, p.x + (first + t0 + (valid ? row : 0)) * p.ldx + column,
                      valid ? 16 : 0);
        }
      }
    }
    cp_async_commit();  // an empty group past the end keeps the waits' counting uniform
  };
#pragma unroll
  for (int s = 0; s < kLead; ++s) load(s, s);

  const int warpgroup = threadIdx.x / 128;
  const uint32_t weight_rows = static_cast<uint32_t>(warpgroup) * 64 * 128;  // its 64 rows
  float d[kTokens / 2] = {};
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kLead - 1>();  // tile kt has landed (this thread's copies)
    fence_proxy_async_shared();  // read by the tensor cores' proxy
    // Everyone's copies of tile kt have landed, and both warpgroups' products of step kt - 2
    // are done (the wgmma_wait<1> below), so its stage can be refilled.
    __syncthreads();
    load(kt + kLead, static_cast<int>((kt + kLead) % kStages));
    const int s = static_cast<int>(kt % kStages);
    wgmma_fence_registers(d);
    wgmma_fence();
    const uint32_t weights = weights_stage(s) + weight_rows, rows = rows_stage(s);
    multiply_step<kTokens>(tile_n, d, weights, rows, kt == 0);
    wgmma_commit();
    wgmma_wait<1>();  // step kt - 1's products are done; step kt's run on
    wgmma_fence_registers(d);
  }
  wgmma_wait<0>();
  wgmma_fence_registers(d);
  cp_async_wait<0>();
  __syncthreads();  // the ring is free for the epilogue's tiles

  // d[4 j + c]: weight row 16 warp + lane / 4 (+ 8 for c >= 2) of the warpgroup's 64, token
  // 8 j + 2 (lane % 4) + c % 2 (wgmma.cuh's accumulator layout).
  uint8_t* ring = shared_raw + (base - shared_address(shared_raw));
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int row_in_warpgroup = warp * 16 + lane / 4;
  const auto token_of = [&](int j, int c) { return 8 * j + 2 * (lane % 4) + c % 2; };
  const auto row_of = [&](int c) { return row_in_warpgroup + (c >= 2 ? 8 : 0); };
  if constexpr (!kGated) {
    float* tile = reinterpret_cast<float*>(ring);
#pragma unroll
    for (int j = 0; j < kTokens / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        tile[token_of(j, c) * kLdPlain + warpgroup * 64 + row_of(c)] = d[4 * j + c];
      }
    }
    __syncthreads();
    // A token's 128 values are 32 float4: a warp stores one token row.
    const int vec = threadIdx.x % 32;
    for (int t = threadIdx.x / 32; t < valid_tokens; t += kThreads / 32) {
      const float4 v = *reinterpret_cast<const float4*>(tile + t * kLdPlain + 4 * vec);
      *reinterpret_cast<float4*>(p.y + (first + t0 + t) * p.ldy + m0 + 4 * vec) = v;
    }
  } else {
    // Warpgroup 0's gate and warpgroup 1's up products side by side, then a token's 64
    // activations as 8 pieces of 8 (16 bytes of BF16) by 8 threads.
    float* products = reinterpret_cast<float*>(ring + warpgroup * kGatedTileBytes);
#pragma unroll
    for (int j = 0; j < kTokens / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) products[token_of(j, c) * kLdGated + row_of(c)] = d[4 * j + c];
    }
    __syncthreads();
    const float* gate = reinterpret_cast<const float*>(ring);
    const float* up = reinterpret_cast<const float*>(ring + kGatedTileBytes);
    const int piece = threadIdx.x % 8;
    for (int t = threadIdx.x / 8; t < valid_tokens; t += kThreads / 8) {
      const float* g = gate + t * kLdGated + 8 * piece;
      const float* u = up + t * kLdGated + 8 * piece;
      uint32_t packed[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        packed[i] = silu_mul_bf16_bits(g[2 * i], u[2 * i]) |
                    (uint32_t{silu_mul_bf16_bits(g[2 * i + 1], u[2 * i + 1])} << 16);
      }
      *reinterpret_cast<uint4*>(p.act + (first + t0 + t) * p.ld_act + m0 + 8 * piece) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
}

template <bool kGated>
void launch(const ExpertGemmParams& p, dim3 grid, cudaStream_t stream) {
  switch (p.stages) {
    case 3:
      return launch_large_shared<expert_gemm_kernel<kGated, 3>>(grid, kThreads, kSharedBytes<3>,
                                                                stream, p);
    case 4:
      return launch_large_shared<expert_gemm_kernel<kGated, 4>>(grid, kThreads, kSharedBytes<4>,
                                                                stream, p);
    default:
      throw ShapeError("expert_gemm: " + str(p.stages) + " stages (the kernel takes 3 or 4)");
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void expert_gemm(const ExpertGemmParams& p, cudaStream_t stream) {
  const bool gated = p.act != nullptr;
  const int64_t tile_n = gated ? kTile / 2 : kTile, ld_out = gated ? p.ld_act : p.ldy;
  if (p.num_experts < 1 || p.num_experts > 65535 || p.n < tile_n || p.n % tile_n != 0 ||
      p.k < kStepK || p.k % kStepK != 0 || p.ldx < p.k || p.ldx % 8 != 0 || ld_out < p.n ||
      ld_out % (gated ? 8 : 4) != 0 || p.max_rows < 0) {
    throw ShapeError("expert_gemm: " + std::to_string(p.num_experts) + " experts, n " + str(p.n) +
                     ", k " + str(p.k) + ", ldx " + str(p.ldx) + (gated ? ", ld_act " : ", ldy ") +
                     str(ld_out) + ", max_rows " + str(p.max_rows) +
                     (gated ? " (gated; need 1-65535 experts, n a multiple of 64, k of 64, ldx >= "
                              "k a multiple of 8, ld_act >= n a multiple of 8)"
                            : " (need 1-65535 experts, n a multiple of 128, k of 64, ldx >= k a "
                              "multiple of 8, ldy >= n a multiple of 4)"));
  }
  if (p.x == nullptr || p.w == nullptr || p.offsets == nullptr || (!gated && p.y == nullptr)) {
    throw InvalidArgument(
        "expert_gemm: x, w, offsets and y (or act) must be device pointers, "
        "got null");
  }
  if (!aligned16(p.x) || !aligned16(gated ? static_cast<const void*>(p.act) : p.y)) {
    throw InvalidArgument(std::string("expert_gemm: x and ") + (gated ? "act" : "y") +
                          " must be 16-byte aligned");
  }
  const int64_t token_tiles = (p.max_rows + kTokens - 1) / kTokens;
  if (token_tiles == 0) return;
  if (token_tiles > INT32_MAX) throw ShapeError("expert_gemm: max_rows " + str(p.max_rows));
  const dim3 grid(static_cast<unsigned>(token_tiles), static_cast<unsigned>(p.n / tile_n),
                  static_cast<unsigned>(p.num_experts));
  if (gated) return launch<true>(p, grid, stream);
  launch<false>(p, grid, stream);
}

}  // namespace quantmla::gpu
