// Small per-token kernels of the CUDA model runner: embedding, RMSNorm, RoPE, SiLU gating, the
// queries' RoPE and BF16 conversion, row gathers. Every pointer is a device pointer,
// every stride is in elements; BF16 tensors are passed as their uint16_t bits (as gpu_mla.h does).
// Each function launches on `stream`, allocates nothing, checks its arguments on the host (typed
// errors with the values) and checks the launch (CudaError). Device data (token ids, positions,
// row indices) cannot be checked without a synchronization: out-of-range values are guarded on the
// device (a NaN row, never an out-of-bounds read), as documented per function.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "quantmla/dtype.h"

namespace quantmla::gpu {

// x[t, :] = table[ids[t], :] in FP32 for t in [0, n).
//   ids: [n] int32; table: [vocab, d] BF16 bits (contiguous); x: [n, d] FP32 (contiguous).
// An id outside [0, vocab) gives a row of NaN (the runner validates ids on the host first; NaN
// makes a missed check visible instead of silently embedding another token).
void embed(const int32_t* ids, const uint16_t* table, float* x, int64_t n, int64_t d, int64_t vocab,
           cudaStream_t stream);

// out[r, :] = weight * (x[r, :] * inv_rms), inv_rms = float(1 / sqrt(mean_double(x^2) + eps)),
// exactly the CPU's cpu::rms_norm (sum of squares in double, the two products in FP32), then
// rounded to out_dtype.
//   x: [n, width] FP32, row stride ldx; weight: [width] FP32;
//   out: [n, width] FP32 or BF16 (out_dtype), row stride ldo. out may alias x only for F32 with
//   ldo == ldx (each element is read before it is written by the same thread).
void rms_norm(const float* x, int64_t ldx, const float* weight, void* out, int64_t ldo,
              DType out_dtype, int64_t n, int64_t width, float eps, cudaStream_t stream);

// In-place rotary embedding on interleaved pairs (2i, 2i+1), as Rope::apply (src/model/rope.cpp):
// angle = float(positions[t]) * inv_freq[i] in FP32, c = cosf(angle) * attention_factor,
// s = sinf(angle) * attention_factor (accurate cosf/sinf: positions reach 128K and beyond),
// (e, o) -> (e c - o s, o c + e s) without fused multiply-adds, as the CPU rounds.
//   x: FP32, vector v of token t at x + t * ld_token + v * ld_vec, dim values each
//      (q: x = q_proj_out + 128, count = heads, ld_token = heads * 192, ld_vec = 192;
//       k_pe: x = kv_a_out + 512, count = 1, ld_token = 576);
//   positions: [n] int32; inv_freq: [dim / 2] FP32.
// dim even, 2 <= dim <= 512.
void rope(float* x, int64_t ld_token, int64_t ld_vec, const int32_t* positions,
          const float* inv_freq, float attention_factor, int64_t n, int64_t count, int dim,
          cudaStream_t stream);

// out[r, i] = bf16(silu(g) * u), g = gate_up[r, i], u = gate_up[r, inner + i], in FP32 as
// cpu::silu_mul (g / (1 + expf(-g)) * u). One GEMM per projection writes the two halves: gate
// with ldy = ld_gate_up at column 0, up at column inner (or one GEMM on weights stacked as
// [2 * inner, d]).
//   gate_up: [n, 2 * inner] FP32, row stride ld_gate_up >= 2 * inner;
//   out: [n, inner] BF16 bits, row stride ldo >= inner;
//   token_of_row: null, or [n] device: rows whose entry is negative are skipped, their out rows
//   left as they were (the padding rows of the batched experts' layout, moe_pad_layout).
void silu_mul(const float* gate_up, int64_t ld_gate_up, uint16_t* out, int64_t ldo, int64_t n,
              int64_t inner, cudaStream_t stream, const int32_t* token_of_row = nullptr);

// The attention queries in BF16 from the FP32 q projection, RoPE applied to each head's last
// `rope` values with rope()'s arithmetic (one rounding to BF16 after it, as rope() followed by
// quantmla::f32_to_bf16):
//   q_bf16[t, h, :nope]     = bf16(q[t, h, :nope])
//   q_bf16[t, h, nope:]     = bf16(rotate(q[t, h, nope:]))
//   decode_q[t, h, 512:576] = the same rotated values (rope = 64), for h < heads
//   decode_q[t, h, :]       = 0 for h in [heads, heads_padded) (the kernel needs heads % 16 == 0)
// decode_q is the decode kernel's query (MlaDecodeParams::q); its content columns of the real
// heads, W_UK_h^T q_nope_h, are left to the absorption GEMM, which writes them in BF16.
struct RopeQueriesParams {
  // q: [tokens, heads, nope + rope] FP32, token t at q + t * q_token_stride (heads contiguous).
  const float* q = nullptr;
  int64_t q_token_stride = 0;
  uint16_t* q_bf16 = nullptr;          // [tokens, heads, nope + rope] BF16 bits, contiguous
  uint16_t* decode_q = nullptr;        // [tokens, heads_padded, 576] BF16 bits, or null
  int heads_padded = 0;                // heads rounded up to a multiple of 16 (padded_heads())
  const int32_t* positions = nullptr;  // [tokens] int32
  const float* inv_freq = nullptr;     // [rope / 2] FP32
  float attention_factor = 1.0f;
  int64_t tokens = 0;
  int heads = 0;
  int nope = 0;
  int rope = 0;  // even, 2..512
};
void rope_queries(const RopeQueriesParams& params, cudaStream_t stream);
// rope_queries' argument checks alone (its ShapeError and InvalidArgument cases), for a launcher
// that runs its work inside another kernel (write_cache_and_queries, write_queries.h).
void check_rope_queries(const RopeQueriesParams& params);

// heads rounded up to the decode kernel's multiple of 16.
constexpr int padded_heads(int heads) { return (heads + 15) / 16 * 16; }

// No unpad kernel: the decode output [tokens, heads_padded, 512] BF16 is read in place by the W_UV
// batched GEMM (x = out, ldx = heads_padded * 512, stride_x = 512, batch = heads), which skips the
// padding heads.

// dst[i, :] = src[rows[i], :] for i in [0, m), converted to dst_dtype (picks the rows that need
// logits before the final norm / lm_head).
//   src: [src_rows, width] FP32, row stride ld_src; rows: [m] int32;
//   dst: [m, width] FP32 or BF16 (dst_dtype), row stride ld_dst.
// A row index outside [0, src_rows) gives a NaN row.
void gather_rows(const float* src, int64_t ld_src, int64_t src_rows, const int32_t* rows, int64_t m,
                 void* dst, int64_t ld_dst, DType dst_dtype, int64_t width, cudaStream_t stream);

}  // namespace quantmla::gpu
