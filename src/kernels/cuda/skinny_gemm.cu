// skinny_gemm.h: y = x W^T for few rows, where the time is the weight read.
//
// Design (numbers for an H200: 132 SMs, 228 KB of shared memory per SM, ~4.3 TB/s copy):
// - One CTA owns a tile of 16 or 32 output rows (one or two mma tiles of one group's rows, found
//   through the device offsets; 32 where 16 would read a group's weights twice) and tile_n
//   output columns (8, 16, 32 or 64; kSiluMul loads tile_n gate and tile_n up rows). Its
//   warps split K: warp w takes the 64-element chunks w, w + warps, w + 2 warps, ... of the whole
//   K, accumulates them in FP32 registers with mma.sync m16n8k16 (x rows as A, zero-filled past
//   the tile's rows; W rows as the K-major "col" B operand, which is how a Linear weight [n, k] is
//   stored), and the warps' partial sums are added through shared memory in warp order at the end
//   (a fixed order: the result depends on the inputs and the tiling only, never on timing).
// - Each warp streams its own chunks through a private 4-stage cp.async ring (16 or 32 x 128
//   bytes of x and tile_n x 128 bytes of W per stage, XOR-swizzled 16-byte segments so that
//   ldmatrix is conflict-free), synchronized with __syncwarp only: no block barrier in the main
//   loop, so a warp never waits for a slower one before issuing its next loads. All 4 stages are
//   requested before the first wait, the weights before the x rows (whose addresses wait on
//   row_index). A 128-byte segment of a W row is one cache line; one cp.async instruction covers 4
//   lines.
// - Bytes in flight set the speed when m is small: Little's law with ~1 us of loaded DRAM latency
//   asks for ~4 MB in flight over the GPU. Per CTA that is warps x 4 stages x weight rows x 128
//   bytes, and the CTAs must cover the SMs even for n = 576..3072 (tile_n 8 gives n / 8 CTAs per
//   row tile), so (tile_n, warps) is chosen per launch from the shape and the device
//   (skinny_gemm_tiling, rule and measurements there): one wave of CTAs that busies every SM with
//   enough in flight if there is one, else small CTAs that stream in many waves.
// - Grid over a global row tile space of floor(max_rows / R) + min(groups, max_rows) tiles (R the
//   tile's rows), an upper bound of sum_g ceil(rows_g / R) that depends on the host's numbers only
//   (a CUDA graph replays it with any routing), times the column tiles. Each CTA finds its (group,
//   first row, weights) with a block-wide prefix sum of the groups' tile counts over the offsets,
//   and leaves at once if its tile is past the last one. Grouped: column tiles in blockIdx.x, so
//   the empty row tiles at the end are scheduled last; dense: row tiles in blockIdx.x, so for m >
//   16 the CTAs sharing a column tile run together and all but one find the weights in L2.
// - K not a multiple of 64: the segments past k are zero-filled (cp.async with src-size 0; k is a
//   multiple of 8, so a 16-byte segment is all in or all out). Columns past n likewise.
// - Epilogue: 4 columns per thread, float4 / 8-byte BF16 stores where y is aligned, scalar
//   otherwise; only rows of the tile's group and columns < n are written.
// - A group with rows whose weight pointer is null or not 16-byte aligned (device data the host
//   cannot check) gets NaN rows instead of a fault.
// - __launch_bounds__(256, 1): without the 1, ptxas capped some variants at 64 / 128 registers
//   and spilled; with it they use 64..186 (registers never limit the CTAs per SM here: shared
//   memory does).
// - Weights before the wait: a dense product's weights are constants, and a grouped one's routing
//   may be settled (SkinnyGemmParams::routing_ready), so the first stages are requested, and the
//   rest of the CTA's slice prefetched into L2 (cp.async.bulk.prefetch) when the product's
//   weights take at most 24 MB, before griddepcontrol.wait: under a programmatic dependent launch
//   their transfer overlaps the previous kernel. x (the previous kernel's output) after it.
// - Fused work of a decode step (each to save a launch in the step's chain): x_f32 normalizes
//   the CTA's rows in the prologue into one swizzled block after the stages (NormLayout; the A
//   fragments read it, rows past the tile read one zero segment), with rms_norm's sums in its
//   order (row_norm.cuh); static groups are located and their weights requested before the wait;
//   combine adds the mixture's sums in the last CTA of each column tile (an atomic count over the
//   grid's row tiles, reset by that CTA; the sums' order fixed, so deterministic).
// Measured (H200, bench_skinny, event-timed single launches after an L2 flush, 2.9 us of which
// an empty kernel also takes): the LM head (420 MB) and the routed experts at m = 16 read at the
// copy rate (4.2-4.3 TB/s); 2048 x 2048 at m = 1 takes 7.2 us, ~2 us of it the weights' transfer
// and the rest launch and first-byte latency, which only an overlap with the previous kernel
// (programmatic dependent launch) could hide.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/moe_combine.cuh"
#include "kernels/cuda/row_norm.cuh"
#include "kernels/cuda/skinny_gemm.h"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

constexpr int kMmaRows = 16;  // M of mma.m16n8k16: a CTA's x rows are 1 or 2 of these
constexpr int kChunk = 64;    // K elements of one warp's pipeline stage
constexpr int kChunkBytes = kChunk * 2;
constexpr int kSegmentsPerRow = kChunkBytes / 16;  // 16-byte cp.async segments of a row's chunk
constexpr int kStages = 4;
constexpr int kMaxWarps = 8;
constexpr int kMaxThreads = kMaxWarps * 32;
constexpr int kStepsPerChunk = kChunk / 16;  // mma k-steps
constexpr int64_t kL2PrefetchBytes = int64_t{24} << 20;

static_assert(kSegmentsPerRow == 8, "the XOR swizzle permutes the 8 segments of a 128-byte row");
static_assert(std::is_trivially_copyable_v<SkinnyGemmParams>, "passed to the kernel by value");
static_assert(sizeof(SkinnyGemmParams) <= 4096, "kernel parameters are limited to 4 KB");

// The shared-memory layout of one kernel variant: kMTiles x 16 rows of x per CTA; with kNormX
// the x rows are not in the stages but in one normalized block after them (NormLayout).
template <int kTileN, bool kSilu, int kMTiles, bool kNormX>
struct TileLayout {
  static constexpr int kRows = kMTiles * kMmaRows;                 // x rows of a CTA
  static constexpr int kWeightRows = kSilu ? 2 * kTileN : kTileN;  // gate, then up rows
  static constexpr int kStagedXRows = kNormX ? 0 : kRows;
  // One warp's stage: the rows of x, then the weight rows, 128 bytes each.
  static constexpr int kStageBytes = (kStagedXRows + kWeightRows) * kChunkBytes;
  // The warps' partial sums at the end, [warp][x rows][weight rows + 4] FP32, in the same
  // memory (the 4 floats of padding keep float4 rows 16-byte aligned and shift rows by 4 banks).
  static constexpr int kReduceStride = kWeightRows + 4;
  static_assert(kRows * kReduceStride * 4 <= kStages * kStageBytes,
                "a warp's partial sums fit in its pipeline's shared memory");
  static constexpr size_t smem_bytes(int warps) {
    return static_cast<size_t>(warps) * kStages * kStageBytes;
  }
};

// The normalized x of a CTA (x_f32), after the stages: `rows` rows of k rounded up to whole
// 64-element chunks (zeros past k), each chunk's 16-byte segments XOR-swizzled by the row as in the
// stages; then one zero segment (the mma rows past the tile's rows read it), the rows' partial
// totals of the squares and their inv_rms. Host and device compute it alike.
struct NormLayout {
  int64_t row_bytes = 0;
  int64_t zero_offset = 0;
  int64_t totals_offset = 0;
  int64_t inv_rms_offset = 0;
  int64_t bytes = 0;
  __host__ __device__ NormLayout(int64_t rows, int64_t k) {
    row_bytes = (k + kChunk - 1) / kChunk * kChunkBytes;
    zero_offset = rows * row_bytes;
    totals_offset = zero_offset + 16;
    inv_rms_offset = totals_offset + rows * kNormTotals * 8;
    bytes = inv_rms_offset + rows * 4;
  }
};

// Rows of normalized x a CTA of m_tiles keeps: its tile's rows, at most max_rows.
__host__ __device__ inline int64_t norm_rows(int m_tiles, int64_t max_rows) {
  return max_rows < m_tiles * kMmaRows ? max_rows : m_tiles * kMmaRows;
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Byte offset of 16-byte segment `segment` of row `row` in a tile of 128-byte rows: the segment
// index XOR the row's low 3 bits, so 8 consecutive rows at one logical segment hit 8 different
// bank groups (ldmatrix reads such 8-row columns).
__device__ __forceinline__ uint32_t swizzled(int row, int segment) {
  return static_cast<uint32_t>(row * kChunkBytes + ((segment ^ (row & 7)) << 4));
}

struct RowTile {
  int group;  // -1: no rows (a tile past the last one)
  int first_row;
  int rows;
  const uint16_t* gate;  // the group's weights (up: kSiluMul only)
  const uint16_t* up;
};

// The (group, first row, rows, weights) of row tile `tile`: the tiles are the groups' ceil(rows /
// tile_rows) tiles in group order. The whole block calls it (block-wide prefix sum over the groups,
// in chunks of blockDim.x); each thread reads its group's weight pointers together with its
// offsets, so that finding the tile costs one round trip to memory, not two. Offsets are clamped to
// [0, max_rows] so that malformed offsets can never make a write past y's max_rows rows.
template <bool kSilu>
__device__ RowTile locate_tile(const SkinnyGemmParams& p, int tile, int tile_rows) {
  const int limit = static_cast<int>(p.max_rows);
  if (p.offsets == nullptr) {
    const int first_row = tile * tile_rows;
    const uint16_t* gate = p.weight != nullptr ? p.weight : p.w[0];
    const uint16_t* up = nullptr;
    if constexpr (kSilu) up = p.weight2 != nullptr ? p.weight2 : p.w2[0];
    return {0, first_row, min(tile_rows, limit - first_row), gate, up};
  }
  __shared__ int warp_totals[kMaxWarps];
  __shared__ int found[3];  // group, first row, rows (no constructor may run on shared memory)
  __shared__ const uint16_t* found_weights[2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  if (threadIdx.x == 0) found[0] = -1;
  const bool single = p.groups == 1;
  int tiles_before_chunk = 0;
  for (int base = 0; base < p.groups; base += blockDim.x) {
    const int g = base + threadIdx.x;
    int begin = 0, end = 0;
    const uint16_t* gate = nullptr;
    const uint16_t* up = nullptr;
    if (g < p.groups) {
      begin = min(max(p.offsets[g], 0), limit);
      end = min(max(p.offsets[g + 1], begin), limit);
      gate = single && p.weight != nullptr ? p.weight : p.w[g];
      if constexpr (kSilu) up = single && p.weight2 != nullptr ? p.weight2 : p.w2[g];
    }
    const int tiles = (end - begin + tile_rows - 1) / tile_rows;
    int inclusive = tiles;
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    int first = tiles_before_chunk + inclusive - tiles;
    for (int w = 0; w < warp; ++w) first += warp_totals[w];
    if (tile >= first && tile < first + tiles) {
      const int first_row = begin + (tile - first) * tile_rows;
      found[0] = g;
      found[1] = first_row;
      found[2] = min(tile_rows, end - first_row);
      found_weights[0] = gate;
      found_weights[1] = up;
    }
    for (int w = 0; w < warps; ++w) tiles_before_chunk += warp_totals[w];
    __syncthreads();
    // Uniform: the shared result and the block total are the same for every thread.
    if (found[0] >= 0 || tiles_before_chunk > tile) break;
  }
  return {found[0], found[1], found[2], found_weights[0], found_weights[1]};
}

// The rest of a weight row past the first `skip` elements into L2 (cp.async.bulk.prefetch,
// sm_90): 16-byte aligned, a multiple of 16 bytes (k is a multiple of 8).
__device__ __forceinline__ void prefetch_l2(const uint16_t* row, int64_t skip, int64_t k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (skip >= k) return;
  bulk_prefetch_l2(row + skip, static_cast<uint32_t>((k - skip) * 2));
#endif
}

// Tiles of the static groups (SkinnyGemmParams::static_groups): the first ones of the tile space.
__device__ __forceinline__ int static_tiles(const SkinnyGemmParams& p, int tile_rows) {
  if (p.offsets == nullptr || p.static_groups <= 0) return 0;
  return p.static_groups * static_cast<int>((p.static_rows + tile_rows - 1) / tile_rows);
}

// Tile `tile` (< static_tiles) of a static group, found without reading the offsets.
template <bool kSilu>
__device__ RowTile static_tile(const SkinnyGemmParams& p, int tile, int tile_rows) {
  const int per_group = static_cast<int>((p.static_rows + tile_rows - 1) / tile_rows);
  const int g = tile / per_group;
  const int64_t first_row =
      g * p.static_rows + static_cast<int64_t>(tile - g * per_group) * tile_rows;
  const int64_t rows = min(static_cast<int64_t>(tile_rows), (g + 1) * p.static_rows - first_row);
  const uint16_t* up = nullptr;
  if constexpr (kSilu) up = p.w2[g];
  return {g, static_cast<int>(first_row), static_cast<int>(rows), p.w[g], up};
}

// x_f32: the tile's rows normalized as rms_norm normalizes them (row_norm.cuh), rounded to BF16,
// into the CTA's normalized block (NormLayout, at `block`) and, for the first column tile, into
// normed_out. The whole block calls it.
__device__ void normalize_tile_rows(const SkinnyGemmParams& p, const RowTile& tile, uint8_t* block,
                                    const NormLayout& layout, bool write_out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  auto* totals = reinterpret_cast<double*>(block + layout.totals_offset);
  auto* inv_rms = reinterpret_cast<float*>(block + layout.inv_rms_offset);
  if (threadIdx.x < 4) reinterpret_cast<uint32_t*>(block + layout.zero_offset)[threadIdx.x] = 0u;
  for (int u = warp; u < tile.rows * kNormTotals; u += warps) {
    const float* row = p.x_f32 + static_cast<int64_t>(tile.first_row + u / kNormTotals) * p.ldx;
    const double total = row_squares_total(row, p.k, u % kNormTotals);
    if (lane == 0) totals[u] = total;
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < tile.rows) {
    inv_rms[threadIdx.x] = inv_rms_from_totals(totals + threadIdx.x * kNormTotals, p.k, p.norm_eps);
  }
  __syncthreads();
  // 8 elements (one 16-byte segment) per step; k is a multiple of 8, so a segment is all in or
  // all out of the row.
  const int segments = static_cast<int>(layout.row_bytes / 16);
  for (int e = threadIdx.x; e < tile.rows * segments; e += blockDim.x) {
    const int r = e / segments, segment = e - r * segments;
    const int64_t i0 = static_cast<int64_t>(segment) * 8;
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (i0 < p.k) {
      const float* x = p.x_f32 + static_cast<int64_t>(tile.first_row + r) * p.ldx + i0;
      const float4 x0 = reinterpret_cast<const float4*>(x)[0];
      const float4 x1 = reinterpret_cast<const float4*>(x)[1];
      const float4 w0 = reinterpret_cast<const float4*>(p.norm_weight + i0)[0];
      const float4 w1 = reinterpret_cast<const float4*>(p.norm_weight + i0)[1];
      const float s = inv_rms[r];
      const auto pair = [s](float a, float wa, float b, float wb) {
        return static_cast<uint32_t>(to_bf16_bits(normalized(a, wa, s))) |
               (static_cast<uint32_t>(to_bf16_bits(normalized(b, wb, s))) << 16);
      };
      packed = make_uint4(pair(x0.x, w0.x, x0.y, w0.y), pair(x0.z, w0.z, x0.w, w0.w),
                          pair(x1.x, w1.x, x1.y, w1.y), pair(x1.z, w1.z, x1.w, w1.w));
      if (write_out) {
        uint16_t* out = p.normed_out + static_cast<int64_t>(tile.first_row + r) * p.ld_normed + i0;
        if (aligned16(out)) {
          *reinterpret_cast<uint4*>(out) = packed;
        } else {
          const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
          for (int q = 0; q < 4; ++q) {
            out[2 * q] = static_cast<uint16_t>(words[q] & 0xffffu);
            out[2 * q + 1] = static_cast<uint16_t>(words[q] >> 16);
          }
        }
      }
    }
    *reinterpret_cast<uint4*>(block + r * layout.row_bytes + (segment / 8) * kChunkBytes +
                              (((segment % 8) ^ (r & 7)) << 4)) = packed;
  }
  __syncthreads();
}

// SkinnyGemmParams::combine: every CTA of column tile blockIdx.x (tile or not) counts itself in;
// the last one adds the mixture's sums over the tile's columns into x and resets the count.
template <int kTileN>
__device__ void combine_tail(const SkinnyGemmParams& p) {
  __shared__ int last;
  wait_for_previous_kernel();  // a CTA without a tile may not have waited: the sums read x
  __threadfence();             // this CTA's y stores, before its count
  __syncthreads();
  const SkinnyGemmParams::Combine& c = p.combine;
  if (threadIdx.x == 0) {
    last = atomicAdd(c.counters + blockIdx.x, 1) == static_cast<int>(gridDim.y) - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other CTAs' y stores, before reading them
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTileN;
  for (int64_t e = threadIdx.x; e < c.tokens * kTileN; e += blockDim.x) {
    const int64_t t = e / kTileN, col = n0 + e % kTileN;
    if (col >= p.n) continue;
    const float sum = mixture_sum(static_cast<const float*>(p.y) + col, p.ldy, c.slot_of + t * c.k,
                                  c.weights + t * c.k, c.k, c.shared_groups, c.tokens, t);
    float* x = c.x + t * c.ldx + col;
    *x = __fadd_rn(*x, sum);
  }
  if (threadIdx.x == 0) c.counters[blockIdx.x] = 0;
}

// prefetch: request the rest of the CTA's weight slice (past the first pipeline stages) into L2
// at the start (the host's choice: when the product's weights fit in L2 with room to spare).
template <int kTileN, bool kSilu, int kMTiles, bool kNormX>
__global__ void __launch_bounds__(kMaxThreads, 1)
    skinny_gemm_kernel(const SkinnyGemmParams p, bool prefetch) {
  using Layout = TileLayout<kTileN, kSilu, kMTiles, kNormX>;
  constexpr int kXRows = Layout::kRows;
  constexpr int kRows = Layout::kWeightRows;  // weight rows in a stage
  constexpr int kBlocks = kRows / 8;          // n8 blocks of the mma
  constexpr int kStage = Layout::kStageBytes;
  constexpr int kWeightLoads = kRows * kSegmentsPerRow / 32;  // cp.async per lane and stage
  constexpr int kXLoads = kXRows * kSegmentsPerRow / 32;
  constexpr int kGateLoads = kTileN * kSegmentsPerRow / 32;
  static_assert(kWeightLoads * 32 == kRows * kSegmentsPerRow && kXLoads == 4 * kMTiles);
  extern __shared__ __align__(128) uint8_t smem[];

  // Dense: the row tiles of one column tile are neighbours in the grid (blockIdx.x), so that
  // for m > 16 they run together and all but one find the weights in L2. Grouped: the row tiles
  // come second, so that the empty ones at the end of the tile space are scheduled last.
  const bool dense = p.offsets == nullptr;
  const int tile_index = static_cast<int>(dense ? blockIdx.x : blockIdx.y);
  const bool is_static = tile_index < static_tiles(p, kXRows);
  // The weights (and, for routed experts, the routing: SkinnyGemmParams::routing_ready, or a
  // static group's rows) never depend on the previous kernel, so they are requested before
  // waiting for it: under a programmatic launch their transfer overlaps that kernel's tail.
  const bool early = dense || p.routing_ready || is_static;
  if (!early) wait_for_previous_kernel();
  const RowTile tile = is_static ? static_tile<kSilu>(p, tile_index, kXRows)
                                 : locate_tile<kSilu>(p, tile_index, kXRows);
  if (tile.group < 0 || tile.rows <= 0) {
    if (p.combine.counters != nullptr) combine_tail<kTileN>(p);
    return;
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int64_t n0 = static_cast<int64_t>(dense ? blockIdx.y : blockIdx.x) * kTileN;
  const int64_t k = p.k;
  const int64_t ldw = is_static && p.static_ldw > 0 ? p.static_ldw : k;

  const uint16_t* gate = tile.gate;
  const uint16_t* up = tile.up;
  const bool weights_ok =
      gate != nullptr && aligned16(gate) && (!kSilu || (up != nullptr && aligned16(up)));

  // This lane copies segment `segment` of rows lane / 8 + 4 j (j = 0, 1, ...) of each tile.
  const int segment = lane & 7;
  const int row_in_four = lane >> 3;
  // Weight row lane / 8 + 4 j of the stage: gate row n0 + that (or up row n0 + that - kTileN).
  // Rows < n for j below this lane's count.
  const int64_t columns_left = p.n - n0 - row_in_four;  // > 0 for j with 4 j < columns_left
  const uint16_t* gate_row = gate + (n0 + row_in_four) * ldw + segment * 8;
  const uint16_t* up_row = kSilu ? up + (n0 + row_in_four) * ldw + segment * 8 : nullptr;

  const int total_chunks = static_cast<int>((k + kChunk - 1) / kChunk);
  const int my_chunks = weights_ok ? (total_chunks - warp + warps - 1) / warps : 0;
  const uint32_t warp_base = shared_address(smem) + static_cast<uint32_t>(warp * kStages * kStage);

  // Chunk i of this warp (K chunk warp + i * warps) into stage i % kStages: its weight rows and
  // its x rows (zeros past k, past n and for missing x rows).
  const auto load_weights = [&](int i) {
    if (i >= my_chunks) return;
    const int64_t k0 = static_cast<int64_t>(warp + i * warps) * kChunk;
    const bool in_k = k0 + segment * 8 < k;
    const uint32_t stage = warp_base + static_cast<uint32_t>((i % kStages) * kStage);
#pragma unroll
    for (int j = 0; j < kWeightLoads; ++j) {
      const int r = row_in_four + 4 * j;
      const int jj = j < kGateLoads ? j : j - kGateLoads;
      const bool ok = in_k && 4 * jj < columns_left;
      const uint16_t* row = j < kGateLoads ? gate_row : up_row;
      cp_async_16(stage + swizzled(Layout::kStagedXRows + r, segment),
                  ok ? row + static_cast<int64_t>(4 * jj) * ldw + k0 : gate, ok ? 16 : 0);
    }
  };
  // Rows without x data (past the tile's rows, or a row_index outside x) are zeros in every
  // chunk: written once into each stage buffer by the first kStages chunks, then left alone.
  const auto load_x = [&](int i, const uint16_t* const(&x_rows)[kXLoads]) {
    if (i >= my_chunks) return;
    const int64_t k0 = static_cast<int64_t>(warp + i * warps) * kChunk;
    const bool in_k = k0 + segment * 8 < k;
    const uint32_t stage = warp_base + static_cast<uint32_t>((i % kStages) * kStage);
#pragma unroll
    for (int j = 0; j < kXLoads; ++j) {
      if (x_rows[j] == nullptr && i >= kStages) continue;
      const int r = row_in_four + 4 * j;
      const bool ok = in_k && x_rows[j] != nullptr;
      cp_async_16(stage + swizzled(r, segment), ok ? x_rows[j] + k0 : p.x, ok ? 16 : 0);
    }
  };

  float acc[kMTiles][kBlocks][4];
  const float start = weights_ok ? 0.0f : __uint_as_float(0x7fc00000u);  // NaN rows, see top
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      acc[m][b][0] = acc[m][b][1] = acc[m][b][2] = acc[m][b][3] = start;
    }
  }

  // All kStages buffers are filled before the first wait (a warp with <= kStages chunks asks for
  // all of them at once: one DRAM round trip, not two). The weights go out first: the x rows'
  // addresses wait on row_index. One commit group holds those weights with chunk 0's x rows,
  // then one group per chunk's x rows, then one per chunk: chunk i is in groups 0..i.
#pragma unroll
  for (int s = 0; s < kStages; ++s) load_weights(s);
  if (prefetch && weights_ok) {
    // The chunks past the first kStages of every warp: elements kStages * warps * kChunk.. of
    // each of the tile's weight rows.
    const int64_t skip = static_cast<int64_t>(kStages) * warps * kChunk;
    for (int r = threadIdx.x; r < kRows; r += blockDim.x) {
      const int column = r < kTileN ? r : r - kTileN;
      if (n0 + column >= p.n) continue;
      prefetch_l2((r < kTileN ? gate : up) + (n0 + column) * ldw, skip, k);
    }
  }
  if (early) wait_for_previous_kernel();  // x (and y, for beta 1) come from earlier kernels
  const uint16_t* x_rows[kXLoads];
  // kNormX: the lane's A-fragment row of each mma tile in the normalized block, or the zero
  // segment (rows past the tile's) with a zero mask, so that every lane reads zeros there.
  [[maybe_unused]] uint32_t a_row_base[kMTiles];
  [[maybe_unused]] uint32_t a_row_mask[kMTiles];
  if constexpr (kNormX) {
    const NormLayout layout(norm_rows(kMTiles, p.max_rows), k);
    uint8_t* block = smem + static_cast<size_t>(warps) * kStages * kStage;
    normalize_tile_rows(p, tile, block, layout, p.normed_out != nullptr && n0 == 0);
    const int fragment_row = (lane & 7) + ((lane >> 3) & 1) * 8;  // a_row below
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
      const int row = kMmaRows * m + fragment_row;
      const bool valid = row < tile.rows;
      a_row_base[m] = shared_address(block) +
                      static_cast<uint32_t>(valid ? row * layout.row_bytes : layout.zero_offset);
      a_row_mask[m] = valid ? 0xffffffffu : 0u;
    }
#pragma unroll
    for (int j = 0; j < kXLoads; ++j) x_rows[j] = nullptr;
  } else {
#pragma unroll
    for (int j = 0; j < kXLoads; ++j) {
      const int r = row_in_four + 4 * j;
      x_rows[j] = nullptr;
      if (r < tile.rows) {
        const int out_row = tile.first_row + r;
        const int64_t source = p.row_index != nullptr ? p.row_index[out_row] : out_row;
        if (source >= 0 && source < p.x_rows) x_rows[j] = p.x + source * p.ldx + segment * 8;
      }
    }
  }
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if constexpr (!kNormX) load_x(s, x_rows);
    cp_async_commit();
  }

  // ldmatrix lane addresses: A (x) matrices rows 0-7 / 8-15 at segments 2s / 2s+1; B (W)
  // matrices rows 0-7 at 2s, rows 0-7 at 2s+1, rows 8-15 at 2s, rows 8-15 at 2s+1.
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_half = lane >> 4;
  const int b_row = (lane & 7) + (lane >> 4) * 8;
  const int b_half = (lane >> 3) & 1;
  for (int i = 0; i < my_chunks; ++i) {
    cp_async_wait<kStages - 1>();  // groups 0..i complete: chunk i landed
    __syncwarp();                  // ... for every lane's copies
    const uint32_t x_tile = warp_base + static_cast<uint32_t>((i % kStages) * kStage);
    const uint32_t w_tile = x_tile + Layout::kStagedXRows * kChunkBytes;
    [[maybe_unused]] const uint32_t chunk_offset =
        static_cast<uint32_t>(warp + i * warps) * kChunkBytes;
#pragma unroll
    for (int s = 0; s < kStepsPerChunk; ++s) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
        if constexpr (kNormX) {
          const uint32_t within = chunk_offset + (((2 * s + a_half) ^ (lane & 7)) << 4);
          ldmatrix_x4(a[m], a_row_base[m] + (within & a_row_mask[m]));
        } else {
          ldmatrix_x4(a[m], x_tile + swizzled(kMmaRows * m + a_row, 2 * s + a_half));
        }
      }
#pragma unroll
      for (int pair = 0; pair < kBlocks / 2; ++pair) {
        uint32_t b[4];
        ldmatrix_x4(b, w_tile + swizzled(16 * pair + b_row, 2 * s + b_half));
#pragma unroll
        for (int m = 0; m < kMTiles; ++m) {
          mma_bf16_16x8x16(acc[m][2 * pair], a[m], b[0], b[1]);
          mma_bf16_16x8x16(acc[m][2 * pair + 1], a[m], b[2], b[3]);
        }
      }
      if constexpr (kBlocks % 2 == 1) {
        uint32_t b[2];
        ldmatrix_x2(b, w_tile + swizzled(8 * (kBlocks - 1) + (lane & 7), 2 * s + b_half));
#pragma unroll
        for (int m = 0; m < kMTiles; ++m) mma_bf16_16x8x16(acc[m][kBlocks - 1], a[m], b[0], b[1]);
      }
    }
    __syncwarp();  // every lane is done reading stage i % kStages: chunk i + kStages goes there
    load_weights(i + kStages);
    if constexpr (!kNormX) load_x(i + kStages, x_rows);
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its pipeline: the shared memory becomes the sums

  constexpr int kStride = Layout::kReduceStride;
  float* partial = reinterpret_cast<float*>(smem);
  {
    const int g = lane >> 2, t = lane & 3;
    float* mine = partial + warp * kXRows * kStride;
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
      float* rows = mine + kMmaRows * m * kStride;
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        const int col = b * 8 + 2 * t;
        *reinterpret_cast<float2*>(rows + g * kStride + col) =
            make_float2(acc[m][b][0], acc[m][b][1]);
        *reinterpret_cast<float2*>(rows + (g + 8) * kStride + col) =
            make_float2(acc[m][b][2], acc[m][b][3]);
      }
    }
  }
  __syncthreads();

  constexpr int kQuads = kTileN / 4;
  const bool bf16 = p.out_dtype == DType::kBF16;
  const bool accumulate = p.beta != 0.0f;
  for (int e = threadIdx.x; e < tile.rows * kQuads; e += blockDim.x) {
    const int row = e / kQuads;
    const int c = (e - row * kQuads) * 4;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    [[maybe_unused]] float u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int w = 0; w < warps; ++w) {  // warp order: deterministic
      const float* sums = partial + (w * kXRows + row) * kStride + c;
      const float4 gv = *reinterpret_cast<const float4*>(sums);
      v[0] += gv.x, v[1] += gv.y, v[2] += gv.z, v[3] += gv.w;
      if constexpr (kSilu) {
        const float4 uv = *reinterpret_cast<const float4*>(sums + kTileN);
        u[0] += uv.x, u[1] += uv.y, u[2] += uv.z, u[3] += uv.w;
      }
    }
    const int64_t out_row = tile.first_row + row;
    const int64_t col = n0 + c;
    const bool full = col + 4 <= p.n;
    if constexpr (kSilu) {
      uint16_t h[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float silu = __fdiv_rn(v[q], __fadd_rn(1.0f, expf(-v[q])));
        h[q] = to_bf16_bits(__fmul_rn(silu, u[q]));
      }
      uint16_t* out = static_cast<uint16_t*>(p.y) + out_row * p.ldy + col;
      if (full && (reinterpret_cast<uintptr_t>(out) & 7u) == 0) {
        *reinterpret_cast<uint2*>(out) =
            make_uint2(h[0] | (uint32_t{h[1]} << 16), h[2] | (uint32_t{h[3]} << 16));
      } else {
        for (int q = 0; q < 4 && col + q < p.n; ++q) out[q] = h[q];
      }
    } else if (bf16) {
      uint16_t* out = static_cast<uint16_t*>(p.y) + out_row * p.ldy + col;
      uint16_t h[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) h[q] = to_bf16_bits(v[q]);
      if (full && (reinterpret_cast<uintptr_t>(out) & 7u) == 0) {
        *reinterpret_cast<uint2*>(out) =
            make_uint2(h[0] | (uint32_t{h[1]} << 16), h[2] | (uint32_t{h[3]} << 16));
      } else {
        for (int q = 0; q < 4 && col + q < p.n; ++q) out[q] = h[q];
      }
    } else {
      float* out = static_cast<float*>(p.y) + out_row * p.ldy + col;
      if (full && aligned16(out)) {
        float4 r = make_float4(v[0], v[1], v[2], v[3]);
        if (accumulate) {
          const float4 old = *reinterpret_cast<const float4*>(out);
          r = make_float4(old.x + r.x, old.y + r.y, old.z + r.z, old.w + r.w);
        }
        *reinterpret_cast<float4*>(out) = r;
      } else {
        for (int q = 0; q < 4 && col + q < p.n; ++q) out[q] = accumulate ? out[q] + v[q] : v[q];
      }
    }
  }
  if (p.combine.counters != nullptr) combine_tail<kTileN>(p);
}

std::string str(int64_t v) { return std::to_string(v); }

bool misaligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; }

// Upper bound of the row tiles of tile_rows rows over all groups (see the top comment): the sum
// of ceil(rows_g / tile_rows) is at most floor(max_rows / tile_rows) plus the groups with rows.
int64_t row_tile_bound(const SkinnyGemmParams& p, int tile_rows) {
  if (p.offsets == nullptr) return (p.max_rows + tile_rows - 1) / tile_rows;
  return p.max_rows / tile_rows + std::min<int64_t>(p.groups, p.max_rows);
}

void validate(const SkinnyGemmParams& p) {
  const bool silu = p.epilogue == SkinnyEpilogue::kSiluMul;
  if (p.k < 8 || p.k % 8 != 0 || p.k > INT_MAX / 2 || p.n < 1 || p.n > INT_MAX / 2 ||
      p.groups < 1 || p.max_rows < 0 || p.max_rows > INT_MAX / 2) {
    throw ShapeError("skinny_gemm: k " + str(p.k) + ", n " + str(p.n) + ", groups " +
                     str(p.groups) + ", max_rows " + str(p.max_rows) +
                     " (need k a positive multiple of 8, n >= 1, groups >= 1, max_rows >= 0, "
                     "each below 2^30)");
  }
  if (p.ldx < p.k || p.ldx % 8 != 0 || p.ldy < p.n || p.x_rows < 0 ||
      (p.row_index == nullptr && p.x_rows < p.max_rows)) {
    throw ShapeError("skinny_gemm: ldx " + str(p.ldx) + ", ldy " + str(p.ldy) + ", x_rows " +
                     str(p.x_rows) + " for k " + str(p.k) + ", n " + str(p.n) + ", max_rows " +
                     str(p.max_rows) +
                     " (need ldx >= k and a multiple of 8, ldy >= n, x_rows >= max_rows without "
                     "row_index)");
  }
  if (row_tile_bound(p, kMmaRows) > 65535) {
    throw ShapeError("skinny_gemm: " + str(row_tile_bound(p, kMmaRows)) +
                     " row tiles for max_rows " + str(p.max_rows) + " and " + str(p.groups) +
                     " groups (at most 65535: grid.y)");
  }
  if (silu ? p.out_dtype != DType::kBF16
           : p.out_dtype != DType::kF32 && p.out_dtype != DType::kBF16) {
    throw InvalidArgument(std::string("skinny_gemm: out_dtype ") +
                          std::string(dtype_name(p.out_dtype)) +
                          (silu ? " for kSiluMul (needs BF16)" : " (needs F32 or BF16)"));
  }
  if ((p.beta != 0.0f && p.beta != 1.0f) ||
      (p.beta != 0.0f && (silu || p.out_dtype != DType::kF32))) {
    throw InvalidArgument("skinny_gemm: beta " + std::to_string(p.beta) + " with " +
                          (silu ? "kSiluMul" : std::string(dtype_name(p.out_dtype))) +
                          " (beta 1 needs kStore with F32 output; otherwise beta 0)");
  }
  const bool one = p.groups == 1;
  const bool have_gate = one && p.weight != nullptr ? true : p.w != nullptr;
  const bool have_up = !silu || (one && p.weight2 != nullptr ? true : p.w2 != nullptr);
  const bool have_x = p.x != nullptr || p.x_f32 != nullptr;
  if (!have_x || p.y == nullptr || !have_gate || !have_up ||
      (p.groups > 1 && p.offsets == nullptr)) {
    throw InvalidArgument(
        std::string("skinny_gemm: null pointer:") + (!have_x ? " x (and x_f32)" : "") +
        (p.y == nullptr ? " y" : "") + (!have_gate ? (one ? " weight and w" : " w") : "") +
        (!have_up ? (one ? " weight2 and w2" : " w2") : "") +
        (p.groups > 1 && p.offsets == nullptr ? " offsets (needed for groups > 1)" : ""));
  }
  const size_t y_alignment = p.out_dtype == DType::kF32 ? 4 : 2;
  if (misaligned16(p.x) || misaligned16(p.x_f32) || misaligned16(p.norm_weight) ||
      (one && misaligned16(p.weight)) || (one && misaligned16(p.weight2)) ||
      reinterpret_cast<uintptr_t>(p.y) % y_alignment != 0) {
    throw InvalidArgument("skinny_gemm: x " + str(reinterpret_cast<intptr_t>(p.x)) + ", x_f32 " +
                          str(reinterpret_cast<intptr_t>(p.x_f32)) + ", norm_weight " +
                          str(reinterpret_cast<intptr_t>(p.norm_weight)) + ", weight " +
                          str(reinterpret_cast<intptr_t>(p.weight)) + ", weight2 " +
                          str(reinterpret_cast<intptr_t>(p.weight2)) +
                          " must be 16-byte aligned, y " + str(reinterpret_cast<intptr_t>(p.y)) +
                          " " + str(y_alignment) + "-byte aligned");
  }
  if (p.static_ldw != 0 && (p.static_ldw < p.k || p.static_ldw % 8 != 0)) {
    throw ShapeError("skinny_gemm: static_ldw " + str(p.static_ldw) + " for k " + str(p.k) +
                     " (need 0, or >= k and a multiple of 8)");
  }
  if (p.static_groups < 0 ||
      (p.static_groups > 0 &&
       (p.offsets == nullptr || p.static_groups > p.groups || p.static_rows < 1 ||
        p.static_rows > INT_MAX / 2 || p.static_groups * p.static_rows > p.max_rows))) {
    throw ShapeError("skinny_gemm: " + str(p.static_groups) + " static groups of " +
                     str(p.static_rows) + " rows with " + str(p.groups) + " groups, max_rows " +
                     str(p.max_rows) + (p.offsets == nullptr ? ", no offsets" : "") +
                     " (need a grouped product, static groups <= groups, rows >= 1 and all of "
                     "them within max_rows)");
  }
  if (p.x_f32 != nullptr) {
    if (p.x != nullptr || p.offsets != nullptr || p.row_index != nullptr ||
        p.norm_weight == nullptr) {
      throw InvalidArgument(std::string("skinny_gemm: x_f32 with") + (p.x != nullptr ? " x" : "") +
                            (p.offsets != nullptr ? " offsets (grouped)" : "") +
                            (p.row_index != nullptr ? " row_index" : "") +
                            (p.norm_weight == nullptr ? " no norm_weight" : "") +
                            " (the normalizing prologue takes dense rows of FP32 x)");
    }
    if (p.normed_out != nullptr && p.ld_normed < p.k) {
      throw ShapeError("skinny_gemm: ld_normed " + str(p.ld_normed) + " below k " + str(p.k));
    }
  }
  const SkinnyGemmParams::Combine& c = p.combine;
  if (c.counters != nullptr &&
      (p.offsets == nullptr || silu || p.out_dtype != DType::kF32 || p.beta != 0.0f ||
       c.slot_of == nullptr || c.weights == nullptr || c.x == nullptr || c.k < 1 || c.tokens < 0 ||
       c.shared_groups < 0 || c.ldx < p.n)) {
    throw InvalidArgument(
        "skinny_gemm: combine with " +
        std::string(p.offsets == nullptr ? "a dense product, " : "") + (silu ? "kSiluMul, " : "") +
        "out_dtype " + std::string(dtype_name(p.out_dtype)) + ", beta " + std::to_string(p.beta) +
        ", k " + std::to_string(c.k) + ", tokens " + str(c.tokens) + ", shared_groups " +
        std::to_string(c.shared_groups) + ", ldx " + str(c.ldx) +
        (c.slot_of == nullptr || c.weights == nullptr || c.x == nullptr
             ? ", a null slot_of, weights or x"
             : "") +
        " (needs a grouped kStore F32 product, beta 0, k >= 1, ldx >= n)");
  }
}

// A kernel variant as a type, for the one dispatch point below.
template <int kTileN, bool kSilu, int kMTiles, bool kNormX>
struct Variant {
  static constexpr int tile_n = kTileN;
  static constexpr bool silu = kSilu;
  static constexpr int m_tiles = kMTiles;
  static constexpr bool norm_x = kNormX;
  using Layout = TileLayout<kTileN, kSilu, kMTiles, kNormX>;
};

// f(Variant<...>{}) for the tiling's tile_n and m_tiles, the epilogue and the normalizing
// prologue; InvalidArgument for a combination without a kernel.
template <class F>
decltype(auto) dispatch(SkinnyTiling tiling, bool silu, bool norm_x, F&& f) {
  const auto with_rows = [&](auto tile_n) -> decltype(auto) {
    constexpr int kTileN = decltype(tile_n)::value;
    const auto with_prologue = [&](auto m_tiles) -> decltype(auto) {
      constexpr int kMTiles = decltype(m_tiles)::value;
      if (norm_x) {
        return silu ? f(Variant<kTileN, true, kMTiles, true>{})
                    : f(Variant<kTileN, false, kMTiles, true>{});
      }
      return silu ? f(Variant<kTileN, true, kMTiles, false>{})
                  : f(Variant<kTileN, false, kMTiles, false>{});
    };
    switch (tiling.m_tiles) {
      case 1:
        return with_prologue(std::integral_constant<int, 1>{});
      case 2:
        return with_prologue(std::integral_constant<int, 2>{});
      default:
        throw InvalidArgument("skinny_gemm: m_tiles " + str(tiling.m_tiles) +
                              " has no kernel (1 or 2)");
    }
  };
  switch (tiling.tile_n) {
    case 8:
      return with_rows(std::integral_constant<int, 8>{});
    case 16:
      return with_rows(std::integral_constant<int, 16>{});
    case 32:
      return with_rows(std::integral_constant<int, 32>{});
    case 64:
      return with_rows(std::integral_constant<int, 64>{});
    default:
      throw InvalidArgument("skinny_gemm: tile_n " + str(tiling.tile_n) +
                            " has no kernel (8, 16, 32 or 64)");
  }
}

// Device numbers that the tiling needs, read once per device (attribute queries are cheap, but
// not free, and a decode step calls this dozens of times).
struct DeviceLimits {
  int sms = 0;
  size_t smem_per_block = 0;
  size_t smem_per_sm = 0;
};

// Shared memory a block keeps for locate_tile's static arrays (and the system's own use).
constexpr size_t kStaticSmemReserve = 1024;

DeviceLimits device_limits() {
  constexpr int kDevices = 64;
  static std::atomic<int> sms[kDevices];
  static std::atomic<int> smem_block[kDevices];
  static std::atomic<int> smem_sm[kDevices];
  int device = 0;
  QUANTMLA_CUDA_CHECK(cudaGetDevice(&device));
  DeviceLimits limits;
  if (device < kDevices && sms[device].load(std::memory_order_relaxed) > 0) {
    limits.sms = sms[device].load(std::memory_order_relaxed);
    limits.smem_per_block = static_cast<size_t>(smem_block[device].load()) - kStaticSmemReserve;
    limits.smem_per_sm = static_cast<size_t>(smem_sm[device].load());
    return limits;
  }
  int count = 0, block = 0, sm = 0;
  QUANTMLA_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  QUANTMLA_CUDA_CHECK(
      cudaDeviceGetAttribute(&block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  QUANTMLA_CUDA_CHECK(
      cudaDeviceGetAttribute(&sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  if (device < kDevices) {
    smem_block[device].store(block);
    smem_sm[device].store(sm);
    sms[device].store(count);
  }
  return {count, static_cast<size_t>(block) - kStaticSmemReserve, static_cast<size_t>(sm)};
}

// Shared memory a CTA keeps past its warps' stages: the normalized block of x_f32 (NormLayout).
size_t norm_bytes(const SkinnyGemmParams& p, int m_tiles) {
  if (p.x_f32 == nullptr) return 0;
  return static_cast<size_t>(NormLayout(norm_rows(m_tiles, p.max_rows), p.k).bytes);
}

// The most warps a CTA of the tiling's variant may have (its warps are ignored) when `extra`
// bytes of its shared memory are not the stages'.
size_t max_warps(SkinnyTiling tiling, bool silu, bool norm_x, size_t smem_limit, size_t extra) {
  if (extra >= smem_limit) return 0;
  return dispatch(tiling, silu, norm_x, [&](auto variant) {
    using Layout = typename decltype(variant)::Layout;
    return std::min<size_t>(kMaxWarps, (smem_limit - extra) / Layout::smem_bytes(1));
  });
}

template <class V>
void launch(const SkinnyGemmParams& p, int warps, cudaStream_t stream) {
  constexpr auto kernel = skinny_gemm_kernel<V::tile_n, V::silu, V::m_tiles, V::norm_x>;
  const size_t smem = V::Layout::smem_bytes(warps) + norm_bytes(p, V::m_tiles);
  // The opt-in above 48 KB, once per device, for all a block may have (the launch asks for its
  // own amount, which sets the occupancy).
  static std::atomic<uint64_t> configured_devices{0};
  int device = 0;
  QUANTMLA_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || (configured_devices.load(std::memory_order_acquire) & bit) == 0) {
    QUANTMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(device_limits().smem_per_block)));
    configured_devices.fetch_or(bit, std::memory_order_acq_rel);
  }
  const auto column_tiles = static_cast<unsigned>((p.n + V::tile_n - 1) / V::tile_n);
  const auto row_tiles = static_cast<unsigned>(row_tile_bound(p, V::Layout::kRows));
  if (p.offsets == nullptr && column_tiles > 65535) {  // grid.y of the dense order
    throw ShapeError("skinny_gemm: n " + str(p.n) + " is " + str(column_tiles) +
                     " column tiles of " + str(V::tile_n) + " (at most 65535 for one group)");
  }
  const dim3 grid =
      p.offsets == nullptr ? dim3(row_tiles, column_tiles) : dim3(column_tiles, row_tiles);
  // Prefetching more than a fraction of L2 (50 MB on an H100 / H200) would evict lines before
  // their use; a grouped product is counted as if every row tile had its own group.
  const int64_t groups_read = p.offsets == nullptr ? 1 : std::min<int64_t>(p.groups, row_tiles);
  const bool prefetch = groups_read * p.n * p.k * 2 * (V::silu ? 2 : 1) <= kL2PrefetchBytes;
  launch_kernel(kernel, grid, warps * 32, smem, stream, p, prefetch);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

// The tiling's checks and the launch; params already validated.
void run(const SkinnyGemmParams& params, SkinnyTiling tiling, cudaStream_t stream) {
  const bool silu = params.epilogue == SkinnyEpilogue::kSiluMul;
  const bool norm_x = params.x_f32 != nullptr;
  const size_t extra = norm_bytes(params, tiling.m_tiles);
  if (norm_x && static_cast<int64_t>(extra) > kSkinnyNormMaxBytes) {
    throw InvalidArgument("skinny_gemm: x_f32 of " +
                          str(norm_rows(tiling.m_tiles, params.max_rows)) + " rows of k " +
                          str(params.k) + " needs " + str(static_cast<int64_t>(extra)) +
                          " bytes of shared memory (at most " + str(kSkinnyNormMaxBytes) + ")");
  }
  const size_t most = max_warps(tiling, silu, norm_x, device_limits().smem_per_block, extra);
  if (tiling.warps < 1 || static_cast<size_t>(tiling.warps) > most) {
    throw InvalidArgument("skinny_gemm: " + str(tiling.warps) + " warps for tile_n " +
                          str(tiling.tile_n) + ", m_tiles " + str(tiling.m_tiles) +
                          (silu ? " kSiluMul" : " kStore") + (norm_x ? " x_f32" : "") + " (1 to " +
                          str(static_cast<int64_t>(most)) + " fit the shared memory)");
  }
  if (params.max_rows == 0) return;
  dispatch(tiling, silu, norm_x,
           [&](auto variant) { launch<decltype(variant)>(params, tiling.warps, stream); });
}

}  // namespace

// The tiling rule, from timings on an H200 (bench/gpu/bench_skinny.cu --sweep: on every shape
// of that benchmark with m <= 16 it picks a tiling within 6% of the best of the 24 it tries):
// - When every CTA of some tiling fits on the GPU at once (one wave), the best such tiling wins:
//   a second, partial wave costs another ~2 us of ramp and latency (q_proj at m = 1: 10.5 us
//   with 384 CTAs of which 264 fit, 8.0 with 192 that all fit). Among them: the most SMs busy
//   (>= 90% counts as all), then enough bytes in flight to cover the DRAM latency (~4 MB in all,
//   or everything), then the widest column tile (x re-read less), then the most bytes in flight.
// - Otherwise (the LM head, the routed experts past m = 1) CTAs stream in many waves and the
//   small ones schedule best: 32 weight rows and 2 warps (48 KB, 4 CTAs an SM) read the 420 MB LM
//   head at the copy rate. The routed experts' 32-row tiles (past ~170 tokens at 6 of 64 experts)
//   take one warp: at 256 tokens 8% faster for gate and up, 6% for down than two warps
//   (bench_skinny --sweep, 2026-12-04); with 16-row tiles one warp is 1-6% slower below 128.
// - Never tile_n 64, nor a single warp in one wave (unless K has < 4 chunks): both measured slower
//   everywhere (one warp cannot keep a CTA's loads and mma going; at m = 64, 64 columns lost
//   7-22% to 32).
SkinnyTiling skinny_gemm_tiling(const SkinnyGemmParams& params) {
  const DeviceLimits limits = device_limits();
  const bool silu = params.epilogue == SkinnyEpilogue::kSiluMul;
  const int gated = silu ? 2 : 1;
  // 32-row tiles where 16 would read a group's weights twice: more than 16 dense rows, or more
  // than 12 rows per group on average (routed experts past batch ~128 at 6 of 64 experts).
  const int m_tiles =
      params.max_rows > (params.offsets == nullptr ? 16 : 12) * params.groups ? 2 : 1;
  const int tile_rows = m_tiles * kMmaRows;
  const int64_t row_tiles = std::max<int64_t>(1, row_tile_bound(params, tile_rows));
  const int64_t chunks = (params.k + kChunk - 1) / kChunk;
  const int64_t warps_by_k = std::max<int64_t>(1, chunks / 2);  // >= 2 chunks a warp
  const int64_t sms = limits.sms;
  const int64_t weight_bytes = params.n * params.k * 2 * gated * row_tiles;
  const bool norm_x = params.x_f32 != nullptr;
  const auto extra = static_cast<int64_t>(norm_bytes(params, m_tiles));
  const int64_t staged_x_rows = norm_x ? 0 : tile_rows;
  constexpr int64_t kLatencyBytes = int64_t{4} << 20;  // ~4.3 TB/s x ~1 us
  constexpr int64_t kMaxWarpsPerSm = 64, kMaxBlocksPerSm = 32;

  SkinnyTiling best{};
  int64_t best_key[4] = {-1, -1, -1, -1};
  for (const int tile_n : {8, 16, 32}) {
    const int64_t weight_rows = int64_t{tile_n} * gated;
    const int64_t ctas = (params.n + tile_n - 1) / tile_n * row_tiles;
    const auto most = static_cast<int64_t>(
        max_warps({tile_n, 1, m_tiles}, silu, norm_x, limits.smem_per_block, extra));
    for (const int64_t warps : {8, 6, 4, 3, 2, 1}) {
      if (warps > most || warps > warps_by_k || (warps == 1 && warps_by_k > 1)) continue;
      const int64_t smem = warps * kStages * (staged_x_rows + weight_rows) * kChunkBytes + extra;
      const int64_t per_sm = std::min({static_cast<int64_t>(limits.smem_per_sm) / (smem + 1024),
                                       kMaxWarpsPerSm / warps, kMaxBlocksPerSm});
      if (ctas > per_sm * sms) continue;  // more than one wave
      const int64_t busy = ctas * 10 >= sms * 9 ? sms : ctas;
      const int64_t chunks_in_flight = std::min(warps * kStages, chunks);
      const int64_t in_flight = ctas * chunks_in_flight * weight_rows * kChunkBytes;
      const int64_t enough = in_flight >= std::min(weight_bytes, kLatencyBytes) ? 1 : 0;
      const int64_t key[4] = {busy, enough, tile_n, in_flight};
      if (std::lexicographical_compare(best_key, best_key + 4, key, key + 4)) {
        std::copy(key, key + 4, best_key);
        best = {tile_n, static_cast<int>(warps), m_tiles};
      }
    }
  }
  if (best.tile_n != 0) return best;
  // Grouped 32-row tiles take one warp: a stage holds as many x rows as weight rows, so one warp's
  // stages are already as large as two warps' with 16-row tiles, and a smaller CTA fits twice as
  // often on an SM.
  const int64_t warps =
      params.offsets != nullptr && m_tiles == 2 ? 1 : std::min<int64_t>(2, warps_by_k);
  return {silu ? 16 : 32, static_cast<int>(warps), m_tiles};
}

bool skinny_norm_fits(int64_t rows, int64_t k) {
  const int64_t tile_rows = rows > kMmaRows ? 2 * kMmaRows : kMmaRows;
  return rows >= 1 && NormLayout(std::min(rows, tile_rows), k).bytes <= kSkinnyNormMaxBytes;
}

void skinny_gemm(const SkinnyGemmParams& params, SkinnyTiling tiling, cudaStream_t stream) {
  validate(params);
  run(params, tiling, stream);
}

void skinny_gemm(const SkinnyGemmParams& params, cudaStream_t stream) {
  validate(params);
  run(params, skinny_gemm_tiling(params), stream);
}

}  // namespace quantmla::gpu
