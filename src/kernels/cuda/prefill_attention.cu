// Expanded-form prefill attention (prefill_attention.h): the up-projection on cuBLAS, then one
// flash-attention kernel. A block takes 64 queries of one head (a warp 16 of them, the M of its
// mma.m16n8k16 products) and walks the visible keys in tiles of 64: the keys [k_nope ; k_pe]
// and the values of the next tile are copied into shared memory (cp.async, two stages) while this
// one is multiplied; S = Q K^T stays in registers, the running maximum and sum are kept per query
// row (in the log2 domain of the scaled scores), P is rounded to BF16 for O += P V, and O is
// divided by the sum at the end. Query tiles are handed out longest first, which evens the causal
// triangle.
#include <cuda_bf16.h>

#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/prefill_attention.h"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

constexpr int kRope = 64;
constexpr int kWarps = 4;  // 16 query rows each
constexpr int kThreads = 32 * kWarps;
constexpr int kQueryTile = 16 * kWarps;
constexpr int kKeyTile = 64;
// Shared rows padded by 16 bytes: the eight rows of an ldmatrix phase fall on distinct banks.
constexpr int kRowPadding = 8;

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }
std::string str(int64_t v) { return std::to_string(v); }

struct FlashParams {
  const uint16_t* q;         // [tokens, heads, nope + 64] BF16 bits, contiguous
  const uint16_t* expanded;  // [context, heads, nope + v] BF16 bits, contiguous
  const uint16_t* k_pe;      // [context, 64] BF16 bits, row stride k_pe_stride
  int64_t k_pe_stride;
  uint16_t* out;  // [tokens, heads * v] BF16 bits, row stride out_stride
  int64_t out_stride;
  int64_t tokens, context;
  int heads;
  float scale_log2;  // softmax_scale * log2(e)
};

template <int kNope, int kV>
struct Tiles {
  static constexpr int kQk = kNope + kRope;
  static constexpr int kKeyRow = kQk + kRowPadding;  // elements of a shared key row
  static constexpr int kValueRow = kV + kRowPadding;
  static constexpr int kStage = kKeyTile * (kKeyRow + kValueRow);  // elements of one stage
  static constexpr size_t kSharedBytes = size_t{2} * kStage * sizeof(uint16_t);
  static_assert(kQk % 16 == 0 && kV % 16 == 0, "whole mma k-steps and n-tile pairs");
  static_assert((kKeyRow * 2) % 128 == 16 && (kValueRow * 2) % 128 == 16,
                "ldmatrix rows on distinct banks");
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <int kNope, int kV>
__global__ void __launch_bounds__(kThreads)
    flash_prefill_kernel(const __grid_constant__ FlashParams p) {
  using T = Tiles<kNope, kV>;
  constexpr int kQkSteps = T::kQk / 16;
  constexpr int kKeyTiles8 = kKeyTile / 8;
  constexpr int kValueTiles8 = kV / 8;
  wait_for_previous_kernel();
  extern __shared__ __align__(16) uint16_t shared[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int m = lane / 8, r8 = lane % 8;  // ldmatrix: this lane's matrix and row
  const int h = blockIdx.y;
  const int64_t q0 = (static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x) * kQueryTile;
  const int64_t first_position = p.context - p.tokens;
  const int64_t row0 = q0 + warp * 16 + g, row1 = row0 + 8;  // this thread's two query rows
  const int64_t pos0 = first_position + row0, pos1 = first_position + row1;

  // The warp's queries as A fragments, straight from global memory (read once).
  uint32_t qf[kQkSteps][4];
  const auto q_word = [&](int64_t row, int col) -> uint32_t {
    if (row >= p.tokens) return 0u;
    return *reinterpret_cast<const uint32_t*>(p.q + (row * p.heads + h) * T::kQk + col);
  };
#pragma unroll
  for (int s = 0; s < kQkSteps; ++s) {
    const int c = s * 16 + 2 * t4;
    qf[s][0] = q_word(row0, c);
    qf[s][1] = q_word(row1, c);
    qf[s][2] = q_word(row0, c + 8);
    qf[s][3] = q_word(row1, c + 8);
  }

  // Keys up to the last query's position; rows past the context are zero-filled (a value of
  // garbage times a probability of 0 would still be NaN).
  const int64_t last_query = q0 + kQueryTile < p.tokens ? q0 + kQueryTile - 1 : p.tokens - 1;
  const int64_t last_key = first_position + last_query;
  const int64_t key_tiles = last_key / kKeyTile + 1;
  // Each thread copies fixed 16-byte columns of every kThreads / columns-th row, so that a tile's
  // copies differ from the previous tile's by constant offsets only.
  const auto copy_rows = [&](auto columns_constant, uint16_t* to, int to_row, const uint16_t* from,
                             int64_t from_row, int64_t j0) {
    constexpr int columns = decltype(columns_constant)::value;
    constexpr int rows_per_pass = kThreads / columns;
    static_assert(kThreads % columns == 0 && (kKeyTile * columns) % kThreads == 0,
                  "whole rows a pass, whole passes a tile");
    const int c = threadIdx.x % columns, r = threadIdx.x / columns;
    const uint16_t* source = from + (j0 + r) * from_row + c * 8;
    uint32_t target = shared_address(to + r * to_row + c * 8);
    const int64_t valid_rows = p.context - j0;
#pragma unroll
    for (int pass = 0; pass < kKeyTile * columns / kThreads; ++pass) {
      const int row = r + pass * rows_per_pass;
      // Rows past the context: zeros, read from the tile's first row (always valid).
      cp_async_16(target, row < valid_rows ? source : from + j0 * from_row + c * 8,
                  row < valid_rows ? 16 : 0);
      source += rows_per_pass * from_row;
      target += rows_per_pass * to_row * 2;
    }
  };
  const int64_t expanded_row = static_cast<int64_t>(p.heads) * (kNope + kV);
  const auto load_tile = [&](int64_t tile, int stage) {
    uint16_t* keys = shared + stage * T::kStage;
    uint16_t* values = keys + kKeyTile * T::kKeyRow;
    const int64_t j0 = tile * kKeyTile;
    const uint16_t* head = p.expanded + h * (kNope + kV);
    copy_rows(std::integral_constant<int, kNope / 8>{}, keys, T::kKeyRow, head, expanded_row, j0);
    copy_rows(std::integral_constant<int, kRope / 8>{}, keys + kNope, T::kKeyRow, p.k_pe,
              p.k_pe_stride, j0);
    copy_rows(std::integral_constant<int, kV / 8>{}, values, T::kValueRow, head + kNope,
              expanded_row, j0);
    cp_async_commit();
  };

  float o[kValueTiles8][4] = {};
  float max0 = -INFINITY, max1 = -INFINITY, sum0 = 0.0f, sum1 = 0.0f;
  load_tile(0, 0);
  for (int64_t tile = 0; tile < key_tiles; ++tile) {
    const int stage = static_cast<int>(tile & 1);
    if (tile + 1 < key_tiles) {
      load_tile(tile + 1, stage ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint16_t* keys = shared + stage * T::kStage;
    const uint16_t* values = keys + kKeyTile * T::kKeyRow;

    // S = Q K^T for 16 queries x 64 keys. ldmatrix matrices: keys n*8 + (m/2)*8 + row, dims
    // s*16 + (m%2)*8: b0, b1 of key tiles n and n + 1.
    float sc[kKeyTiles8][4] = {};
#pragma unroll
    for (int s = 0; s < kQkSteps; ++s) {
#pragma unroll
      for (int n = 0; n < kKeyTiles8; n += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, shared_address(keys + (n * 8 + (m / 2) * 8 + r8) * T::kKeyRow + s * 16 +
                                      (m % 2) * 8));
        mma_bf16_16x8x16(sc[n], qf[s], b[0], b[1]);
        mma_bf16_16x8x16(sc[n + 1], qf[s], b[2], b[3]);
      }
    }

    // The causal mask where the tile reaches past the block's first query, the online softmax.
    const int64_t j0 = tile * kKeyTile;
    const bool masked = j0 + kKeyTile - 1 > first_position + q0;
    // pos - j0 clamped into [-1, kKeyTile]: 32-bit compares below.
    const auto last_in_tile = [&](int64_t pos) {
      const int64_t d = pos - j0;
      return static_cast<int>(d < -1 ? -1 : (d > kKeyTile ? kKeyTile : d));
    };
    const int last0 = last_in_tile(pos0), last1 = last_in_tile(pos1);
    float tile_max0 = -INFINITY, tile_max1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < kKeyTiles8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // Relative to the tile: the key's offset against each row's last visible offset.
        float x = sc[n][e] * p.scale_log2;
        if (masked && n * 8 + 2 * t4 + (e & 1) > (e < 2 ? last0 : last1)) x = -INFINITY;
        sc[n][e] = x;
        if (e < 2) {
          tile_max0 = fmaxf(tile_max0, x);
        } else {
          tile_max1 = fmaxf(tile_max1, x);
        }
      }
    }
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) {  // the four lanes of a row
      tile_max0 = fmaxf(tile_max0, __shfl_xor_sync(0xffffffffu, tile_max0, offset));
      tile_max1 = fmaxf(tile_max1, __shfl_xor_sync(0xffffffffu, tile_max1, offset));
    }
    const float new_max0 = fmaxf(max0, tile_max0), new_max1 = fmaxf(max1, tile_max1);
    // A row without a visible key so far keeps a base of 0 (exp2(-inf - -inf) would be NaN).
    const float base0 = new_max0 == -INFINITY ? 0.0f : new_max0;
    const float base1 = new_max1 == -INFINITY ? 0.0f : new_max1;
    const float rescale0 = exp2f(max0 - base0), rescale1 = exp2f(max1 - base1);
    max0 = new_max0, max1 = new_max1;
    sum0 *= rescale0, sum1 *= rescale1;
#pragma unroll
    for (int n = 0; n < kValueTiles8; ++n) {
      o[n][0] *= rescale0, o[n][1] *= rescale0;
      o[n][2] *= rescale1, o[n][3] *= rescale1;
    }
    uint32_t pa[kKeyTile / 16][4];  // P as A fragments: key tiles 2k and 2k + 1
#pragma unroll
    for (int n = 0; n < kKeyTiles8; ++n) {
      const float p0 = exp2f(sc[n][0] - base0), p1 = exp2f(sc[n][1] - base0);
      const float p2 = exp2f(sc[n][2] - base1), p3 = exp2f(sc[n][3] - base1);
      sum0 += p0 + p1;
      sum1 += p2 + p3;
      pa[n / 2][(n % 2) * 2] = pack_bf16(p0, p1);
      pa[n / 2][(n % 2) * 2 + 1] = pack_bf16(p2, p3);
    }

    // O += P V. ldmatrix.trans matrices: keys k*16 + (m%2)*8 + row, dims n*8 + (m/2)*8: b0, b1
    // of value tiles n and n + 1.
#pragma unroll
    for (int k = 0; k < kKeyTile / 16; ++k) {
#pragma unroll
      for (int n = 0; n < kValueTiles8; n += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, shared_address(values + (k * 16 + (m % 2) * 8 + r8) * T::kValueRow +
                                            n * 8 + (m / 2) * 8));
        mma_bf16_16x8x16(o[n], pa[k], b[0], b[1]);
        mma_bf16_16x8x16(o[n + 1], pa[k], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before it is loaded again
  }

#pragma unroll
  for (int offset = 1; offset < 4; offset *= 2) {
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, offset);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, offset);
  }
  const float inv0 = 1.0f / sum0, inv1 = 1.0f / sum1;
#pragma unroll
  for (int n = 0; n < kValueTiles8; ++n) {
    const int64_t column = static_cast<int64_t>(h) * kV + n * 8 + 2 * t4;
    if (row0 < p.tokens) {
      *reinterpret_cast<uint32_t*>(p.out + row0 * p.out_stride + column) =
          pack_bf16(o[n][0] * inv0, o[n][1] * inv0);
    }
    if (row1 < p.tokens) {
      *reinterpret_cast<uint32_t*>(p.out + row1 * p.out_stride + column) =
          pack_bf16(o[n][2] * inv1, o[n][3] * inv1);
    }
  }
}

template <int kNope, int kV>
void launch_flash(const FlashParams& p, cudaStream_t stream) {
  using T = Tiles<kNope, kV>;
  const dim3 grid(static_cast<unsigned>((p.tokens + kQueryTile - 1) / kQueryTile),
                  static_cast<unsigned>(p.heads));
  launch_large_shared<flash_prefill_kernel<kNope, kV>>(grid, kThreads, T::kSharedBytes, stream, p);
}

}  // namespace

bool prefill_attention_supports(int nope, int rope, int v) {
  return rope == kRope && nope == v && (nope == 128 || nope == 64);
}

size_t PrefillAttentionWorkspace::bytes_for(int heads, int nope, int v, int64_t max_context) {
  return align256(static_cast<size_t>(max_context * heads * (nope + v)) * 2);
}

void prefill_attention(GemmRunner& gemm, const PrefillAttentionParams& p,
                       const PrefillAttentionWorkspace& workspace, cudaStream_t stream) {
  if (p.heads < 1 || p.heads > 65535 || p.rank < 1 || p.tokens < 0 || p.context < p.tokens ||
      p.context > INT32_MAX || p.keys_stride < p.rank + p.rope || p.out_stride < p.heads * p.v) {
    throw ShapeError("prefill_attention: heads " + str(p.heads) + ", rank " + str(p.rank) +
                     ", tokens " + str(p.tokens) + ", context " + str(p.context) +
                     ", keys_stride " + str(p.keys_stride) + ", out_stride " + str(p.out_stride) +
                     " (need heads in [1, 65535], rank >= 1, tokens <= context < 2^31, "
                     "keys_stride >= rank + rope, out_stride >= heads * v)");
  }
  if (!prefill_attention_supports(p.nope, p.rope, p.v)) {
    throw ShapeError("prefill_attention: head dimensions nope " + str(p.nope) + ", rope " +
                     str(p.rope) + ", v " + str(p.v) +
                     " are not compiled (rope 64 with nope = v = 128 or 64)");
  }
  if (p.rank % 8 != 0 || p.keys_stride % 8 != 0 || p.out_stride % 2 != 0 ||
      reinterpret_cast<uintptr_t>(p.keys) % 16 != 0 || reinterpret_cast<uintptr_t>(p.q) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(p.out) % 4 != 0) {
    throw ShapeError("prefill_attention: rank " + str(p.rank) + ", keys_stride " +
                     str(p.keys_stride) + ", out_stride " + str(p.out_stride) +
                     " (need rank and keys_stride multiples of 8, keys 16-byte aligned, q and out "
                     "4-byte aligned, an even out_stride)");
  }
  if (p.context > workspace.max_context ||
      workspace.bytes <
          PrefillAttentionWorkspace::bytes_for(p.heads, p.nope, p.v, workspace.max_context)) {
    throw ShapeError("prefill_attention: context " + str(p.context) + " with a workspace of " +
                     str(static_cast<int64_t>(workspace.bytes)) + " bytes for contexts up to " +
                     str(workspace.max_context));
  }
  if (p.tokens == 0) return;
  if (p.q == nullptr || p.keys == nullptr || p.kv_b == nullptr || p.out == nullptr ||
      workspace.device == nullptr) {
    throw InvalidArgument("prefill_attention: q, keys, kv_b, out and the workspace must be set");
  }
  const int64_t kv = p.nope + p.v;
  auto* expanded = static_cast<uint16_t*>(workspace.device);
  // expanded[j, h] = [k_nope ; v] of key j for head h.
  gemm.linear(p.context, p.heads * kv, p.rank, p.keys, p.keys_stride, p.kv_b, p.rank, expanded,
              p.heads * kv, DType::kBF16, 0.0f, stream);

  constexpr float kLog2e = 1.4426950408889634f;
  const FlashParams flash{
      p.q,          expanded, p.keys + p.rank, p.keys_stride, p.out,
      p.out_stride, p.tokens, p.context,       p.heads,       p.softmax_scale * kLog2e};
  switch (p.nope) {
    case 128:
      launch_flash<128, 128>(flash, stream);
      break;
    case 64:
      launch_flash<64, 64>(flash, stream);
      break;
    default:  // refused above
      throw ShapeError("prefill_attention: nope " + str(p.nope) + " is not compiled");
  }
}

}  // namespace quantmla::gpu
