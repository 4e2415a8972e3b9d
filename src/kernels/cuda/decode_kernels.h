// The two GPU decode kernels and which formats each reads (host code, no CUDA): the plan's kernel
// choice (decode.cu) and the GPU test's coverage of both kernels read the same predicate.
#pragma once

#include <cstdint>

#include "quantmla/cache_format.h"

namespace quantmla::gpu {

// The tiled kernel (decode_kernel.cuh, every format, 16 or 32 rows a block), the fragment one
// (decode_fragments.cuh, content int4 or int2 g64 or fp8, 16 rows a block) and its three-block
// form (no producer warp, three blocks an SM: int4 and int2 g64 content), the warpgroup one
// (decode_warpgroup.cuh, 64 rows a block on wgmma, padded) and the transposed one
// (decode_transposed.cu, a BF16 cache and int content, 16 rows a block on wgmma with the keys as
// M) and its two-tile form (32 rows a block where a sequence's rows come in 32s, 16 where not).
enum class DecodeKernel {
  kTiled,
  kFragments,
  kFragmentsThreeBlocks,
  kWarpgroup,
  kTransposed,
  kTransposedTwoTiles
};
constexpr bool is_fragment_kernel(DecodeKernel kernel) {
  return kernel == DecodeKernel::kFragments || kernel == DecodeKernel::kFragmentsThreeBlocks;
}
constexpr bool is_transposed_kernel(DecodeKernel kernel) {
  return kernel == DecodeKernel::kTransposed || kernel == DecodeKernel::kTransposedTwoTiles;
}

// A BF16 cache: content and RoPE key both BF16 (pages read as they are stored).
inline bool bf16_cache(const CacheFormat& format) {
  return format.content.codec == Codec::kBF16 && format.rope.codec == Codec::kBF16;
}

// The content formats the fragment kernel reads: the one statement of them, for the plan at run
// time and for decode_fragments.cuh's kFragmentContent at compile time.
constexpr bool fragments_kernel_reads(Codec codec, int64_t group) {
  return ((codec == Codec::kInt4 || codec == Codec::kInt2) && group == 64) ||
         (codec == Codec::kFP8 && group == 128);
}
inline bool fragments_kernel_reads(const CacheFormat& format) {
  return fragments_kernel_reads(format.content.codec, format.content.group);
}
// The content formats of the fragment kernel's three-block form: int4 and int2 g64, whose stages
// fit two or more in a third of an SM's shared memory with either RoPE format (fp8's are twice as
// large).
constexpr bool fragments_three_blocks_reads(Codec codec, int64_t group) {
  return (codec == Codec::kInt4 || codec == Codec::kInt2) && group == 64;
}
inline bool fragments_three_blocks_reads(const CacheFormat& format) {
  return fragments_three_blocks_reads(format.content.codec, format.content.group);
}

// What the warpgroup kernel reads (any heads: the query rows of a sequence in blocks of 64,
// wgmma's M, the last one padded): every GPU format but BF16 content with an int4 RoPE key and FP8
// content with a BF16 one, whose raw pages do not fit beside its tiles (decode_warpgroup.cuh's
// kWarpgroupFits).
inline bool warpgroup_kernel_reads(const CacheFormat& format) {
  const bool bf16_rope = format.rope.codec == Codec::kBF16;
  return !(format.content.codec == Codec::kBF16 && !bf16_rope) &&
         !(format.content.codec == Codec::kFP8 && bf16_rope);
}

// The warpgroup kernel's shape, for the plan: query rows a block (wgmma's M), keys a softmax step
// (a page), blocks an SM (its tiles take the shared memory).
inline constexpr int kWarpgroupRows = 64;
inline constexpr int kWarpgroupStepKeys = 64;
inline constexpr int kWarpgroupBlocksPerSm = 1;
// The shortest run of a plan's blocks for which the seesaw schedule (a BF16 cache) requests pages
// into L2 ahead of their copies (mla_decode_seesaw_kernel's kPrefetchL2, chosen at launch).
// Measured on an H100 (2026-12-06, 128 heads): requested in every run, 6-10% faster where the runs
// were 128 pages and more (32K and 128K from 16 sequences), 1-8% slower in runs of 4-32; in runs
// of 64 (4K from 64 sequences) 1.6% faster in one call and 1.9% slower in another; chosen from
// runs of 128 (2026-12-07): 0.925-0.985x the time without it at 32K and 128K from 16 sequences
// (docs/benchmarks.md).
inline constexpr int kSeesawL2PrefetchMinPages = 128;

// What the transposed kernel reads: a BF16 cache (content and RoPE key), whose pages its tensor
// maps copy as they are, and int4 and int2 content (either group, either RoPE format), whose pages
// it copies raw and dequantizes (decode_transposed.h's kTransposedReads, its compile-time twin);
// its shape, for the plan: 16 query rows a block (wgmma's N, the keys being its M), a page a
// softmax step, one block an SM (two page stages of 72 KB, or two raw ones and a values tile a
// consuming warpgroup).
inline bool transposed_kernel_reads(const CacheFormat& format) {
  return bf16_cache(format) || format.content.codec == Codec::kInt4 ||
         format.content.codec == Codec::kInt2;
}
inline constexpr int kTransposedStepKeys = 64;
inline constexpr int kTransposedBlocksPerSm = 1;
// The transposed kernel's online-softmax chains a block (its consuming warpgroups, each taking
// every chains-th page of the block's run, merged at its end): two in the converting form's
// 16-row blocks, so that one warpgroup converts a page while the other multiplies (its shared
// memory holds a tile each beside the raw stages and Q); one where the pages are copied as tiles
// (direct) or a block takes 32 rows (no room for a second tile).
constexpr int transposed_chains(bool direct, int row_tiles) {
  return !direct && row_tiles == 1 ? 2 : 1;
}

// The kernel of a decode plan (decode.cu: the one place that chooses it, and the measurements
// behind each choice; QUANTMLA_DECODE_KERNEL forces one): `batch` sequences of `s_q` query tokens
// at `num_heads` heads, `row_tiles` 16-row tiles a sequence, on `multiprocessors` SMs; `invariant`
// for a batch-invariant plan, `long_context` as decode_long_context. Host code without a device:
// test_decode_schedule checks every choice reads its format.
DecodeKernel select_decode_kernel(const CacheFormat& format, int batch, int s_q, int num_heads,
                                  bool invariant, bool long_context, int row_tiles,
                                  int multiprocessors);

}  // namespace quantmla::gpu
