// Products with few rows, y = x W^T with m from 1 to a few dozen (decode steps), where the time is
// the weight read: cuBLASLt picks tiles for large m and reaches a fraction of the copy bandwidth
// there, and the routed experts would need one launch per expert and a host copy of the expert
// offsets. One kernel covers both: a dense linear (one group) and the routed experts (one group
// per expert, rows found through device offsets, so that nothing is synchronized and a decode step
// can be captured in a CUDA graph). BF16 in, FP32 accumulation in a fixed order (deterministic).
// Every pointer is a device pointer; strides are in elements; BF16 tensors are their uint16_t bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "quantmla/dtype.h"

namespace quantmla::gpu {

enum class SkinnyEpilogue {
  kStore,    // y = x W^T (FP32 or BF16 per out_dtype), or y += x W^T (beta = 1, FP32 only)
  kSiluMul,  // y = bf16(silu(x W^T) * (x W2^T)): the gate and up projections of an MLP at once
};

struct SkinnyGemmParams {
  // x: [x_rows, k] BF16 bits, row stride ldx (a multiple of 8, >= k). Output row r reads x row
  // r (then x_rows >= max_rows), or x row row_index[r] when row_index is set (the experts'
  // gather: token_of_slot).
  const uint16_t* x = nullptr;
  int64_t ldx = 0;
  int64_t x_rows = 0;
  const int32_t* row_index = nullptr;  // [rows] or null; an index outside [0, x_rows) reads zeros
  // Groups of rows: group g owns output rows [offsets[g], offsets[g + 1]) and multiplies them by
  // its weights w[g] (and w2[g]). offsets: [groups + 1] device int32, non-decreasing from 0 (a
  // prefix sum: moe_sort's offsets); null for one group of max_rows rows.
  const int32_t* offsets = nullptr;
  int groups = 1;
  // Upper bound of the rows (offsets[groups] <= max_rows); sizes the grid, so a step with a
  // fixed max_rows launches the same grid whatever the routing.
  int64_t max_rows = 0;
  // w: [groups] device array of device pointers, each [n, k] BF16 bits row-major (a PyTorch
  // Linear weight, row stride k), 16-byte aligned. A group with rows must have its weight (one
  // whose pointer is null or misaligned gets NaN rows: the host cannot check device memory). For
  // one dense linear, `weight` may be set instead (then w is ignored).
  const uint16_t* const* w = nullptr;
  const uint16_t* const* w2 = nullptr;  // kSiluMul: the up projections, same shapes
  const uint16_t* weight = nullptr;     // groups == 1 only: the weight itself
  const uint16_t* weight2 = nullptr;    // groups == 1, kSiluMul
  int64_t n = 0;                        // output columns
  int64_t k = 0;                        // a multiple of 8
  // y: [max_rows, n], row stride ldy; rows past offsets[groups] are not written.
  void* y = nullptr;
  int64_t ldy = 0;
  DType out_dtype = DType::kF32;  // kStore: F32 or BF16; kSiluMul: BF16
  float beta = 0.0f;              // kStore with F32 only: 0 (y only written) or 1 (y += x W^T)
  SkinnyEpilogue epilogue = SkinnyEpilogue::kStore;
  // Grouped products: offsets, row_index and the w / w2 arrays were written at least two kernels
  // earlier on the stream (or before it), not by the kernel just before this one, so that under
  // a programmatic dependent launch (launch.cuh) the weights can be requested while that kernel
  // still runs. Dense products always do so (their weights are constants).
  bool routing_ready = false;
  // Grouped products: the first static_groups groups own static_rows rows each (group g rows
  // [g * static_rows, (g + 1) * static_rows); offsets must say the same), so their tiles are
  // found without reading offsets and their weights requested before the previous kernel ends
  // even when the rest of the routing comes from it (the shared experts ahead of the routed ones).
  int static_groups = 0;
  int64_t static_rows = 0;
  // Row stride of the static groups' weight matrices in elements (>= k, a multiple of 8); 0: k
  // (the routed groups' always). A static group's matrix may be a column slice of a wider one:
  // the shared experts' down projection [d, S * inner] split into S groups of [d, inner].
  int64_t static_ldw = 0;

  // Dense products only (offsets and row_index null): x is RMS-normalized in the prologue, so that
  // the norm costs no launch of its own. x_f32: [x_rows, k] FP32, row stride ldx (x must be null);
  // each CTA computes its rows' bf16(norm_weight * (x * inv_rms)) with rms_norm's arithmetic (the
  // same sums in the same order: bit for bit its output) into shared memory and multiplies those.
  // normed_out: optional [max_rows, k] BF16, row stride ld_normed, written by the CTAs of the first
  // column tile, for later kernels that read the same normalized rows.
  const float* x_f32 = nullptr;
  const float* norm_weight = nullptr;  // [k] FP32
  float norm_eps = 0.0f;
  uint16_t* normed_out = nullptr;
  int64_t ld_normed = 0;

  // Grouped kStore products with F32 output only: the mixture-of-experts combine in the product's
  // tail (the routed experts' down projection, y = expert_out in slot order). The last CTA of
  // each column tile to finish (an atomic count over the grid's row tiles in counters[column
  // tile], reset to 0 by that CTA) adds moe_combine's sum over those columns into x:
  //   x[t, c] += sum_j weights[t, j] * y[slot_of[t, j], c]  (j order, fma from 0; slots < 0
  //   skipped)
  //              + sum_{i < shared_groups} y[i * tokens + t, c]
  // counters: [column tiles] int32, zero before the first launch (each launch leaves them zero).
  struct Combine {
    int32_t* counters = nullptr;
    const int32_t* slot_of = nullptr;  // [tokens, k]
    const float* weights = nullptr;    // [tokens, k]
    int k = 0;
    int shared_groups = 0;
    float* x = nullptr;  // [tokens, n] FP32, row stride ldx
    int64_t ldx = 0;
    int64_t tokens = 0;
  } combine;
};

// Most rows a group may have for the skinny kernel to be the right choice; more rows re-read the
// weights once per 32 rows (a caller with more uses GemmRunner). Not a limit of the kernel.
inline constexpr int64_t kSkinnyRowsPerGroup = 64;

// Runs the product on `stream`; no allocation, no synchronization (it may be captured in a CUDA
// graph). Throws ShapeError for k not a positive multiple of 8, ldx/ldy too small (or ldx not a
// multiple of 8), n < 1, groups < 1, max_rows < 0, k, n or max_rows of 2^30 or more, x_rows <
// max_rows without row_index, more than 65535 row tiles (max_rows / 16 + min(groups, max_rows))
// or, for one group without offsets, more than 65535 column tiles; InvalidArgument for a null
// pointer that the call needs (x, y, the weights, offsets for groups > 1), an out_dtype or beta
// the epilogue does not allow, or pointers not 16-byte aligned (x, `weight`, `weight2`; y must
// be aligned to its element), static_ldw below k or not a multiple of 8, static groups past the
// groups or rows, x_f32 with x, a grouped product or row_index, without norm_weight or with rows
// that do not fit (skinny_norm_fits), a combine on a dense product, another
// epilogue or output type, or missing its buffers; CudaError for a failed launch.
void skinny_gemm(const SkinnyGemmParams& params, cudaStream_t stream);

// The most bytes of normalized x (a CTA's rows x k, BF16) that a CTA keeps in shared memory with
// x_f32; skinny_norm_fits says whether a product of `rows` rows and depth k fits (the runner
// fuses the norm only then, and keeps the rms_norm kernel otherwise).
inline constexpr int64_t kSkinnyNormMaxBytes = int64_t{64} << 10;
bool skinny_norm_fits(int64_t rows, int64_t k);

// The launch shape: output columns per CTA (tile_n: 8, 16, 32 or 64), warps per CTA (each
// warp sums its own share of K; 1 to 8, fewer where the shared memory of a wide tile runs out)
// and output rows per CTA in 16-row mma tiles (m_tiles: 1 or 2; a CTA reads its weight slice
// once for all its rows). The result depends on the tiling (the order of the FP32 sums), never
// on anything else.
struct SkinnyTiling {
  int tile_n = 0;
  int warps = 0;
  int m_tiles = 1;
};

// The tiling skinny_gemm(params, stream) uses: from the shape and the current device only.
SkinnyTiling skinny_gemm_tiling(const SkinnyGemmParams& params);

// The same product with a given tiling (tests of every kernel variant, tuning). Throws
// InvalidArgument for a tile_n without a kernel or a warp count that does not fit.
void skinny_gemm(const SkinnyGemmParams& params, SkinnyTiling tiling, cudaStream_t stream);

}  // namespace quantmla::gpu
