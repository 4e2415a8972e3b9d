// Host side of the GPU decode: the plan (schedule + device buffers), argument checks, the launch
// through the format switch, and the combine kernel that merges split sequences.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_fragments.cuh"
#include "kernels/cuda/decode_schedule.h"
#include "kernels/cuda/decode_transposed.h"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/launch.cuh"
#include "quantmla/cache.h"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"

namespace quantmla::gpu {

// The GPU pages hold the CPU paged cache's pages.
static_assert(kPageTokens == quantmla::kPageTokens);

namespace {

struct CombineKernelParams {
  const float* partial_out;  // [num_partials, rows_per_block, kLatentDim]
  const float* partial_lse;  // [num_partials, rows_per_block]
  const CombineItem* items;  // [gridDim.x]
  uint16_t* out;             // [batch, s_q, num_heads, kLatentDim] BF16
  float* lse;                // [batch, s_q, num_heads] or null
  int rows_per_block;
  int rows_per_seq;
};

constexpr int kCombineThreads = kLatentDim / 4;

// One block per (sequence, row tile, row): out = sum_s w_s out_s / sum_s w_s with
// w_s = exp(lse_s - max lse), each thread 4 columns.
__global__ void __launch_bounds__(kCombineThreads)
    mla_combine_kernel(const __grid_constant__ CombineKernelParams p) {
  wait_for_previous_kernel();
  extern __shared__ float weights[];  // [num_splits]
  const CombineItem item = p.items[blockIdx.x];
  if (item.batch < 0) return;  // padding of a fixed grid (a plan in a workspace)
  const int r = blockIdx.y;
  if (item.row_tile * p.rows_per_block + r >= p.rows_per_seq) return;  // a padded row
  const float* lse =
      p.partial_lse + static_cast<int64_t>(item.first_partial) * p.rows_per_block + r;
  float max_lse = -INFINITY;
  for (int s = 0; s < item.num_splits; ++s) max_lse = fmaxf(max_lse, lse[s * p.rows_per_block]);
  for (int s = threadIdx.x; s < item.num_splits; s += blockDim.x) {
    const float l = lse[s * p.rows_per_block];
    weights[s] = l == -INFINITY ? 0.0f : expf(l - max_lse);
  }
  __syncthreads();
  const float* partial =
      p.partial_out +
      (static_cast<int64_t>(item.first_partial) * p.rows_per_block + r) * kLatentDim +
      4 * threadIdx.x;
  const int64_t split_stride = static_cast<int64_t>(p.rows_per_block) * kLatentDim;
  float total = 0.0f;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
  for (int s = 0; s < item.num_splits; ++s) {
    const float w = weights[s];
    total += w;
    const float4 v = *reinterpret_cast<const float4*>(partial + s * split_stride);
    acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
  }
  const float inverse = 1.0f / total;
  const int64_t row =
      static_cast<int64_t>(item.batch) * p.rows_per_seq + item.row_tile * p.rows_per_block + r;
  uint2 packed;
  packed.x = bf16x2_bits(__floats2bfloat162_rn(acc.x * inverse, acc.y * inverse));
  packed.y = bf16x2_bits(__floats2bfloat162_rn(acc.z * inverse, acc.w * inverse));
  *reinterpret_cast<uint2*>(p.out + row * kLatentDim + 4 * threadIdx.x) = packed;
  if (threadIdx.x == 0 && p.lse != nullptr) p.lse[row] = max_lse + logf(total);
}

// Where a plan's device buffers lie: one block of memory, each part 256-byte aligned, holding the
// launched grid's work items (padding included), the combine items and the partial results.
struct PlanLayout {
  int items = 0;     // decode blocks launched
  int combines = 0;  // combine blocks launched (0: no combine launch)
  int partial_rows = 0;
  int max_splits = 1;  // sizes the combine kernel's shared memory
  size_t items_offset = 0, combines_offset = 0, partial_out_offset = 0, partial_lse_offset = 0;
  size_t bytes = 0;

  PlanLayout(int num_items, int num_combines, int rows, int splits)
      : items(num_items), combines(num_combines), partial_rows(rows), max_splits(splits) {
    const auto place = [&](size_t part_bytes) {
      const size_t offset = bytes;
      bytes += (part_bytes + 255) / 256 * 256;
      return offset;
    };
    items_offset = place(sizeof(WorkItem) * static_cast<size_t>(items));
    combines_offset = place(sizeof(CombineItem) * static_cast<size_t>(combines));
    partial_out_offset = place(sizeof(float) * static_cast<size_t>(partial_rows) * kLatentDim);
    partial_lse_offset = place(sizeof(float) * static_cast<size_t>(partial_rows));
  }
};

// The batch from which the fragment kernel is chosen, by content codec. Measured on the H200 at
// H = 16 (bench_gpu_decode beside FlashMLA, docs/benchmarks.md). INT4: from batch 64 it is faster
// at every context (4K: 0.086 against 0.094 ms; 128K: 1.82 against 2.38 ms), at batch 16 faster
// from 32K (0.143 against 0.170 ms) but slower at 4K (0.050 against 0.040: its blocks fill Q's
// fragments from global memory and its runs are short), at batch 1 equal. INT2: faster at every
// batch and context measured (batch 1, 4K: 0.023 against 0.027 ms; batch 16, 4K: 0.033 against
// 0.040; batch 16, 128K: 0.475 against 0.607), its keys costing half the conversion. The same
// holds with FP16 code operands (2026-12-03: INT4 at batch 16, 32K 0.136, 4K 0.048 ms). FP8:
// faster at every batch, context, head count and s_q measured (H = 16, batch 1, 4K: 0.023 against
// 0.026 ms; batch 16, 4K: 0.040 against 0.041; batch 128, 128K: 3.25 against 6.19; H = 128: 1.12x
// to 1.55x). Later H200 runs of INT4 at batch 16 (2026-12-03, six of them) had the fragment kernel
// 1.3-1.46x faster from 32K (0.131-0.143 ms against 0.171 at 32K, 0.420-0.483 against 0.62 at
// 128K) but 20% slower at 4K, so INT4 takes it from batch 16 where the longest sequence is over
// kLongContextPages pages (decode_long_context, which a captured step's graph keys on).
int fragments_min_batch(const CacheFormat& format, bool long_context) {
  if (format.content.codec != Codec::kInt4) return 1;
  return long_context ? 16 : 32;
}

// Where the plan takes the warpgroup kernel: from 64 heads (its 64-row blocks need no padding at
// s_q = 1), for a BF16 cache at every batch, for the other formats it reads from batch 2 and, at
// long contexts (decode_long_context), for one sequence too (H100, 2026-12-06, 128 heads, on the
// page schedule's half-page slots: one INT4 sequence of 32K / 128K 0.066 / 0.140 ms against the
// tiled kernel's 0.083 / 0.247, INT2 0.065 / 0.138 against the fragment kernel's 0.067 / 0.193; at
// 4K as fast for INT4 and 13% slower for INT2, 0.034 against 0.030 ms). Measured on the H200 at 128
// heads beside the previous kernels (bench_gpu_decode, docs/benchmarks.md, 2026-12-05):
// BF16 2.0-4.5x faster from batch 16 (0.62-0.75x FlashMLA against 0.27-0.32x; on the seesaw
// schedule since, 0.75-0.84x), at batch 1 as fast at 4K and faster beyond; INT4 and INT2
// g64 1.6-2.0x faster from batch 16, at batch 1 1.1-1.6x faster from 32K but 3-13% slower at 4K
// (0.034 against 0.030-0.033 ms). At 16 heads (padded to 64 rows) the tiled and fragment kernels
// stay faster.
constexpr int kWarpgroupMinHeads = 64;
constexpr int kWarpgroupMinBatchQuantized = 2;
constexpr int kTransposedMaxHeads = 16;
constexpr int kTransposedConvertingMaxBatch = 16;

}  // namespace

bool decode_long_context(const std::vector<int32_t>& seq_lens) {
  int32_t longest = 0;
  for (const int32_t len : seq_lens) longest = std::max(longest, len);
  return longest > kLongContextPages * kPageTokens;  // more than that many full pages
}

namespace {

// Every kernel by its name, as QUANTMLA_DECODE_KERNEL takes it and MlaDecodePlan::kernel_name
// gives it.
constexpr std::pair<DecodeKernel, const char*> kDecodeKernelNames[] = {
    {DecodeKernel::kTiled, "tiled"},
    {DecodeKernel::kFragments, "fragments"},
    {DecodeKernel::kFragmentsThreeBlocks, "fragments3"},
    {DecodeKernel::kWarpgroup, "warpgroup"},
    {DecodeKernel::kTransposed, "transposed"},
    {DecodeKernel::kTransposedTwoTiles, "transposed32"},
};

std::string decode_kernel_name(DecodeKernel kernel) {
  for (const auto& [named, name] : kDecodeKernelNames) {
    if (named == kernel) return name;
  }
  throw InvalidArgument("GPU decode (internal): a kernel without a name");
}

}  // namespace

// The one place that chooses the kernel of a plan (decode_kernels.h).
// QUANTMLA_DECODE_KERNEL=tiled|fragments|fragments3|warpgroup|transposed|transposed32 forces one
// (benchmarks and tests time and check each; fragments3 is the fragment kernel's three-block form,
// transposed32 the transposed kernel's two-tile form); unset or "auto": the transposed kernel for
// one sequence of one token on a BF16 cache from kWarpgroupMinHeads heads up to kLongContextPages
// pages (not batch-invariant), else the warpgroup kernel where it reads the format with at least
// kWarpgroupMinHeads heads (a quantized cache from kWarpgroupMinBatchQuantized sequences or at long
// contexts; never for a batch-invariant plan, whose blocks take 16 rows), else the transposed
// kernel for a BF16 cache below kWarpgroupMinHeads heads, and for int content at up to
// kTransposedMaxHeads heads where the tiled kernel would run otherwise for fewer than
// kTransposedConvertingMaxBatch sequences (not batch-invariant; its two-tile form where the rows
// come in 32s and transposed_two_tiles holds), else the fragment kernel where it reads the format
// and the batch has at least fragments_min_batch(format, long_context) sequences, in its
// three-block form for int4 and int2 content at long contexts (from 16 and 64 sequences; not
// batch-invariant) where its plan keeps more blocks at once than the two-block form holds
// (more_blocks_fill_more over the batch's `row_tiles` 16-row tiles a sequence on
// `multiprocessors`).
DecodeKernel select_decode_kernel(const CacheFormat& format, int batch, int s_q, int num_heads,
                                  bool invariant, bool long_context, int row_tiles,
                                  int multiprocessors) {
  const char* forced = std::getenv("QUANTMLA_DECODE_KERNEL");
  const std::string choice = forced == nullptr ? "auto" : forced;
  // A forced kernel, refused where it does not read the format (`reads`, saying what it reads).
  const auto forced_kernel = [&](bool reads, DecodeKernel kernel, const char* what) {
    if (!reads) {
      throw InvalidArgument("QUANTMLA_DECODE_KERNEL=" + choice + ": " + what + ", not " +
                            format.to_string() + (invariant ? " in a batch-invariant plan" : ""));
    }
    return kernel;
  };
  const auto forced_is = [&](DecodeKernel kernel) { return choice == decode_kernel_name(kernel); };
  if (forced_is(DecodeKernel::kTiled)) return DecodeKernel::kTiled;
  if (forced_is(DecodeKernel::kWarpgroup)) {
    return forced_kernel(warpgroup_kernel_reads(format) && !invariant, DecodeKernel::kWarpgroup,
                         "the warpgroup kernel reads every format but bf16 content with an int4 "
                         "RoPE key and fp8 content with a bf16 one, in plans that are not "
                         "batch-invariant");
  }
  for (const DecodeKernel transposed :
       {DecodeKernel::kTransposed, DecodeKernel::kTransposedTwoTiles}) {
    if (forced_is(transposed)) {
      return forced_kernel(
          transposed_kernel_reads(format), transposed,
          "the transposed kernel reads a bf16 cache and int4 and int2 content only");
    }
  }
  if (forced_is(DecodeKernel::kFragments)) {
    return forced_kernel(fragments_kernel_reads(format), DecodeKernel::kFragments,
                         "the fragment kernel reads content int4:g64, int2:g64 and fp8 only");
  }
  if (forced_is(DecodeKernel::kFragmentsThreeBlocks)) {
    return forced_kernel(fragments_three_blocks_reads(format), DecodeKernel::kFragmentsThreeBlocks,
                         "the fragment kernel's three-block form reads content int4:g64 and "
                         "int2:g64 only");
  }
  if (choice != "auto") {
    std::string names;
    for (const auto& [kernel, name] : kDecodeKernelNames) names += std::string(name) + ", ";
    throw InvalidArgument("QUANTMLA_DECODE_KERNEL=" + choice + ": expected " +
                          names.substr(0, names.size() - 2) + " or auto");
  }
  const bool bf16 = bf16_cache(format);
  // One sequence of one token on a BF16 cache from 64 heads, up to kLongContextPages pages: the
  // transposed kernel's 16-row blocks (each a run of the page ring, many more blocks than the
  // warpgroup kernel's 64-row ones) took 0.70-0.78x the warpgroup kernel's time at 1 x 4K, 128
  // heads, in four grids (H100 and H200, 2026-12-07: 0.0216-0.0227 ms against 0.029-0.031), and
  // as long at 1 x 32K (0.059-0.063 ms both), so by the times' growth with the context it stays
  // ahead to about 28K tokens; at s_q = 2 it was 0.67x at 4K and 1.35x at 32K, so s_q = 2 keeps
  // the warpgroup kernel (docs/benchmarks.md, "Fifty-first session").
  if (!invariant && bf16 && batch == 1 && s_q == 1 && !long_context &&
      num_heads >= kWarpgroupMinHeads) {
    return DecodeKernel::kTransposed;
  }
  if (!invariant && num_heads >= kWarpgroupMinHeads && warpgroup_kernel_reads(format) &&
      (bf16 || batch >= kWarpgroupMinBatchQuantized || long_context)) {
    return DecodeKernel::kWarpgroup;
  }
  // A BF16 cache below kWarpgroupMinHeads heads: the transposed kernel was faster than the tiled
  // one at every measured batch and context (H100, 2026-12-05: 1.03-1.08x FlashMLA from batch 16
  // at 32K and 128K, the tiled one 0.99-1.03x; docs/benchmarks.md), and in five grids of
  // 2026-12-07 (H100 and H200, 16 and 128 heads, s_q 1 and 2) it took 0.67-0.98x the tiled
  // kernel's time at every shape; 17-63 heads (no grid there) take it by those figures, its
  // 16-row blocks being the same at any head count ("Fifty-first session").
  // Its two-tile form (s_q = 2 at 16 heads), H100, 2026-12-06: 0.4-4% faster from 16 sequences
  // of 32K and 128K and 1-13% at 96-128 sequences of 0.5-4K tokens; 5-32% slower at 16-64
  // sequences of 0.5-4K and 9-19% at one sequence (docs/benchmarks.md).
  // Its converting form (int content) for fewer than kTransposedConvertingMaxBatch sequences
  // where the tiled kernel would run otherwise (int g64 below fragments_min_batch, int g128,
  // which the fragment kernel does not read). Measured on H100s (16 heads, 1-15 sequences of 512
  // tokens to 128K): its first form 0.72-1.00x the tiled kernel's time, never slower, issue 13's
  // INT4/INT4 batch-1 step 0.962x ("Forty-ninth session"); the present one (two warpgroups, the
  // keys' scores from registers) 0.84-1.00x the first's for INT4 and 0.63-0.95x the tiled
  // kernel's for INT2 g128 ("Fiftieth session", docs/benchmarks.md). From 16 sequences at long
  // contexts the fragment kernel's three-block form still takes ~20% less time a sequence.
  const bool tiled_otherwise =
      !fragments_kernel_reads(format) || batch < fragments_min_batch(format, long_context);
  const bool converting = tiled_otherwise && batch < kTransposedConvertingMaxBatch;
  if (!invariant && transposed_kernel_reads(format) &&
      ((bf16 && num_heads < kWarpgroupMinHeads) ||
       (num_heads <= kTransposedMaxHeads && converting))) {
    return transposed_two_tiles(batch, row_tiles, long_context, multiprocessors)
               ? DecodeKernel::kTransposedTwoTiles
               : DecodeKernel::kTransposed;
  }
  if (tiled_otherwise) return DecodeKernel::kTiled;
  // At long contexts the form without a producer warp, three blocks an SM, for int4 from 16
  // sequences and int2 from 64 (H100, 2026-12-06: INT4 6-9% faster from 64 sequences at 32K and
  // 128K, 4% at 16 x 128K, 1.6% slower at 16 x 32K; INT2 4-8% faster from 64 sequences, 5% slower
  // at 16 x 32K; at short contexts both as fast or slower (INT2 up to 22%), and FP8 (two blocks
  // without its producer) 1-20% slower everywhere: docs/benchmarks.md).
  // Not where the three-block plan would keep at most two blocks an SM anyway (each sequence's
  // tiles a run of their own, from 199 to 264 of them on 132 SMs): there the two-block form, with
  // its producer, was faster (H100, 2026-12-06, s_q = 2 at 16 heads, 128 sequences: 256 tiles of
  // 32K / 128K, INT4 1.467 / 5.793 ms against 1.564 / 6.182, INT2 1.395 / 5.519 against 1.473 /
  // 5.819; at 64 sequences, 128 tiles, the three-block form 7-10% faster: docs/benchmarks.md).
  using ThreeBlocks = FragmentLayout<ContentInt<4, 64>, RopeInt4, true>;
  using TwoBlocks = FragmentLayout<ContentInt<4, 64>, RopeInt4>;
  static_assert(FragmentLayout<ContentInt<2, 64>, RopeBf16, true>::kBlocksPerSm ==
                    ThreeBlocks::kBlocksPerSm &&
                FragmentLayout<ContentInt<2, 64>, RopeBf16>::kBlocksPerSm ==
                    TwoBlocks::kBlocksPerSm);
  const int three_blocks_min_batch = format.content.codec == Codec::kInt4 ? 16 : 64;
  return !invariant && long_context && fragments_three_blocks_reads(format) &&
                 batch >= three_blocks_min_batch &&
                 more_blocks_fill_more(static_cast<int64_t>(batch) * row_tiles, multiprocessors,
                                       ThreeBlocks::kBlocksPerSm, TwoBlocks::kBlocksPerSm)
             ? DecodeKernel::kFragmentsThreeBlocks
             : DecodeKernel::kFragments;
}

namespace {

struct DeviceShape {
  DecodeKernel kernel = DecodeKernel::kTiled;
  int multiprocessors = 0;
  int blocks_per_multiprocessor = 1;
  int max_row_tiles = 2;  // 16-row tiles the kernel takes in one block
};

DeviceShape device_shape(const CacheFormat& format, int batch, int s_q, int num_heads,
                         bool long_context, DecodeSplit split = DecodeSplit::kFillDevice) {
  check_gpu_format(format);  // before any kernel's predicate, which presume a GPU format
  int device = 0;
  DeviceShape shape;
  QUANTMLA_CUDA_CHECK(cudaGetDevice(&device));
  QUANTMLA_CUDA_CHECK(
      cudaDeviceGetAttribute(&shape.multiprocessors, cudaDevAttrMultiProcessorCount, device));
  // Batch-invariant plans choose as for the largest batch: by the format alone (and take one
  // 16-row tile a block, plan_decode_invariant: the tiled kernel's two-tile blocks step through
  // other key counts than its one-tile blocks, and P is rounded per step).
  const bool invariant = split == DecodeSplit::kBatchInvariant;
  // A sequence's 16-row tiles (the fragment kernels' blocks; the forms' rules count them).
  const int row_tiles = (s_q * num_heads + 15) / 16;
  shape.kernel =
      select_decode_kernel(format, invariant ? std::numeric_limits<int>::max() : batch, s_q,
                           num_heads, invariant, long_context, row_tiles, shape.multiprocessors);
  if (shape.kernel == DecodeKernel::kWarpgroup) {
    shape.blocks_per_multiprocessor = kWarpgroupBlocksPerSm;
    shape.max_row_tiles = kWarpgroupRows / 16;
    return shape;
  }
  if (is_transposed_kernel(shape.kernel)) {
    shape.blocks_per_multiprocessor = kTransposedBlocksPerSm;
    shape.max_row_tiles = shape.kernel == DecodeKernel::kTransposedTwoTiles ? 2 : 1;
    return shape;
  }
  const bool two_tiles = row_tiles_per_block(s_q, num_heads, shape.max_row_tiles) == 2;
  visit_gpu_format(format, [&](auto content, auto rope) {
    using Content = decltype(content);
    using Rope = decltype(rope);
    if constexpr (kFragmentContent<Content>) {
      if (shape.kernel == DecodeKernel::kFragments) {
        shape.blocks_per_multiprocessor = FragmentLayout<Content, Rope>::kBlocksPerSm;
        shape.max_row_tiles = 1;
        return;
      }
    }
    if constexpr (kFragmentsThreeBlocksContent<Content>) {
      if (shape.kernel == DecodeKernel::kFragmentsThreeBlocks) {
        shape.blocks_per_multiprocessor = FragmentLayout<Content, Rope, true>::kBlocksPerSm;
        shape.max_row_tiles = 1;
        return;
      }
    }
    shape.blocks_per_multiprocessor = two_tiles ? DecodeLayout<Content, Rope, 2>::kBlocksPerSm
                                                : DecodeLayout<Content, Rope, 1>::kBlocksPerSm;
  });
  return shape;
}

// The schedule of a plan in a workspace (DecodeSplit).
DecodeSchedule workspace_schedule(const DeviceShape& shape, const std::vector<int32_t>& seq_lens,
                                  int s_q, int num_heads, DecodeSplit split) {
  if (split == DecodeSplit::kBatchInvariant) {
    return plan_decode_invariant(seq_lens, s_q, num_heads);
  }
  return plan_decode(seq_lens, s_q, num_heads, shape.multiprocessors,
                     shape.blocks_per_multiprocessor, 0, shape.max_row_tiles);
}

// The fixed layout of a workspace plan of `batch` sequences (decode_capacity).
PlanLayout capacity_layout(const DeviceShape& shape, int batch, int s_q, int num_heads) {
  const DecodeCapacity capacity =
      decode_capacity(batch, s_q, num_heads, shape.multiprocessors, shape.blocks_per_multiprocessor,
                      shape.max_row_tiles);
  return PlanLayout(capacity.items, capacity.combines, capacity.partials * capacity.rows_per_block,
                    capacity.max_splits);
}

// The layout of exactly one schedule's blocks (an owning plan, or a workspace plan that launches
// its own grid).
PlanLayout exact_layout(const DecodeSchedule& schedule) {
  return PlanLayout(static_cast<int>(schedule.items.size()),
                    static_cast<int>(schedule.combines.size()),
                    schedule.num_partials * schedule.rows_per_block, schedule.max_splits);
}

}  // namespace

struct MlaDecodePlan::State {
  State(const CacheFormat& plan_format, DecodeKernel plan_kernel, DecodeSchedule plan_schedule,
        int plan_batch, int plan_s_q, int plan_heads, const PlanLayout& plan_layout)
      : format(plan_format),
        kernel(plan_kernel),
        schedule(std::move(plan_schedule)),
        batch(plan_batch),
        s_q(plan_s_q),
        num_heads(plan_heads),
        layout(plan_layout) {
    for (const WorkItem& item : schedule.items) {
      const int pages = item.page_end - item.page_begin;
      run_pages.shortest = run_pages.shortest == 0 ? pages : std::min(run_pages.shortest, pages);
      run_pages.longest = std::max(run_pages.longest, pages);
    }
  }

  // Points the buffers at `base` (layout's offsets) and copies the schedule in, padding the grid
  // with items that exit at once (batch -1).
  void place(uint8_t* base, cudaStream_t stream, bool async) {
    items = reinterpret_cast<WorkItem*>(base + layout.items_offset);
    combines = reinterpret_cast<CombineItem*>(base + layout.combines_offset);
    partial_out = reinterpret_cast<float*>(base + layout.partial_out_offset);
    partial_lse = reinterpret_cast<float*>(base + layout.partial_lse_offset);
    std::vector<uint8_t> host(layout.partial_out_offset, 0);
    const WorkItem no_item{-1, 0, 0, 0, -1};
    const CombineItem no_combine{-1, 0, 0, 0};
    for (int i = 0; i < layout.items; ++i) {
      const WorkItem& item =
          i < static_cast<int>(schedule.items.size()) ? schedule.items[i] : no_item;
      std::memcpy(host.data() + layout.items_offset + i * sizeof(WorkItem), &item, sizeof(item));
    }
    for (int i = 0; i < layout.combines; ++i) {
      const CombineItem& item =
          i < static_cast<int>(schedule.combines.size()) ? schedule.combines[i] : no_combine;
      std::memcpy(host.data() + layout.combines_offset + i * sizeof(CombineItem), &item,
                  sizeof(item));
    }
    if (async) {
      // From pageable memory: staged before the call returns, so `host` may go.
      QUANTMLA_CUDA_CHECK(
          cudaMemcpyAsync(base, host.data(), host.size(), cudaMemcpyHostToDevice, stream));
    } else {
      QUANTMLA_CUDA_CHECK(cudaMemcpy(base, host.data(), host.size(), cudaMemcpyHostToDevice));
    }
  }

  CacheFormat format;
  DecodeKernel kernel;
  DecodeSchedule schedule;
  int batch;
  int s_q;
  int num_heads;
  PlanLayout layout;
  RunPages run_pages;                           // the launch's L2 prefetch depends on the shortest
  std::unique_ptr<DeviceArray<uint8_t>> owned;  // the plan's own memory, when not in a workspace
  WorkItem* items = nullptr;                    // [layout.items]
  CombineItem* combines = nullptr;              // [layout.combines]
  float* partial_out = nullptr;                 // [partial_rows, kLatentDim]
  float* partial_lse = nullptr;                 // [partial_rows]
};

MlaDecodePlan::MlaDecodePlan(const CacheFormat& format, const std::vector<int32_t>& seq_lens,
                             int s_q, int num_heads, int pages_per_split) {
  const DeviceShape shape = device_shape(format, static_cast<int>(seq_lens.size()), s_q, num_heads,
                                         decode_long_context(seq_lens));
  DecodeSchedule schedule =
      plan_decode(seq_lens, s_q, num_heads, shape.multiprocessors, shape.blocks_per_multiprocessor,
                  pages_per_split, shape.max_row_tiles);
  const PlanLayout layout = exact_layout(schedule);
  state_ = std::make_unique<State>(format, shape.kernel, std::move(schedule),
                                   static_cast<int>(seq_lens.size()), s_q, num_heads, layout);
  state_->owned = std::make_unique<DeviceArray<uint8_t>>(layout.bytes);
  state_->place(state_->owned->data(), nullptr, /*async=*/false);
}

MlaDecodePlan::MlaDecodePlan(const CacheFormat& format, const std::vector<int32_t>& seq_lens,
                             int s_q, int num_heads, const MlaDecodeWorkspace& workspace,
                             bool fixed_grid, void* stream, DecodeSplit split) {
  const int batch = static_cast<int>(seq_lens.size());
  if (fixed_grid && split == DecodeSplit::kBatchInvariant) {
    throw InvalidArgument(
        "GPU decode plan: a batch-invariant plan launches its own grid (its blocks follow the "
        "lengths), not a fixed one");
  }
  const DeviceShape shape =
      device_shape(format, batch, s_q, num_heads, decode_long_context(seq_lens), split);
  DecodeSchedule schedule = workspace_schedule(shape, seq_lens, s_q, num_heads, split);
  const PlanLayout layout =
      fixed_grid ? capacity_layout(shape, batch, s_q, num_heads) : exact_layout(schedule);
  if (workspace.device == nullptr || workspace.bytes < layout.bytes ||
      reinterpret_cast<uintptr_t>(workspace.device) % 256 != 0) {
    throw InvalidArgument("GPU decode plan: workspace of " + std::to_string(workspace.bytes) +
                          " bytes, " + std::to_string(layout.bytes) + " needed for " +
                          std::to_string(batch) + " sequences, s_q " + std::to_string(s_q) +
                          ", 256-byte aligned");
  }
  if (static_cast<int>(schedule.items.size()) > layout.items ||
      static_cast<int>(schedule.combines.size()) > layout.combines ||
      schedule.num_partials * schedule.rows_per_block > layout.partial_rows) {
    throw InvalidArgument(
        "GPU decode plan (internal): the schedule's " + std::to_string(schedule.items.size()) +
        " blocks, " + std::to_string(schedule.combines.size()) + " combines and " +
        std::to_string(schedule.num_partials) + " partial results exceed decode_capacity");
  }
  state_ = std::make_unique<State>(format, shape.kernel, std::move(schedule), batch, s_q, num_heads,
                                   layout);
  state_->place(static_cast<uint8_t*>(workspace.device), static_cast<cudaStream_t>(stream),
                /*async=*/true);
}

size_t MlaDecodePlan::workspace_bytes(const CacheFormat& format, int batch, int s_q,
                                      int num_heads) {
  // Any lengths: the larger of the two choices the lengths can make.
  size_t bytes = 0;
  for (const bool long_context : {false, true}) {
    bytes =
        std::max(bytes, capacity_layout(device_shape(format, batch, s_q, num_heads, long_context),
                                        batch, s_q, num_heads)
                            .bytes);
  }
  return bytes;
}

size_t MlaDecodePlan::workspace_bytes(const CacheFormat& format,
                                      const std::vector<int32_t>& seq_lens, int s_q, int num_heads,
                                      DecodeSplit split) {
  const DeviceShape shape = device_shape(format, static_cast<int>(seq_lens.size()), s_q, num_heads,
                                         decode_long_context(seq_lens), split);
  return exact_layout(workspace_schedule(shape, seq_lens, s_q, num_heads, split)).bytes;
}

MlaDecodePlan::~MlaDecodePlan() = default;
MlaDecodePlan::MlaDecodePlan(MlaDecodePlan&&) noexcept = default;
MlaDecodePlan& MlaDecodePlan::operator=(MlaDecodePlan&&) noexcept = default;

int MlaDecodePlan::num_blocks() const { return static_cast<int>(state_->schedule.items.size()); }

std::string MlaDecodePlan::kernel_name() const { return decode_kernel_name(state_->kernel); }
int MlaDecodePlan::max_splits() const { return state_->schedule.max_splits; }
MlaDecodePlan::RunPages MlaDecodePlan::run_pages() const { return state_->run_pages; }

std::vector<MlaDecodePlan::Block> MlaDecodePlan::blocks() const {
  const DecodeSchedule& schedule = state_->schedule;
  std::vector<Block> blocks;
  const int rows_per_seq = state_->s_q * state_->num_heads;
  const int chains =
      is_transposed_kernel(state_->kernel)
          ? transposed_chains(bf16_cache(state_->format), schedule.row_tiles_per_block)
          : 1;
  for (const WorkItem& item : schedule.items) {
    const int first_row = item.row_tile * schedule.rows_per_block;
    blocks.push_back({item.batch, first_row,
                      std::min(schedule.rows_per_block, rows_per_seq - first_row), item.page_begin,
                      item.page_end, item.partial >= 0, chains});
  }
  return blocks;
}

int MlaDecodePlan::keys_per_step() const {
  if (state_->kernel == DecodeKernel::kWarpgroup) return kWarpgroupStepKeys;
  if (is_transposed_kernel(state_->kernel)) return kTransposedStepKeys;
  int keys = 0;
  const bool two_tiles = state_->schedule.row_tiles_per_block == 2;
  visit_gpu_format(state_->format, [&](auto content, auto rope) {
    using Content = decltype(content);
    using Rope = decltype(rope);
    if constexpr (kFragmentContent<Content>) {
      if (is_fragment_kernel(state_->kernel)) {
        keys = FragmentLayout<Content, Rope>::kStepKeys;  // the same in both forms
        return;
      }
    }
    keys = two_tiles ? DecodeLayout<Content, Rope, 2>::kStepKeys
                     : DecodeLayout<Content, Rope, 1>::kStepKeys;
  });
  return keys;
}

MlaDecodePlan::Operands MlaDecodePlan::operands() const {
  if (is_fragment_kernel(state_->kernel)) return Operands::kFp16Codes;
  return state_->kernel == DecodeKernel::kWarpgroup && bf16_cache(state_->format)
             ? Operands::kBf16TileScaledPairs
             : Operands::kBf16Tile;
}

void mla_decode(const CacheFormat& format, const MlaDecodeParams& params, const MlaDecodePlan& plan,
                void* stream_handle) {
  const MlaDecodePlan::State& state = plan.state();
  if (!(format == state.format)) {
    throw InvalidArgument("GPU decode: format " + format.to_string() +
                          " but the plan was made for " + state.format.to_string());
  }
  if (params.batch != state.batch || params.s_q != state.s_q ||
      params.num_heads != state.num_heads) {
    throw InvalidArgument("GPU decode: params batch " + std::to_string(params.batch) + ", s_q " +
                          std::to_string(params.s_q) + ", heads " +
                          std::to_string(params.num_heads) + " but the plan was made for " +
                          std::to_string(state.batch) + ", " + std::to_string(state.s_q) + ", " +
                          std::to_string(state.num_heads));
  }
  if (params.q == nullptr || params.pool == nullptr || params.block_table == nullptr ||
      params.seq_lens == nullptr || params.out == nullptr) {
    throw InvalidArgument("GPU decode: q, pool, block_table, seq_lens and out must be set");
  }
  if (params.block_table_stride < state.schedule.max_pages) {
    throw InvalidArgument(
        "GPU decode: block_table_stride " + std::to_string(params.block_table_stride) + " < " +
        std::to_string(state.schedule.max_pages) + " pages of the longest sequence");
  }
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  DecodeKernelParams kernel{};
  kernel.q = params.q;
  kernel.pool = params.pool;
  kernel.block_table = params.block_table;
  kernel.block_table_stride = params.block_table_stride;
  kernel.seq_lens = params.seq_lens;
  kernel.out = params.out;
  kernel.lse = params.lse;
  kernel.partial_out = state.partial_out;
  kernel.partial_lse = state.partial_lse;
  kernel.items = state.items;
  kernel.s_q = params.s_q;
  kernel.num_heads = params.num_heads;
  kernel.record_bytes = static_cast<int>(format.record_bytes(kLatentDim, kRopeDim));
  kernel.scale_log2 = params.softmax_scale * static_cast<float>(M_LOG2E);
  kernel.kept = kept_pairs_of(format.rope);
  kernel.pool_ready = params.pool_ready;
  const DecodeSchedule& schedule = state.schedule;
  const PlanLayout& layout = state.layout;
  visit_gpu_format(format, [&](auto content, auto rope) {
    using Content = decltype(content);
    using Rope = decltype(rope);
    if (state.kernel == DecodeKernel::kWarpgroup) {
      launch_decode_warpgroup<Content, Rope>(kernel, params.batch, layout.items,
                                             state.run_pages.shortest, stream);
    } else if (is_transposed_kernel(state.kernel)) {
      if constexpr (kTransposedReads<Content, Rope>) {
        launch_decode_transposed<Content, Rope>(kernel, schedule.row_tiles_per_block, layout.items,
                                                stream);
      } else {
        throw InvalidArgument("GPU decode (internal): the transposed kernel has no path for " +
                              format.to_string());
      }
    } else if (is_fragment_kernel(state.kernel)) {
      if constexpr (kFragmentContent<Content>) {
        launch_decode_fragments<Content, Rope>(
            kernel, layout.items, state.kernel == DecodeKernel::kFragmentsThreeBlocks, stream);
      } else {
        throw InvalidArgument("GPU decode (internal): the fragment kernel has no path for " +
                              format.to_string());
      }
    } else {
      launch_decode<Content, Rope>(kernel, schedule.row_tiles_per_block, layout.items, stream);
    }
  });
  if (layout.combines > 0) {
    CombineKernelParams combine{state.partial_out,
                                state.partial_lse,
                                state.combines,
                                params.out,
                                params.lse,
                                schedule.rows_per_block,
                                params.s_q * params.num_heads};
    const dim3 grid(static_cast<unsigned>(layout.combines),
                    static_cast<unsigned>(schedule.rows_per_block));
    launch_kernel(mla_combine_kernel, grid, kCombineThreads, layout.max_splits * sizeof(float),
                  stream, combine);
    QUANTMLA_CUDA_CHECK_LAUNCH();
  }
}

bool device_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace quantmla::gpu
