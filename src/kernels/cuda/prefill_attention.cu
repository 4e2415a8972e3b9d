// Expanded-form prefill attention (prefill_attention.h): the up-projection on cuBLAS, then one
// flash-attention kernel on the warpgroup tensor-core instructions (wgmma.cuh). A block takes 128
// queries of one head, two warpgroups of 64 (wgmma's M), and walks the visible keys in tiles of
// 128, the keys [k_nope ; k_pe] and the transposed values copied into 128-byte-swizzled shared
// memory by tensor-map copies that one thread issues (two stages each, a full and an empty barrier
// per stage, so the two warpgroups never meet at a block barrier). S = Q K^T takes both operands
// from shared memory and stays in registers; the running maximum and sum are kept per query row (in
// the log2 domain of the scaled scores); P is rounded to BF16 and fed to O += P V from registers
// (S's accumulator layout is the A operand's), issued together with the next tile's S so that the
// softmax runs while a product is in flight; O is divided by the sum at the end. Query tiles are
// handed out longest first, which evens the causal triangle. The values are stored transposed by
// their up-projection so that both products read K-major operands.
#include <cuda_bf16.h>

#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/prefill_attention.h"
#include "kernels/cuda/tensor_map.h"
#include "kernels/cuda/wgmma.cuh"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

constexpr int kRope = 64;
constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kQueryTile = 64 * kWarpgroups;
constexpr int kKeyTile = 128;
// A 128-byte-swizzled column block of 128 rows (wgmma.cuh): Q's, K's per 64 head dimensions.
constexpr int kBlockBytes = 128 * 128;

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }
std::string str(int64_t v) { return std::to_string(v); }
int64_t values_stride(int64_t context) { return (context + 7) / 8 * 8; }

// The tensor maps of the kernel's copies (tensor_map.h; a box of 64 columns a copy, the rows
// past each tensor's end zero-filled: queries past the tokens, keys and values past the context).
struct FlashMaps {
  CUtensorMap q;       // [tokens, heads, qk]: a box of 128 tokens of one head
  CUtensorMap k_nope;  // [context, heads, nope]: 128 keys of one head
  CUtensorMap k_pe;    // [context, 64] (row stride k_pe_stride): 128 keys
  CUtensorMap v_t;     // [heads, v, context] (row stride v_t_stride): 64 keys of v rows of a head
};

// The kernel's operands: the pointers and strides make launch_flash's tensor maps (FlashMaps),
// through which the kernel reads them; out and the scalars it reads itself.
struct FlashParams {
  const uint16_t* q;       // [tokens, heads, nope + 64] BF16 bits, contiguous
  const uint16_t* k_nope;  // [context, heads, nope] BF16 bits, contiguous
  const uint16_t* k_pe;    // [context, 64] BF16 bits, row stride k_pe_stride
  int64_t k_pe_stride;
  const uint16_t* v_t;  // [heads, v, v_t_stride] BF16 bits: head h's values, transposed
  int64_t v_t_stride;   // a multiple of 8
  uint16_t* out;        // [tokens, heads * v] BF16 bits, row stride out_stride
  int64_t out_stride;
  int64_t tokens, context;
  int heads;
  float scale_log2;  // softmax_scale * log2(e)
};

template <int kNope, int kV>
struct Tiles {
  static constexpr int kQk = kNope + kRope;
  static constexpr int kQBytes = kQk / 64 * kBlockBytes;
  static constexpr int kKeyBytes = kQk / 64 * kBlockBytes;
  static constexpr int kValueBlockBytes = kV * 128;  // kV rows of 64 keys
  static constexpr int kValueBytes = kKeyTile / 64 * kValueBlockBytes;
  static constexpr int kStageBytes = kKeyBytes + kValueBytes;
  // + 1024: the swizzle needs 1024-byte-aligned blocks, the dynamic allocation only promises 16.
  // + 8 barriers: Q's, and a full and an empty one per stage of keys and of values.
  static constexpr size_t kSharedBytes = size_t{kQBytes} + 2 * kStageBytes + 1024 + 8 * 9;
  static_assert(kNope % 64 == 0 && kV <= 256 && kValueBlockBytes % 1024 == 0,
                "whole column blocks, one copy a value block, aligned value blocks");
  static_assert(kQueryTile == kKeyTile && kQueryTile == 128, "one column block is 128 rows");
  static_assert(kSharedBytes <= 227 * 1024, "fits an SM's shared memory");
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <int kNope, int kV>
__global__ void __launch_bounds__(kThreads, 1)
    flash_prefill_kernel(const __grid_constant__ FlashParams p,
                         const __grid_constant__ CUtensorMap q_map,
                         const __grid_constant__ CUtensorMap k_nope_map,
                         const __grid_constant__ CUtensorMap k_pe_map,
                         const __grid_constant__ CUtensorMap v_t_map) {
  using T = Tiles<kNope, kV>;
  constexpr int kQkSteps = T::kQk / 16;
  constexpr int kKeyTiles8 = kKeyTile / 8;
  constexpr int kValueTiles8 = kV / 8;
  wait_for_previous_kernel();
  extern __shared__ __align__(16) uint8_t shared_raw[];
  // Q, then two stages of keys, then two stages of transposed values, then the barriers.
  const uint32_t base = swizzle_base(shared_raw);
  const auto key_stage = [&](int64_t tile) {
    return base + T::kQBytes + static_cast<uint32_t>(tile & 1) * T::kKeyBytes;
  };
  const auto value_stage = [&](int64_t tile) {
    return base + T::kQBytes + 2 * T::kKeyBytes + static_cast<uint32_t>(tile & 1) * T::kValueBytes;
  };
  uint64_t* q_full = reinterpret_cast<uint64_t*>(shared_raw + (base - shared_address(shared_raw)) +
                                                 T::kQBytes + 2 * T::kStageBytes);
  uint64_t* key_full = q_full + 1;     // [2] thread 0's arrival with the copies' bytes
  uint64_t* key_empty = q_full + 3;    // [2] one arrival a warpgroup once S read the stage
  uint64_t* value_full = q_full + 5;   // [2]
  uint64_t* value_empty = q_full + 7;  // [2] once P V read the stage
  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int s = 0; s < 2; ++s) {
      mbarrier_init(&key_full[s], 1);
      mbarrier_init(&key_empty[s], kWarpgroups);
      mbarrier_init(&value_full[s], 1);
      mbarrier_init(&value_empty[s], kWarpgroups);
    }
    fence_barrier_init();
  }
  __syncthreads();
  // Blocks in launch order take every head's longest query tile first, then the next longest.
  const int h = blockIdx.x;
  const int64_t q0 = (static_cast<int64_t>(gridDim.y) - 1 - blockIdx.y) * kQueryTile;
  const int64_t first_position = p.context - p.tokens;
  // Keys up to the last query's position.
  const int64_t last_query = q0 + kQueryTile < p.tokens ? q0 + kQueryTile - 1 : p.tokens - 1;
  const int64_t last_key = first_position + last_query;
  const int64_t key_tiles = last_key / kKeyTile + 1;

  // The copies, all issued by thread 0 (a ninth, producer warp would cap the block at 168
  // registers a thread, where the kernel takes ~200 and spills at 168): the keys of tile t go to
  // stage t % 2 once S(t - 2) is done with it in both warpgroups, its values once P(t - 2) V(t - 2)
  // is (the (t / 2 - 1)-th completion of the stage's empty barrier); queries past the tokens and
  // keys past the context are the copy engine's zeros (a value of garbage times a probability of 0
  // would still be NaN).
  const auto load_keys = [&](int64_t tile) {
    const int s = static_cast<int>(tile & 1);
    const int j0 = static_cast<int>(tile * kKeyTile);
    if (tile >= 2) mbarrier_wait(&key_empty[s], static_cast<uint32_t>((tile / 2 - 1) & 1));
    mbarrier_arrive_expect_bytes(&key_full[s], T::kKeyBytes);
#pragma unroll
    for (int b = 0; b < kNope / 64; ++b) {
      tma_load_3d(key_stage(tile) + b * kBlockBytes, &k_nope_map, b * 64, h, j0, &key_full[s]);
    }
    tma_load_2d(key_stage(tile) + kNope / 64 * kBlockBytes, &k_pe_map, 0, j0, &key_full[s]);
  };
  const auto load_values = [&](int64_t tile) {
    const int s = static_cast<int>(tile & 1);
    if (tile >= 2) mbarrier_wait(&value_empty[s], static_cast<uint32_t>((tile / 2 - 1) & 1));
    mbarrier_arrive_expect_bytes(&value_full[s], T::kValueBytes);
#pragma unroll
    for (int b = 0; b < kKeyTile / 64; ++b) {
      tma_load_3d(value_stage(tile) + b * T::kValueBlockBytes, &v_t_map,
                  static_cast<int>(tile * kKeyTile) + b * 64, 0, h, &value_full[s]);
    }
  };
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_bytes(q_full, T::kQBytes);
#pragma unroll
    for (int b = 0; b < T::kQk / 64; ++b) {
      tma_load_3d(base + b * kBlockBytes, &q_map, b * 64, h, static_cast<int>(q0), q_full);
    }
    load_keys(0);
  }

  const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  // This thread's two query rows (accumulator rows g and g + 8 of its warp's 16).
  const int64_t row0 = q0 + warpgroup * 64 + warp * 16 + g, row1 = row0 + 8;
  const int64_t pos0 = first_position + row0, pos1 = first_position + row1;
  const uint32_t q_rows = base + warpgroup * 64 * 128;  // this warpgroup's 64 rows of each block
  // O += P V for the tile whose probabilities pa holds (16 keys a step, the transposed values'
  // column blocks of 64 keys).
  float o[kV / 2] = {};
  uint32_t pa[kKeyTile / 16][4];  // P as A fragments: key tiles 2k and 2k + 1
  const auto issue_pv = [&](int64_t tile) {
    const uint32_t values = value_stage(tile);
#pragma unroll
    for (int k = 0; k < kKeyTile / 16; ++k) {
      wgmma_m64k16_rs<kV>(
          o, pa[k], wgmma_descriptor(values + (k / 4) * T::kValueBlockBytes + (k % 4) * 32), 1);
    }
    wgmma_commit();
  };

  // Software pipeline, per iteration t: S(t) = Q K(t)^T and O += P(t-1) V(t-1) are issued
  // together, the softmax of S(t) runs while the second product is in flight, then O is rescaled
  // and P(t) rounded for the next iteration. Each warpgroup releases the keys' stage once S(t) is
  // done and the values' once P(t-1) V(t-1) is, and waits only for its own copies.
  float sc[kKeyTile / 2] = {};
  float max0 = -INFINITY, max1 = -INFINITY, sum0 = 0.0f, sum1 = 0.0f;
  mbarrier_wait(q_full, 0);
  for (int64_t tile = 0; tile < key_tiles; ++tile) {
    const int s = static_cast<int>(tile & 1);
    // Iteration t copies the keys of t + 1 and the values of t: each has a whole iteration or
    // more to land.
    if (threadIdx.x == 0) {
      if (tile + 1 < key_tiles) load_keys(tile + 1);
      load_values(tile);
    }
    __syncwarp();
    mbarrier_wait(&key_full[s], static_cast<uint32_t>((tile / 2) & 1));  // K(t)
    if (tile > 0) {                                                      // V(t - 1)
      mbarrier_wait(&value_full[s ^ 1], static_cast<uint32_t>(((tile - 1) / 2) & 1));
    }

    // P(t-1) and O are final before the fence that hands them to the products.
#pragma unroll
    for (int k = 0; k < kKeyTile / 16; ++k) wgmma_fence_registers(pa[k]);
    wgmma_fence_registers(o);
    wgmma_fence();
    const uint32_t keys = key_stage(tile);
#pragma unroll
    for (int s = 0; s < kQkSteps; ++s) {
      const uint32_t column = (s / 4) * kBlockBytes + (s % 4) * 32;
      wgmma_m64nk16_ss<128>(sc, wgmma_descriptor(q_rows + column), wgmma_descriptor(keys + column),
                            s);
    }
    wgmma_commit();
    if (tile > 0) {
      issue_pv(tile - 1);
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
    wgmma_fence_registers(sc);
    if (threadIdx.x % 128 == 0) mbarrier_arrive(&key_empty[s]);  // S(t) has read K(t)

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
        float x = sc[n * 4 + e] * p.scale_log2;
        if (masked && n * 8 + 2 * t4 + (e & 1) > (e < 2 ? last0 : last1)) x = -INFINITY;
        sc[n * 4 + e] = x;
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
    for (int n = 0; n < kKeyTiles8; ++n) {
      sc[n * 4 + 0] = exp2f(sc[n * 4 + 0] - base0), sc[n * 4 + 1] = exp2f(sc[n * 4 + 1] - base0);
      sc[n * 4 + 2] = exp2f(sc[n * 4 + 2] - base1), sc[n * 4 + 3] = exp2f(sc[n * 4 + 3] - base1);
      sum0 += sc[n * 4 + 0] + sc[n * 4 + 1];
      sum1 += sc[n * 4 + 2] + sc[n * 4 + 3];
    }

    // P(t-1) V(t-1) done: O is rescaled to this tile's maximum and P(t) rounded to BF16 as the
    // A operand of the next product.
    wgmma_wait<0>();
    wgmma_fence_registers(o);
#pragma unroll
    for (int k = 0; k < kKeyTile / 16; ++k) wgmma_fence_registers(pa[k]);
    if (tile > 0 && threadIdx.x % 128 == 0) mbarrier_arrive(&value_empty[s ^ 1]);  // V(t - 1) read
#pragma unroll
    for (int n = 0; n < kValueTiles8; ++n) {
      o[n * 4 + 0] *= rescale0, o[n * 4 + 1] *= rescale0;
      o[n * 4 + 2] *= rescale1, o[n * 4 + 3] *= rescale1;
    }
#pragma unroll
    for (int n = 0; n < kKeyTiles8; ++n) {
      pa[n / 2][(n % 2) * 2] = pack_bf16(sc[n * 4 + 0], sc[n * 4 + 1]);
      pa[n / 2][(n % 2) * 2 + 1] = pack_bf16(sc[n * 4 + 2], sc[n * 4 + 3]);
    }
  }
  // The last tile's P V.
  mbarrier_wait(&value_full[(key_tiles - 1) & 1], static_cast<uint32_t>(((key_tiles - 1) / 2) & 1));
  wgmma_fence();
  issue_pv(key_tiles - 1);
  wgmma_wait<0>();
  wgmma_fence_registers(o);

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
          pack_bf16(o[n * 4 + 0] * inv0, o[n * 4 + 1] * inv0);
    }
    if (row1 < p.tokens) {
      *reinterpret_cast<uint32_t*>(p.out + row1 * p.out_stride + column) =
          pack_bf16(o[n * 4 + 2] * inv1, o[n * 4 + 3] * inv1);
    }
  }
}

template <int kNope, int kV>
void launch_flash(const FlashParams& p, cudaStream_t stream) {
  using T = Tiles<kNope, kV>;
  constexpr int64_t kQk = T::kQk;
  const int64_t heads = p.heads;
  // Boxes of 64 columns by 128 rows (one swizzled column block), of one head where the tensor
  // holds several.
  const int64_t q_dims[] = {kQk, heads, p.tokens}, q_strides[] = {kQk, heads * kQk};
  const int q_box[] = {64, 1, kQueryTile};
  const int64_t k_nope_dims[] = {kNope, heads, p.context},
                k_nope_strides[] = {kNope, heads * kNope};
  const int k_nope_box[] = {64, 1, kKeyTile};
  const int64_t k_pe_dims[] = {kRope, p.context}, k_pe_strides[] = {p.k_pe_stride};
  const int k_pe_box[] = {64, kKeyTile};
  const int64_t v_t_dims[] = {p.context, kV, heads},
                v_t_strides[] = {p.v_t_stride, kV * p.v_t_stride};
  const int v_t_box[] = {64, kV, 1};
  const CUtensorMap q_map = bf16_tensor_map(p.q, 3, q_dims, q_strides, q_box);
  const CUtensorMap k_nope_map =
      bf16_tensor_map(p.k_nope, 3, k_nope_dims, k_nope_strides, k_nope_box);
  const CUtensorMap k_pe_map = bf16_tensor_map(p.k_pe, 2, k_pe_dims, k_pe_strides, k_pe_box);
  const CUtensorMap v_t_map = bf16_tensor_map(p.v_t, 3, v_t_dims, v_t_strides, v_t_box);
  const dim3 grid(static_cast<unsigned>(p.heads),
                  static_cast<unsigned>((p.tokens + kQueryTile - 1) / kQueryTile));
  launch_large_shared<flash_prefill_kernel<kNope, kV>>(grid, kThreads, T::kSharedBytes, stream, p,
                                                       q_map, k_nope_map, k_pe_map, v_t_map);
}

}  // namespace

bool prefill_attention_supports(int nope, int rope, int v) {
  return rope == kRope && nope == v && (nope == 128 || nope == 64);
}

// The workspace: the keys [max_context, heads, nope], then the transposed values [heads, v,
// values_stride(context)].
size_t PrefillAttentionWorkspace::bytes_for(int heads, int nope, int v, int64_t max_context) {
  return align256(static_cast<size_t>(max_context * heads * nope) * 2) +
         align256(static_cast<size_t>(heads * v * values_stride(max_context)) * 2);
}

namespace {

// Throws for what prefill_attention.h refuses (null pointers only where there is work).
void check_params(const PrefillAttentionParams& p, const PrefillAttentionWorkspace& workspace) {
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
      reinterpret_cast<uintptr_t>(p.keys) % 16 != 0 || reinterpret_cast<uintptr_t>(p.q) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.out) % 4 != 0) {
    throw ShapeError("prefill_attention: rank " + str(p.rank) + ", keys_stride " +
                     str(p.keys_stride) + ", out_stride " + str(p.out_stride) +
                     " (need rank and keys_stride multiples of 8, keys and q 16-byte aligned (the "
                     "copy engine's), out 4-byte aligned, an even out_stride)");
  }
  if (p.context > workspace.max_context ||
      workspace.bytes <
          PrefillAttentionWorkspace::bytes_for(p.heads, p.nope, p.v, workspace.max_context)) {
    throw ShapeError("prefill_attention: context " + str(p.context) + " with a workspace of " +
                     str(static_cast<int64_t>(workspace.bytes)) + " bytes for contexts up to " +
                     str(workspace.max_context));
  }
  if (p.tokens > 0 && (p.q == nullptr || p.keys == nullptr || p.kv_b == nullptr ||
                       p.out == nullptr || workspace.device == nullptr)) {
    throw InvalidArgument("prefill_attention: q, keys, kv_b, out and the workspace must be set");
  }
}

struct ExpandedLayout {
  uint16_t* k_nope;  // [context, heads, nope]
  uint16_t* v_t;     // [heads, v, v_t_stride]
  int64_t v_t_stride;
};

// Per head (kv_b's rows are W_UK then W_UV of each head): k_nope[j, h] = W_UK,h c_j and
// v_t[h] = W_UV,h [c_0 .. c_context-1], two strided-batched products.
ExpandedLayout project_keys_values(GemmRunner& gemm, const PrefillAttentionParams& p,
                                   const PrefillAttentionWorkspace& workspace,
                                   cudaStream_t stream) {
  const int64_t kv = p.nope + p.v;
  auto* k_nope = static_cast<uint16_t*>(workspace.device);
  uint16_t* v_t =
      k_nope + align256(static_cast<size_t>(workspace.max_context * p.heads * p.nope) * 2) / 2;
  const int64_t v_t_stride = values_stride(p.context);
  BatchedGemmParams keys;
  keys.batch = p.heads;
  keys.m = p.context, keys.n = p.nope, keys.k = p.rank;
  keys.x = p.keys, keys.ldx = p.keys_stride, keys.stride_x = 0;
  keys.w = p.kv_b, keys.ldw = p.rank, keys.stride_w = kv * p.rank, keys.op_w = GemmOp::kT;
  keys.y = k_nope, keys.ldy = static_cast<int64_t>(p.heads) * p.nope, keys.stride_y = p.nope;
  keys.out_dtype = DType::kBF16;
  gemm.batched(keys, stream);
  BatchedGemmParams values;
  values.batch = p.heads;
  values.m = p.v, values.n = p.context, values.k = p.rank;
  values.x = p.kv_b + static_cast<int64_t>(p.nope) * p.rank, values.ldx = p.rank;
  values.stride_x = kv * p.rank;
  values.w = p.keys, values.ldw = p.keys_stride, values.stride_w = 0, values.op_w = GemmOp::kT;
  values.y = v_t, values.ldy = v_t_stride, values.stride_y = p.v * v_t_stride;
  values.out_dtype = DType::kBF16;
  gemm.batched(values, stream);

  return {k_nope, v_t, v_t_stride};
}

}  // namespace

void prefill_attention_projection(GemmRunner& gemm, const PrefillAttentionParams& p,
                                  const PrefillAttentionWorkspace& workspace, cudaStream_t stream) {
  check_params(p, workspace);
  if (p.tokens == 0) return;
  project_keys_values(gemm, p, workspace, stream);
}

void prefill_attention(GemmRunner& gemm, const PrefillAttentionParams& p,
                       const PrefillAttentionWorkspace& workspace, cudaStream_t stream) {
  check_params(p, workspace);
  if (p.tokens == 0) return;
  const ExpandedLayout layout = project_keys_values(gemm, p, workspace, stream);

  constexpr float kLog2e = 1.4426950408889634f;
  const FlashParams flash{p.q,        layout.k_nope,     p.keys + p.rank, p.keys_stride,
                          layout.v_t, layout.v_t_stride, p.out,           p.out_stride,
                          p.tokens,   p.context,         p.heads,         p.softmax_scale * kLog2e};
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
