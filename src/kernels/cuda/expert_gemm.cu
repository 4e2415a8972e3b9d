// expert_gemm.h: a block computes a 128 x 256 tile of y^T for one expert, M = 128 weight rows
// (two consumer warpgroups of 64, wgmma's M) by N = up to 256 of the expert's rows, walking k in
// steps of 64 through a ring of kStages shared-memory stages (128-byte swizzle, both operands
// K-major as stored). A producer warp fills the ring with tensor-map copies (TMA): a stage is
// refilled as soon as both warpgroups' products of it are done (an mbarrier per stage each way),
// so the copies run up to kStages - 1 steps ahead and the warpgroups only multiply (the first
// version's 256 threads each issued 12 cp.async a step with their address arithmetic and met at
// a block barrier every step: 5.5x cuBLAS's instructions, tensor pipe 44% busy). A token tile
// multiplies only its rows rounded up to 32 (wgmma N = 32, 64, ..., 256), so an expert of 190
// rows is one tile of 192 and its weights are read once. The grid runs an expert's token tiles
// fastest, then its weight tiles, so the blocks that read one weight tile (experts of more than
// 256 rows) run side by side and the second read of it hits L2. The accumulators leave through
// shared memory, whole 16-byte stores per row (8-byte ones for BF16 outputs). Gated: the 128 weight
// rows are 64 of gate (warpgroup 0) and the same 64 of up (warpgroup 1); both hand their products
// over in shared memory and all 256 consumer threads write the activation.
#include <climits>
#include <string>
#include <type_traits>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/expert_gemm.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/wgmma.cuh"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

constexpr int kConsumers = 256;                       // two warpgroups
constexpr int kThreads = kConsumers + 32;             // and the producer warp
constexpr int kTile = 128;                            // weight rows (M) of a block
constexpr int kTokens = 256;                          // token rows (N) of a block, at most
constexpr int kStepK = 64;                            // one swizzled column block
constexpr int kBlockBytes = kTile * 128;              // 128 weight rows x 64 BF16
constexpr int kStageBytes = (kTile + kTokens) * 128;  // and 256 token rows
constexpr int kWeightBox = 64;                        // rows of one weight copy
constexpr int kTokenBox = 32;                         // rows of one token copy (tile_n's unit)
// The ring, then a full and an empty barrier per stage, after up to 1023 bytes of alignment.
template <int kStages>
constexpr size_t kSharedBytes = size_t{kStages} * kStageBytes + 1024 + 16 * kStages;
static_assert(kSharedBytes<4> <= 227 * 1024, "fits an SM's shared memory");
static_assert(kStageBytes % 1024 == 0 && kWeightBox * 128 % 1024 == 0 &&
                  kTokenBox * 128 % 1024 == 0,
              "every copy lands on a 1024-byte boundary, where the swizzle pattern starts");

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

// f(std::integral_constant<int, N>) for N = n (a multiple of 32 in [32, kN]): each wgmma shape
// once, chosen by a chain of comparisons that is uniform over the block.
template <int kN = kTokens, class F>
__device__ __forceinline__ void dispatch_tile_n(int n, F&& f) {
  if constexpr (kN > 32) {
    if (n < kN) return dispatch_tile_n<kN - 32>(n, f);
  }
  f(std::integral_constant<int, kN>());
}

std::string str(int64_t v) { return std::to_string(v); }

// The kernel's epilogues: the plain product's FP32 or BF16 outputs, or the gated activation.
enum class Epilogue { kF32, kBf16, kGated };

template <Epilogue kEpilogue, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    expert_gemm_kernel(const __grid_constant__ ExpertGemmParams p,
                       const __grid_constant__ CUtensorMap x_map,
                       const __grid_constant__ CUtensorMap w_map) {
  static_assert(kStages >= 3, "the epilogue's tiles take 3 stages");
  constexpr bool kGated = kEpilogue == Epilogue::kGated;
  wait_for_previous_kernel();
  // Diagnostics (ExpertGemmParams::phases): block-uniform, so the branches below cost nothing else.
  const bool timed = p.phases != nullptr;
  const uint64_t start_clock = timed ? clock64() : 0, start_time = timed ? global_time() : 0;
  const int e = static_cast<int>(blockIdx.z);
  const int64_t count = p.offsets[e + 1] - p.offsets[e];
  const int64_t first = p.rows_per_expert > 0 ? e * p.rows_per_expert : p.offsets[e];
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTokens;
  if (t0 >= count) return;
  const int valid_tokens = static_cast<int>(count - t0 < kTokens ? count - t0 : kTokens);
  const int tile_n = (valid_tokens + 31) / 32 * 32;  // token rows the products cover
  // The block's weight rows of expert e: plain, rows m0 .. m0 + 127; gated, gate rows m0 .. m0 +
  // 63 then up rows n + m0 .. n + m0 + 63.
  const int m0 = static_cast<int>(blockIdx.y) * (kGated ? kTile / 2 : kTile);
  extern __shared__ __align__(16) uint8_t shared_raw[];
  const uint32_t base = swizzle_base(shared_raw);
  const auto weights_stage = [&](int s) { return base + static_cast<uint32_t>(s) * kStageBytes; };
  const auto rows_stage = [&](int s) { return weights_stage(s) + kBlockBytes; };
  uint8_t* ring = shared_raw + (base - shared_address(shared_raw));
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);   // the producer's arrival, with the copies' bytes
      mbarrier_init(&empty[s], 2);  // one arrival a consumer warpgroup
    }
    fence_barrier_init();
  }
  __syncthreads();
  const int k_tiles = static_cast<int>(p.k / kStepK);

  if (threadIdx.x >= kConsumers) {
    // The producer: one thread issues every copy. The j-th refill of stage s waits for the
    // (j - 1)-th completion of its empty barrier (parity (j - 1) % 2).
    if (threadIdx.x != kConsumers) return;
    const int row_a = m0, row_b = kGated ? static_cast<int>(p.n) + m0 : m0 + kWeightBox;
    const int token_row = static_cast<int>(first + t0);
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int s = kt % kStages;
      if (kt >= kStages) mbarrier_wait(&empty[s], (kt / kStages - 1) & 1);
      mbarrier_arrive_expect_bytes(&full[s], static_cast<uint32_t>((kTile + tile_n) * 128));
      const int column = kt * kStepK;
      tma_load_3d(weights_stage(s), &w_map, column, row_a, e, &full[s]);
      tma_load_3d(weights_stage(s) + kWeightBox * 128, &w_map, column, row_b, e, &full[s]);
      for (int i = 0; i < tile_n / kTokenBox; ++i) {
        tma_load_2d(rows_stage(s) + i * kTokenBox * 128, &x_map, column, token_row + i * kTokenBox,
                    &full[s]);
      }
    }
    return;
  }

  const int warpgroup = threadIdx.x / 128;
  const uint32_t weight_rows = static_cast<uint32_t>(warpgroup) * 64 * 128;  // its 64 rows
  // Not initialized: the first product overwrites them (scale-d 0). The k loop is instantiated
  // per shape and chosen once: a chain of shape comparisons inside it makes ptxas inject a
  // warpgroup.arrive into every branch (C7519), and zeroing the accumulators adds more.
  float d[kTokens / 2];
  uint64_t first_data_clock = 0;
  const auto products = [&](auto shape) {
    constexpr int kN = decltype(shape)::value;
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int s = kt % kStages;
      mbarrier_wait(&full[s], (kt / kStages) & 1);  // the copies of tile kt have landed
      if (timed && kt == 0) first_data_clock = clock64();
      wgmma_fence_registers(d);
      wgmma_fence();
      const uint32_t weights = weights_stage(s) + weight_rows, rows = rows_stage(s);
#pragma unroll
      for (int step = 0; step < kStepK / 16; ++step) {
        wgmma_m64nk16_ss<kN>(d, wgmma_descriptor(weights + step * 32),
                             wgmma_descriptor(rows + step * 32), kt > 0 || step > 0);
      }
      wgmma_commit();
      wgmma_wait<1>();  // step kt - 1's products are done; step kt's run on
      wgmma_fence_registers(d);
      if (kt > 0 && threadIdx.x % 128 == 0) mbarrier_arrive(&empty[(kt - 1) % kStages]);
    }
  };
  dispatch_tile_n(tile_n, products);
  wgmma_wait<0>();
  wgmma_fence_registers(d);
  const uint64_t products_clock = timed ? clock64() : 0;
  // Both warpgroups' products are done, and every copy has landed (each was waited for), so the
  // ring is free for the epilogue's tiles.
  named_barrier(1, kConsumers);

  // d[4 j + c]: weight row 16 warp + lane / 4 (+ 8 for c >= 2) of the warpgroup's 64, token
  // 8 j + 2 (lane % 4) + c % 2 (wgmma.cuh's accumulator layout).
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
    named_barrier(1, kConsumers);
    // A token's 128 values are 32 float4: a warp stores one token row (in BF16, 32 pieces of 8
    // bytes, rounded to nearest even as cuBLAS rounds its BF16 outputs).
    const int vec = threadIdx.x % 32;
    for (int t = threadIdx.x / 32; t < valid_tokens; t += kConsumers / 32) {
      const float4 v = *reinterpret_cast<const float4*>(tile + t * kLdPlain + 4 * vec);
      const int64_t at = (first + t0 + t) * p.ldy + m0 + 4 * vec;
      if constexpr (kEpilogue == Epilogue::kF32) {
        *reinterpret_cast<float4*>(p.y + at) = v;
      } else {
        *reinterpret_cast<uint2*>(p.y_bf16 + at) =
            make_uint2(to_bf16_bits(v.x) | (uint32_t{to_bf16_bits(v.y)} << 16),
                       to_bf16_bits(v.z) | (uint32_t{to_bf16_bits(v.w)} << 16));
      }
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
    named_barrier(1, kConsumers);
    const float* gate = reinterpret_cast<const float*>(ring);
    const float* up = reinterpret_cast<const float*>(ring + kGatedTileBytes);
    const int piece = threadIdx.x % 8;
    for (int t = threadIdx.x / 8; t < valid_tokens; t += kConsumers / 8) {
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
  if (timed) {
    named_barrier(1, kConsumers);  // every consumer's stores issued
    if (threadIdx.x == 0) {
      const uint64_t block =
          blockIdx.x + uint64_t{gridDim.x} * (blockIdx.y + uint64_t{gridDim.y} * blockIdx.z);
      ExpertGemmPhases& r = p.phases[block];
      r.start = start_clock;
      r.first_data = first_data_clock;
      r.products_done = products_clock;
      r.end = clock64();
      r.global_start = start_time;
      r.global_end = global_time();
      r.sm = sm_id();
      r.valid = 1;
    }
  }
}

template <Epilogue kEpilogue>
void launch(const ExpertGemmParams& p, dim3 grid, cudaStream_t stream) {
  constexpr bool kGated = kEpilogue == Epilogue::kGated;
  // x: [x_rows, k], copies of 32 rows; w: [E][weight rows, k], copies of 64 rows of one expert.
  const int64_t x_dims[] = {p.k, p.x_rows}, x_strides[] = {p.ldx};
  const int x_box[] = {kStepK, kTokenBox};
  const CUtensorMap x_map = bf16_tensor_map(p.x, 2, x_dims, x_strides, x_box);
  const int64_t w_dims[] = {p.k, kGated ? 2 * p.n : p.n, p.num_experts},
                w_strides[] = {p.k, p.w_stride};
  const int w_box[] = {kStepK, kWeightBox, 1};
  const CUtensorMap w_map = bf16_tensor_map(p.w, 3, w_dims, w_strides, w_box);
  switch (p.stages) {
    case 3:
      return launch_large_shared<expert_gemm_kernel<kEpilogue, 3>>(grid, kThreads, kSharedBytes<3>,
                                                                   stream, p, x_map, w_map);
    case 4:
      return launch_large_shared<expert_gemm_kernel<kEpilogue, 4>>(grid, kThreads, kSharedBytes<4>,
                                                                   stream, p, x_map, w_map);
    default:
      throw ShapeError("expert_gemm: " + str(p.stages) + " stages (the kernel takes 3 or 4)");
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int64_t expert_gemm_blocks(const ExpertGemmParams& p) {
  const int64_t token_tiles = (p.max_rows + kTokens - 1) / kTokens;
  return token_tiles * (p.n / (p.act != nullptr ? kTile / 2 : kTile)) * p.num_experts;
}

void expert_gemm(const ExpertGemmParams& p, cudaStream_t stream) {
  const bool gated = p.act != nullptr;
  const int64_t tile_n = gated ? kTile / 2 : kTile, ld_out = gated ? p.ld_act : p.ldy;
  const int64_t weight_rows = gated ? 2 * p.n : p.n;
  if (p.num_experts < 1 || p.num_experts > 65535 || p.n < tile_n || p.n % tile_n != 0 ||
      p.k < kStepK || p.k % kStepK != 0 || p.ldx < p.k || p.ldx % 8 != 0 || ld_out < p.n ||
      ld_out % (gated ? 8 : 4) != 0 || p.max_rows < 0 || p.x_rows < 1 ||
      p.w_stride < weight_rows * p.k || p.w_stride % 8 != 0 || weight_rows > INT32_MAX ||
      p.x_rows > INT32_MAX || p.rows_per_expert < 0 ||
      (p.rows_per_expert > 0 &&
       (p.rows_per_expert < p.max_rows || p.x_rows < p.num_experts * p.rows_per_expert))) {
    throw ShapeError("expert_gemm: " + std::to_string(p.num_experts) + " experts, n " + str(p.n) +
                     ", k " + str(p.k) + ", ldx " + str(p.ldx) + ", x_rows " + str(p.x_rows) +
                     ", w_stride " + str(p.w_stride) + (gated ? ", ld_act " : ", ldy ") +
                     str(ld_out) + ", max_rows " + str(p.max_rows) + ", rows_per_expert " +
                     str(p.rows_per_expert) +
                     (gated ? " (gated; need 1-65535 experts, n a multiple of 64, k of 64, ldx >= "
                              "k a multiple of 8, ld_act >= n a multiple of 8, "
                            : " (need 1-65535 experts, n a multiple of 128, k of 64, ldx >= k a "
                              "multiple of 8, ldy >= n a multiple of 4, ") +
                     "x_rows >= 1, w_stride >= weight rows x k a multiple of 8, rows_per_expert "
                     "0 or >= max_rows with x_rows >= experts x rows_per_expert)");
  }
  if (p.x == nullptr || p.w == nullptr || p.offsets == nullptr ||
      (!gated && (p.y == nullptr) == (p.y_bf16 == nullptr))) {
    throw InvalidArgument(
        "expert_gemm: x, w, offsets and act (gated) or exactly one of y and y_bf16 (plain) must "
        "be device pointers");
  }
  const bool bf16_out = !gated && p.y_bf16 != nullptr;
  if (!aligned16(p.x) || !aligned16(p.w) ||
      (gated ? !aligned16(p.act)
             : (bf16_out ? reinterpret_cast<uintptr_t>(p.y_bf16) % 8 != 0 : !aligned16(p.y)))) {
    throw InvalidArgument(std::string("expert_gemm: x and w must be 16-byte aligned, ") +
                          (gated      ? "act 16-byte"
                           : bf16_out ? "y_bf16 8-byte"
                                      : "y 16-byte") +
                          " aligned");
  }
  const int64_t token_tiles = (p.max_rows + kTokens - 1) / kTokens;
  if (token_tiles == 0) return;
  if (token_tiles > INT32_MAX) throw ShapeError("expert_gemm: max_rows " + str(p.max_rows));
  const dim3 grid(static_cast<unsigned>(token_tiles), static_cast<unsigned>(p.n / tile_n),
                  static_cast<unsigned>(p.num_experts));
  if (gated) return launch<Epilogue::kGated>(p, grid, stream);
  if (bf16_out) return launch<Epilogue::kBf16>(p, grid, stream);
  launch<Epilogue::kF32>(p, grid, stream);
}

}  // namespace quantmla::gpu
