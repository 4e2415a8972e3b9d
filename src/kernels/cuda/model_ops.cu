// Kernels of model_ops.h: memory-bound elementwise and per-row work, one block per row where a
// row needs a reduction, grid-stride loops elsewhere. The arithmetic follows the CPU engine's
// operation by operation (explicit __fmul_rn / __fadd_rn where nvcc would otherwise contract into
// fused multiply-adds) so that FP32 results agree with it up to the libm differences.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "kernels/cuda/bf16_bits.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/model_ops.h"
#include "kernels/cuda/rotary.cuh"
#include "kernels/cuda/row_norm.cuh"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

constexpr int kRowThreads = 256;

std::string str(int64_t v) { return std::to_string(v); }

__device__ __forceinline__ float quiet_nan() { return __uint_as_float(0x7fc00000u); }

// Stores one value as FP32 or BF16 (the output dtype of a row kernel).
__device__ __forceinline__ void store(void* base, int64_t index, bool bf16, float value) {
  if (bf16) {
    static_cast<uint16_t*>(base)[index] = to_bf16_bits(value);
  } else {
    static_cast<float*>(base)[index] = value;
  }
}

void check_out_dtype(const char* who, DType dtype) {
  if (dtype != DType::kF32 && dtype != DType::kBF16) {
    throw InvalidArgument(std::string(who) + ": output dtype must be F32 or BF16, got " +
                          std::string(dtype_name(dtype)));
  }
}

// Rows become grid.x, which holds 2^31 - 1 blocks.
void check_rows(const char* who, int64_t rows) {
  if (rows < 0 || rows > INT_MAX) {
    throw ShapeError(std::string(who) + ": " + str(rows) + " rows (need 0 <= rows <= 2^31 - 1)");
  }
}

__global__ void __launch_bounds__(kRowThreads)
    embed_kernel(const int32_t* ids, const uint16_t* table, float* x, int64_t d, int64_t vocab) {
  wait_for_previous_kernel();
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  float* out = x + t * d;
  if (id < 0 || id >= vocab) {
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) out[i] = quiet_nan();
    return;
  }
  const uint16_t* row = table + id * d;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) out[i] = from_bf16_bits(row[i]);
}

__global__ void __launch_bounds__(kRowThreads)
    rms_norm_kernel(const float* x, int64_t ldx, const float* weight, void* out, int64_t ldo,
                    bool bf16, int64_t width, float eps) {
  static_assert(kRowThreads == kNormPartials, "one warp per total of row_norm.cuh");
  wait_for_previous_kernel();
  __shared__ double totals[kNormTotals];
  const float* in = x + static_cast<int64_t>(blockIdx.x) * ldx;
  const int warp = static_cast<int>(threadIdx.x / 32);
  const double total = row_squares_total(in, width, warp);
  if (threadIdx.x % 32 == 0) totals[warp] = total;
  __syncthreads();
  const float inv_rms = inv_rms_from_totals(totals, width, eps);
  const int64_t row_out = static_cast<int64_t>(blockIdx.x) * ldo;
  for (int64_t i = threadIdx.x; i < width; i += kRowThreads) {
    store(out, row_out + i, bf16, normalized(in[i], weight[i], inv_rms));
  }
}

__global__ void rope_kernel(float* x, int64_t ld_token, int64_t ld_vec, const int32_t* positions,
                            const float* inv_freq, float attention_factor, int64_t count) {
  wait_for_previous_kernel();
  const int64_t t = blockIdx.x;
  const int64_t v = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  if (v >= count) return;
  const int i = threadIdx.x;
  float* pair = x + t * ld_token + v * ld_vec + 2 * i;
  const float2 r = rotate_pair(pair[0], pair[1], positions[t], inv_freq[i], attention_factor);
  pair[0] = r.x;
  pair[1] = r.y;
}

// Rows along y, columns along x: no 64-bit division per element (it made this kernel
// compute-bound at prefill sizes). kVec consecutive elements per vector (4: one 16-byte load of
// gate and of up, one 8-byte store; the launcher checks the alignment), two vectors a thread with
// both loads issued before either is used (a routed experts' row of 1408 is 352 vectors: one
// block of 192 threads instead of two of 256 with a third of the threads idle), the same
// arithmetic per element either way. Rows whose token_of_row entry is negative (the padding of
// the batched experts' layout) are skipped.
template <int kVec>
__global__ void __launch_bounds__(kRowThreads)
    silu_mul_kernel(const float* __restrict__ gate_up, int64_t ld_gate_up,
                    uint16_t* __restrict__ out, int64_t ldo, int64_t n, int64_t inner,
                    const int32_t* __restrict__ token_of_row) {
  wait_for_previous_kernel();
  const int vectors = static_cast<int>(inner / kVec);
  const int stride = static_cast<int>(gridDim.x * blockDim.x);
  const auto load = [](const float* at, float(&v)[kVec]) {
    if constexpr (kVec == 4) {
      const float4 f = *reinterpret_cast<const float4*>(at);
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      v[0] = *at;
    }
  };
  const auto store = [](uint16_t* at, const float(&g)[kVec], const float(&u)[kVec]) {
    uint16_t y[kVec];
    for (int i = 0; i < kVec; ++i) y[i] = silu_mul_bf16_bits(g[i], u[i]);
    if constexpr (kVec == 4) {
      *reinterpret_cast<uint2*>(at) =
          make_uint2(y[0] | (uint32_t{y[1]} << 16), y[2] | (uint32_t{y[3]} << 16));
    } else {
      *at = y[0];
    }
  };
  for (int64_t r = blockIdx.y; r < n; r += gridDim.y) {
    if (token_of_row != nullptr && token_of_row[r] < 0) continue;
    const float* gate = gate_up + r * ld_gate_up;
    uint16_t* o = out + r * ldo;
    for (int v = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); v < vectors;
         v += 2 * stride) {
      const int w = v + stride;
      float g0[kVec], u0[kVec], g1[kVec], u1[kVec];
      load(gate + static_cast<int64_t>(v) * kVec, g0);
      load(gate + inner + static_cast<int64_t>(v) * kVec, u0);
      if (w < vectors) {
        load(gate + static_cast<int64_t>(w) * kVec, g1);
        load(gate + inner + static_cast<int64_t>(w) * kVec, u1);
      }
      store(o + static_cast<int64_t>(v) * kVec, g0, u0);
      if (w < vectors) store(o + static_cast<int64_t>(w) * kVec, g1, u1);
    }
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// One warp per (token, head), kQueryWarps heads of a token a block: 16-byte loads across a warp
// (a head's 128 nope values in one load instruction), few blocks.
constexpr int kQueryWarps = 8;

__global__ void __launch_bounds__(32 * kQueryWarps)
    rope_queries_kernel(const __grid_constant__ RopeQueriesParams p, int heads, bool vectors) {
  wait_for_previous_kernel();
  const int h = static_cast<int>(blockIdx.y) * kQueryWarps + static_cast<int>(threadIdx.x / 32);
  if (h >= heads) return;
  rope_query_head(p, blockIdx.x, h, static_cast<int>(threadIdx.x % 32), 32, vectors);
}

__global__ void __launch_bounds__(kRowThreads)
    gather_rows_kernel(const float* src, int64_t ld_src, int64_t src_rows, const int32_t* rows,
                       void* dst, int64_t ld_dst, bool bf16, int64_t width) {
  wait_for_previous_kernel();
  const int64_t i = blockIdx.x;
  const int64_t row = rows[i];
  const bool valid = row >= 0 && row < src_rows;
  const float* in = src + (valid ? row : 0) * ld_src;
  for (int64_t c = threadIdx.x; c < width; c += kRowThreads) {
    store(dst, i * ld_dst + c, bf16, valid ? in[c] : quiet_nan());
  }
}

}  // namespace

void embed(const int32_t* ids, const uint16_t* table, float* x, int64_t n, int64_t d, int64_t vocab,
           cudaStream_t stream) {
  check_rows("embed", n);
  if (d < 1 || vocab < 1) {
    throw ShapeError("embed: d " + str(d) + ", vocab " + str(vocab) + " (need both >= 1)");
  }
  if (n == 0) return;
  if (ids == nullptr || table == nullptr || x == nullptr) {
    throw InvalidArgument("embed: ids, table and x must be device pointers, got null");
  }
  launch_kernel(embed_kernel, static_cast<unsigned>(n), kRowThreads, 0, stream, ids, table, x, d,
                vocab);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

void rms_norm(const float* x, int64_t ldx, const float* weight, void* out, int64_t ldo,
              DType out_dtype, int64_t n, int64_t width, float eps, cudaStream_t stream) {
  check_rows("rms_norm", n);
  check_out_dtype("rms_norm", out_dtype);
  if (width < 1 || ldx < width || ldo < width) {
    throw ShapeError("rms_norm: width " + str(width) + ", ldx " + str(ldx) + ", ldo " + str(ldo) +
                     " (need width >= 1, ldx >= width, ldo >= width)");
  }
  if (out_dtype == DType::kBF16 && static_cast<const void*>(x) == out) {
    throw InvalidArgument("rms_norm: a BF16 output cannot overwrite its FP32 input in place");
  }
  if (out_dtype == DType::kF32 && static_cast<const void*>(x) == out && ldo != ldx) {
    throw InvalidArgument("rms_norm: in place needs ldo == ldx, got " + str(ldo) + " and " +
                          str(ldx));
  }
  if (n == 0) return;
  if (x == nullptr || weight == nullptr || out == nullptr) {
    throw InvalidArgument("rms_norm: x, weight and out must be device pointers, got null");
  }
  launch_kernel(rms_norm_kernel, static_cast<unsigned>(n), kRowThreads, 0, stream, x, ldx, weight,
                out, ldo, out_dtype == DType::kBF16, width, eps);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

void rope(float* x, int64_t ld_token, int64_t ld_vec, const int32_t* positions,
          const float* inv_freq, float attention_factor, int64_t n, int64_t count, int dim,
          cudaStream_t stream) {
  check_rows("rope", n);
  if (dim < 2 || dim > 512 || dim % 2 != 0) {
    throw ShapeError("rope: dim " + std::to_string(dim) + " (need an even dim in [2, 512])");
  }
  // Not a full overlap check (layouts may put vectors outside tokens), the obvious mistakes only.
  if (count < 0 || (count > 1 && ld_vec < dim) || (n > 1 && ld_token < dim)) {
    throw ShapeError("rope: count " + str(count) + ", dim " + std::to_string(dim) + ", ld_vec " +
                     str(ld_vec) + ", ld_token " + str(ld_token) +
                     " (need count >= 0, ld_vec >= dim and ld_token >= dim: vectors must not "
                     "overlap)");
  }
  if (n == 0 || count == 0) return;
  if (x == nullptr || positions == nullptr || inv_freq == nullptr) {
    throw InvalidArgument("rope: x, positions and inv_freq must be device pointers, got null");
  }
  const int half = dim / 2;
  const int vectors_per_block = half >= kRowThreads ? 1 : kRowThreads / half;
  const int64_t chunks = (count + vectors_per_block - 1) / vectors_per_block;
  if (chunks > 65535) {
    throw ShapeError("rope: count " + str(count) +
                     " vectors per token is more than the grid holds");
  }
  const dim3 block(static_cast<unsigned>(half), static_cast<unsigned>(vectors_per_block));
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(chunks));
  launch_kernel(rope_kernel, grid, block, 0, stream, x, ld_token, ld_vec, positions, inv_freq,
                attention_factor, count);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

void silu_mul(const float* gate_up, int64_t ld_gate_up, uint16_t* out, int64_t ldo, int64_t n,
              int64_t inner, cudaStream_t stream, const int32_t* token_of_row) {
  if (n < 0 || inner < 1 || ld_gate_up < 2 * inner || ldo < inner) {
    throw ShapeError("silu_mul: n " + str(n) + ", inner " + str(inner) + ", ld_gate_up " +
                     str(ld_gate_up) + ", ldo " + str(ldo) +
                     " (need n >= 0, inner >= 1, ld_gate_up >= 2 * inner, ldo >= inner)");
  }
  if (n == 0) return;
  if (gate_up == nullptr || out == nullptr) {
    throw InvalidArgument("silu_mul: gate_up and out must be device pointers, got null");
  }
  const bool vector = inner % 4 == 0 && ld_gate_up % 4 == 0 && ldo % 4 == 0 &&
                      aligned(gate_up, 16) && aligned(out, 8);
  const int64_t vectors = vector ? inner / 4 : inner;
  // Two vectors a thread: whole warps, at most kRowThreads a block, blocks along x past that.
  const int64_t pairs = (vectors + 1) / 2;
  const int threads = static_cast<int>(std::min<int64_t>(kRowThreads, (pairs + 31) / 32 * 32));
  const int64_t blocks_x = std::min<int64_t>(64, (pairs + threads - 1) / threads);
  const dim3 grid(static_cast<unsigned>(blocks_x),
                  static_cast<unsigned>(std::min<int64_t>(n, 65535)));
  if (vector) {
    launch_kernel(silu_mul_kernel<4>, grid, threads, 0, stream, gate_up, ld_gate_up, out, ldo, n,
                  inner, token_of_row);
  } else {
    launch_kernel(silu_mul_kernel<1>, grid, threads, 0, stream, gate_up, ld_gate_up, out, ldo, n,
                  inner, token_of_row);
  }
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

void check_rope_queries(const RopeQueriesParams& p) {
  check_rows("rope_queries", p.tokens);
  const int64_t qk = static_cast<int64_t>(p.nope) + p.rope;
  if (p.heads < 1 || p.heads > 65535 || p.nope < 0 || p.rope < 2 || p.rope > 512 ||
      p.rope % 2 != 0 || p.q_token_stride < p.heads * qk) {
    throw ShapeError("rope_queries: heads " + std::to_string(p.heads) + ", nope " +
                     std::to_string(p.nope) + ", rope " + std::to_string(p.rope) +
                     ", q_token_stride " + str(p.q_token_stride) +
                     " (need 1 <= heads <= 65535, nope >= 0, an even rope in [2, 512], "
                     "q_token_stride >= heads * (nope + rope))");
  }
  if (p.decode_q != nullptr && (p.rope != kQueryDim - kQueryContent || p.heads_padded < p.heads ||
                                p.heads_padded % 16 != 0 || p.heads_padded > 65535)) {
    throw ShapeError("rope_queries: decode_q with rope " + std::to_string(p.rope) + ", heads " +
                     std::to_string(p.heads) + ", heads_padded " + std::to_string(p.heads_padded) +
                     " (need rope 64 and heads_padded >= heads a multiple of 16)");
  }
  if (p.tokens > 0 &&
      (p.q == nullptr || p.q_bf16 == nullptr || p.positions == nullptr || p.inv_freq == nullptr)) {
    throw InvalidArgument(
        "rope_queries: q, q_bf16, positions and inv_freq must be device pointers, got null");
  }
}

void rope_queries(const RopeQueriesParams& p, cudaStream_t stream) {
  check_rope_queries(p);
  if (p.tokens == 0) return;
  const int heads = p.decode_q != nullptr ? p.heads_padded : p.heads;
  const dim3 grid(static_cast<unsigned>(p.tokens),
                  static_cast<unsigned>((heads + kQueryWarps - 1) / kQueryWarps));
  launch_kernel(rope_queries_kernel, grid, 32 * kQueryWarps, 0, stream, p, heads,
                rope_queries_vectorizable(p));
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

void gather_rows(const float* src, int64_t ld_src, int64_t src_rows, const int32_t* rows, int64_t m,
                 void* dst, int64_t ld_dst, DType dst_dtype, int64_t width, cudaStream_t stream) {
  check_rows("gather_rows", m);
  check_out_dtype("gather_rows", dst_dtype);
  if (width < 1 || ld_src < width || ld_dst < width || src_rows < 0) {
    throw ShapeError("gather_rows: width " + str(width) + ", ld_src " + str(ld_src) + ", ld_dst " +
                     str(ld_dst) + ", src_rows " + str(src_rows) +
                     " (need width >= 1, ld_src >= width, ld_dst >= width)");
  }
  if (m == 0) return;
  if (src == nullptr || rows == nullptr || dst == nullptr) {
    throw InvalidArgument("gather_rows: src, rows and dst must be device pointers, got null");
  }
  launch_kernel(gather_rows_kernel, static_cast<unsigned>(m), kRowThreads, 0, stream, src, ld_src,
                src_rows, rows, dst, ld_dst, dst_dtype == DType::kBF16, width);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

}  // namespace quantmla::gpu
