// The routed experts' products of a prefill-sized step as one grouped kernel on the warpgroup
// tensor-core instructions (wgmma.cuh), each expert's exact rows instead of cuBLAS's
// strided-batched product over rows padded to the busiest expert (docs/gpu-kernels.md, "Limits
// and next steps"). The gated form ends in the MLP's activation, so gate and up never reach
// global memory. Measured slower than the padded cuBLAS products so far, so the runner takes it
// only with CudaRunnerOptions::expert_gemm.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace quantmla::gpu {

// For the rows r in [offsets[e], offsets[e + 1]) of every expert e, either
//   plain (act == nullptr): y[r, :] = x[r, :] W_e^T                  (FP32 accumulation and out)
//   gated (act != nullptr): act[r, :] = bf16(silu(x[r, :] G_e^T) * (x[r, :] U_e^T))
// where W_e = w[e] is [n, k], and in the gated form w[e] is [2 n, k]: G_e its first n rows (gate),
// U_e the next n (up), the stacked gate/up of an MLP; the activation is cpu::silu_mul's (FP32).
struct ExpertGemmParams {
  const uint16_t* x = nullptr;         // [rows, k] BF16 bits, row stride ldx: rows in expert order
  int64_t ldx = 0;                     // (moe_gather's output)
  const uint16_t* const* w = nullptr;  // [E] device array -> [n or 2 n, k] BF16 bits, row stride k
  const int32_t* offsets = nullptr;    // [E + 1] device: a prefix sum from 0
  int num_experts = 0;
  int64_t n = 0, k = 0;
  float* y = nullptr;  // plain: [rows, n] FP32, row stride ldy
  int64_t ldy = 0;
  uint16_t* act = nullptr;  // gated: [rows, n] BF16 bits, row stride ld_act
  int64_t ld_act = 0;
  int64_t max_rows = 0;  // >= every expert's count (the busiest, from the host's offsets)
  // Shared-memory stages of the operand ring (3 or 4, 48 KB each): tiles are copied stages - 2
  // steps of k ahead of the product (one more stage holds the tile the tensor cores may still be
  // reading). 4 was the faster on the H200 for V2-Lite's experts (docs/benchmarks.md, "the
  // prefill's products").
  int stages = 4;
};

// Requires n % 128 == 0 (plain) or n % 64 == 0 (gated), k % 64 == 0, ldx % 8 == 0, ldy % 4 == 0,
// ld_act % 8 == 0, 16-byte aligned x, weights, y and act (whole 16-byte copies), ldy or ld_act >=
// n. Throws ShapeError or InvalidArgument (with the values) otherwise. Experts without rows are
// skipped (their weight pointer may be null).
void expert_gemm(const ExpertGemmParams& p, cudaStream_t stream);

}  // namespace quantmla::gpu
