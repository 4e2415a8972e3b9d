// The routed experts' products of a prefill-sized step as one grouped kernel on the warpgroup
// tensor-core instructions (wgmma.cuh), each expert's exact rows instead of cuBLAS's
// strided-batched product over rows padded to the busiest expert (docs/gpu-kernels.md, "Limits
// and next steps"). Work in progress: not used by the runner until it is measured faster.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace quantmla::gpu {

// y[r, :] = x[r, :] W_e^T (FP32 accumulation, FP32 out) for the rows r in [offsets[e],
// offsets[e + 1]) of every expert e.
struct ExpertGemmParams {
  const uint16_t* x = nullptr;         // [rows, k] BF16 bits, row stride ldx: rows in expert order
  int64_t ldx = 0;                     // (moe_gather's output)
  const uint16_t* const* w = nullptr;  // [E] device array -> [n, k] BF16 bits, row stride k
  const int32_t* offsets = nullptr;    // [E + 1] device: a prefix sum from 0
  int num_experts = 0;
  int64_t n = 0, k = 0;
  float* y = nullptr;  // [rows, n] FP32, row stride ldy
  int64_t ldy = 0;
  int64_t max_rows = 0;  // >= every expert's count (the busiest, from the host's offsets)
};

// Requires n % 128 == 0, k % 64 == 0, ldx % 8 == 0 and 16-byte aligned x and weights (whole
// 16-byte copies), ldy >= n. Throws ShapeError or InvalidArgument (with the values) otherwise.
// Experts without rows are skipped (their weight pointer may be null).
void expert_gemm(const ExpertGemmParams& p, cudaStream_t stream);

}  // namespace quantmla::gpu
