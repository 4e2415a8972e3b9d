// The routed experts' products of a prefill-sized step as one grouped kernel on the warpgroup
// tensor-core instructions (wgmma.cuh), each expert's real rows only instead of cuBLAS's
// strided-batched product over rows padded to the busiest expert (docs/gpu-kernels.md, "Limits
// and next steps"). The gated form ends in the MLP's activation, so gate and up never reach
// global memory. The gated product is faster than cuBLAS's padded one and silu_mul; the plain one
// (the down product) is slower than cuBLAS's padded one alone but needs no padding rows, and the
// runner's default (CudaRunnerOptions::expert_products, kOurs) takes both (docs/benchmarks.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace quantmla::gpu {

// Where one block's time goes (a diagnostic: bench_prefill_gemms' "phases" rows): the SM's cycle
// counter at the block's start, when its first stage has landed, when its products are done and
// when all its outputs are written; its SM; the global timer (ns) at its start and end; valid 1
// for a block that computed a tile (the others return at once and leave the record as it was).
struct ExpertGemmPhases {
  uint64_t start, first_data, products_done, end;
  uint64_t global_start, global_end;
  uint32_t sm, valid;
};
static_assert(sizeof(ExpertGemmPhases) == 56, "the record the bench reads");

// For the rows r in [first_e, first_e + count_e) of every expert e, count_e = offsets[e + 1] -
// offsets[e] and first_e = offsets[e] (the exact layout: experts' rows back to back) or, with
// rows_per_expert set, e rows_per_expert (cuBLAS's padded layout, moe_pad_layout: rows past an
// expert's count are neither multiplied into an output nor written), either
//   plain (act == nullptr): y[r, :] = x[r, :] W_e^T       (FP32 accumulation; FP32 or BF16 out)
//   gated (act != nullptr): act[r, :] = bf16(silu(x[r, :] G_e^T) * (x[r, :] U_e^T))
// where W_e = w + e w_stride is [n, k], and in the gated form [2 n, k]: G_e its first n rows
// (gate), U_e the next n (up), the stacked gate/up of an MLP; the activation is cpu::silu_mul's
// (FP32).
struct ExpertGemmParams {
  const uint16_t* x = nullptr;       // [x_rows, k] BF16 bits, row stride ldx: rows in expert order
  int64_t ldx = 0;                   // (moe_gather's output)
  int64_t x_rows = 0;                // rows of x (>= offsets[E]; the copies never read past them)
  const uint16_t* w = nullptr;       // [E] x [n or 2 n, k] BF16 bits, row stride k, expert e at
  int64_t w_stride = 0;              // w + e w_stride (elements)
  const int32_t* offsets = nullptr;  // [E + 1] device: a prefix sum from 0
  int num_experts = 0;
  int64_t n = 0, k = 0;
  float* y = nullptr;          // plain: [rows, n] FP32, row stride ldy
  uint16_t* y_bf16 = nullptr;  // plain, instead of y: [rows, n] BF16 bits (rounded to nearest
  int64_t ldy = 0;             // even from the FP32 sums), row stride ldy
  uint16_t* act = nullptr;     // gated: [rows, n] BF16 bits, row stride ld_act
  int64_t ld_act = 0;
  int64_t max_rows = 0;  // >= every expert's count (the busiest, from the host's offsets)
  // 0: the exact layout; else the padded one, >= max_rows, with x_rows >= num_experts times it.
  int64_t rows_per_expert = 0;
  // Shared-memory stages of the operand ring (3 or 4, 48 KB each), filled by a producer warp's
  // tensor-map copies as soon as the products have released them. 4 is the faster on the H200
  // for V2-Lite's experts (303 against 406 µs gated: docs/benchmarks.md).
  int stages = 4;
  // Diagnostics: one record a block (blocks numbered x fastest, then y, then z), or nullptr.
  ExpertGemmPhases* phases = nullptr;
};

// Requires n % 128 == 0 (plain) or n % 64 == 0 (gated), k % 64 == 0, ldx % 8 == 0, w_stride % 8
// == 0 and >= the rows of one expert times k, ldy % 4 == 0, ld_act % 8 == 0, 16-byte aligned x,
// w, y (or y_bf16, 8-byte aligned) and act, exactly one of y and y_bf16 (plain), ldy or ld_act >=
// n, x_rows >= 1, rows_per_expert 0 or as above. Throws ShapeError or InvalidArgument (with the
// values) otherwise. Experts without rows are skipped.
void expert_gemm(const ExpertGemmParams& p, cudaStream_t stream);

// The blocks expert_gemm launches for p (the records ExpertGemmParams::phases takes).
int64_t expert_gemm_blocks(const ExpertGemmParams& p);

}  // namespace quantmla::gpu
