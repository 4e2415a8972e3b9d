// BF16 GEMMs of the CUDA model runner on cuBLASLt: y = x W^T for the projections (PyTorch Linear
// weights, row-major [out, in]) and strided-batched products for MLA's per-head absorption. BF16
// inputs, FP32 accumulation, FP32 or BF16 output. Every pointer is a device pointer, every leading
// dimension and stride is in elements, all matrices are row-major.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "quantmla/dtype.h"

namespace quantmla::gpu {

// op(W) of a batched product: W as stored, or transposed.
enum class GemmOp { kN, kT };

// y_b = x_b op(W_b) (+ beta y_b) for b in [0, batch).
struct BatchedGemmParams {
  int64_t batch = 1;
  int64_t m = 0;  // rows of x_b and y_b
  int64_t n = 0;  // columns of y_b
  int64_t k = 0;  // columns of x_b
  // x: batch b at x + b * stride_x, [m, k] BF16 bits with row stride ldx.
  const uint16_t* x = nullptr;
  int64_t ldx = 0;
  int64_t stride_x = 0;
  // w: batch b at w + b * stride_w; op kN: [k, n] with row stride ldw (x_b W_b), op kT: [n, k]
  // with row stride ldw (x_b W_b^T). BF16 bits.
  const uint16_t* w = nullptr;
  int64_t ldw = 0;
  int64_t stride_w = 0;
  GemmOp op_w = GemmOp::kN;
  // y: batch b at y + b * stride_y, [m, n] FP32 or BF16 (out_dtype) with row stride ldy.
  void* y = nullptr;
  int64_t ldy = 0;
  int64_t stride_y = 0;
  DType out_dtype = DType::kF32;
  float beta = 0.0f;  // 0: y is only written (may hold NaN before); 1: y += the product
  // Tuned (GemmRunner's tune_min_rows) by the rows of the whole batch, m * batch, instead of m,
  // with the strides of x and y taken to follow m (a later m of the same power of two takes the
  // tuned algorithm): the routed experts' products at a prefill, 64 experts of ~200 rows, whose
  // row count changes from step to step. Not for products whose n follows the step (each new n
  // would be timed again).
  bool tune_by_batch_rows = false;
};

// Owns a cuBLASLt and a cuBLAS handle, one workspace and a cache of matmul plans (descriptors,
// layouts and the heuristic's algorithm) keyed by the problem's shape, strides and pointer
// alignments, so that a repeated shape does no heuristic search and no allocation. The workspace is
// shared by every call, so one runner serves one stream at a time (calls on two streams at once
// would race on it): give each concurrent stream its own runner. Not thread-safe.
class GemmRunner {
 public:
  // cuBLASLt's recommendation for Hopper.
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;

  // Products of at least this many rows (m) are tuned: the first call of a shape times the
  // heuristic's candidates (see tune_min_rows below). Prefill-sized, so decode steps (at most a
  // few hundred rows, some captured in CUDA graphs) keep the heuristic's first choice.
  static constexpr int64_t kDefaultTuneMinRows = 512;

  // workspace: a device buffer of workspace_bytes that the caller keeps alive for the runner's
  // lifetime, or null to let the runner allocate workspace_bytes once, here.
  // tune_min_rows: the first call of a shape with m >= tune_min_rows (m * batch for a product
  // with tune_by_batch_rows), on a stream that is not
  // being captured, runs each of cuBLASLt's first kTuneCandidates algorithms for it that do not
  // split the k sum (split-K or stream-K would change the order of the FP32 sum, so every
  // candidate adds in the same order and the choice does not change the result's bits) three
  // times and keeps the fastest; measured on the H200, the heuristic's first choice was 7-11%
  // slower than the best on 4 of V2-Lite's 6 dense prefill products (bench_prefill_gemms). The
  // timed runs write y (beta 0: the real call overwrites it) or, with beta != 0, a scratch
  // buffer allocated for the tuning and freed after it (no room for it: the first choice is
  // kept). A later shape that differs only in m and rounds up to the same power of two takes the
  // algorithm chosen there without timing (where cuBLASLt accepts it). 0: never tune.
  //
  // batch_invariant: each row of y is the same bits whatever m is (a token's product does not
  // depend on what shares its step; CudaRunnerOptions::batch_invariant). Every product of one
  // shape but m takes one algorithm, cuBLASLt's first that sums each output's k products in one
  // pass for kInvariantReferenceRows rows, chosen at its first call and kept for every m (a row of
  // such an algorithm is computed by one thread block in one order, whichever tile it falls in);
  // no timing (tune_min_rows is ignored), and no cuBLAS fallback: a shape that algorithm cannot
  // run throws InvalidArgument instead of taking another.
  explicit GemmRunner(size_t workspace_bytes = kDefaultWorkspaceBytes, void* workspace = nullptr,
                      int64_t tune_min_rows = kDefaultTuneMinRows, bool batch_invariant = false);
  ~GemmRunner();
  GemmRunner(const GemmRunner&) = delete;
  GemmRunner& operator=(const GemmRunner&) = delete;

  // y[m, n] = x[m, k] W[n, k]^T (+ beta y).
  //   x: [m, k] BF16 bits, row stride ldx >= k.
  //   w: [n, k] BF16 bits (PyTorch Linear weight), row stride ldw >= k.
  //   y: [m, n] FP32 or BF16 (out_dtype), row stride ldy >= n. beta = 1 adds the product into y
  //      (residual adds into the FP32 stream); beta = 0 never reads y.
  // m == 0 or n == 0 is a no-op. Throws ShapeError for k < 1 or a leading dimension that is too
  // small, InvalidArgument for a null pointer or an out_dtype other than F32/BF16, CudaError when
  // cuBLAS fails.
  void linear(int64_t m, int64_t n, int64_t k, const uint16_t* x, int64_t ldx, const uint16_t* w,
              int64_t ldw, void* y, int64_t ldy, DType out_dtype, float beta, cudaStream_t stream);

  // Strided-batched product (see BatchedGemmParams). Same errors as linear, and ShapeError for
  // batch < 1 or a negative stride.
  void batched(const BatchedGemmParams& params, cudaStream_t stream);

  // Plans in the cache (tests, diagnostics).
  size_t cached_plans() const;
  // Plans whose algorithm was chosen by timing (tests, diagnostics; not those that took their
  // bucket's choice).
  size_t tuned_plans() const;

  static constexpr int kTuneCandidates = 8;
  // The rows a batch-invariant runner chooses each shape's algorithm for (prefill-sized: the
  // products where the choice matters most).
  static constexpr int64_t kInvariantReferenceRows = 256;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace quantmla::gpu
