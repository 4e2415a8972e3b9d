// The split of one GPU decode call into thread blocks (host code, no CUDA): which query rows and
// which run of pages each block takes, and where split sequences' partial results go.
#pragma once

#include <cstdint>
#include <vector>

namespace quantmla::gpu {

// One thread block of the decode kernel. Device record: its size is asserted.
struct WorkItem {
  int32_t batch;       // sequence
  int32_t row_tile;    // query rows [row_tile * rows_per_block, +rows_per_block) of s_q x heads
                       // (64-row blocks: a sequence's last may reach past its rows, padding)
  int32_t page_begin;  // logical pages [page_begin, page_end) of the sequence
  int32_t page_end;
  int32_t partial;  // slot of the partial result, or -1: this block writes the final output
};
static_assert(sizeof(WorkItem) == 20);

// One (sequence, row tile) whose page runs the combine kernel merges.
struct CombineItem {
  int32_t batch;
  int32_t row_tile;
  int32_t first_partial;  // partial slots [first_partial, first_partial + num_splits)
  int32_t num_splits;
};
static_assert(sizeof(CombineItem) == 16);

struct DecodeSchedule {
  int row_tiles_per_block = 1;  // 16-row MMA tiles per block: 1, 2 or 4
  int rows_per_block = 16;
  int row_tiles = 0;  // blocks along s_q x heads for one sequence
  int num_partials = 0;
  int max_splits = 1;
  int max_pages = 0;  // pages of the longest sequence
  std::vector<WorkItem> items;
  std::vector<CombineItem> combines;
};

// Fewest pages one block takes when a sequence is split.
inline constexpr int kMinPagesPerSplit = 2;

// Most runs one sequence is split into: sqrt(kSplitCostRatio x pages). A block's time grows by
// about b per page (a chain of latencies at a few blocks a GPU) and the combine's by about c per
// run, so a sequence of P pages alone is fastest near sqrt(b P / c) runs; b / c ~ 11 measured on
// the H200 at batch 1 (bench_gpu_decode --pages-per-split, 1K-16K contexts: 16 pages best in 8-16
// runs, 64 in ~32, 256 in ~64; docs/benchmarks.md).
inline constexpr int kSplitCostRatio = 12;

// The runs of one sequence of `pages` pages whose share of the concurrent blocks is `share`.
int split_count(int64_t pages, int64_t share);

// The pages of each run of a (sequence, row tile) of `pages` pages when all such pairs of the
// batch hold `total_units` pages: split_count with its share of the `concurrent_blocks` that run
// at once (rounded down so that the blocks of a uniform batch fit in one wave, at least one, at
// most one a multiprocessor), the runs as long as each other but the last.
int64_t plan_run_pages(int64_t pages, int64_t total_units, int64_t concurrent_blocks,
                       int multiprocessors);

// The blocks that plan_decode (pages_per_split 0) keeps running at once for `units` (sequence, row
// tile) pairs of `pages` pages each: all their runs, at most multiprocessors x
// blocks_per_multiprocessor.
int64_t uniform_blocks_at_once(int64_t units, int64_t pages, int multiprocessors,
                               int blocks_per_multiprocessor);

// Whether a kernel form of `more` blocks a multiprocessor keeps more of them running at once on
// `units` (sequence, row tile) pairs of a long context than a form of `fewer` could hold at all:
// where it does not, the plan gives it at most `fewer` blocks a multiprocessor anyway (the pairs'
// shares round down to one run each). The fragment kernel's three-block form (no producer warp)
// is taken only where this holds against its two-block form (decode.cu).
bool more_blocks_fill_more(int64_t units, int multiprocessors, int more, int fewer);

// Whether the transposed kernel takes its two-tile form, 32-row blocks (a page read once for both
// tokens of s_q = 2 at 16 heads), for `batch` sequences of `row_tiles` 16-row tiles each: where
// they come in pairs (the rows in 32s), from kTransposedTwoTilesMinBatch sequences where the
// contexts are long or the 16-row blocks would not all run at once on `multiprocessors` (one block
// each). Elsewhere half the blocks left short sequences split into more, shorter runs
// and a combine.
inline constexpr int kTransposedTwoTilesMinBatch = 16;
bool transposed_two_tiles(int batch, int row_tiles, bool long_context, int multiprocessors);

// 16-row MMA tiles per block for s_q x num_heads query rows: four when the kernel takes four
// (max_row_tiles 4: the warpgroup kernel, whose last block of a sequence is padded when the rows
// do not come in 64s), two when they come in 32s and the kernel takes two (max_row_tiles 2: the
// tiled kernel), else one.
int row_tiles_per_block(int s_q, int num_heads, int max_row_tiles = 2);

// Splits the work. pages_per_split = 0: each sequence gets its share of the blocks that run at once
// (multiprocessors x blocks_per_multiprocessor), at least one and at most one per multiprocessor
// (more runs of one sequence add partial-result traffic, not parallelism), at most
// sqrt(kSplitCostRatio x pages) runs, each of at least kMinPagesPerSplit pages; > 0: runs of
// exactly that many pages. A sequence's row tiles take the same runs, so that their blocks read
// each page at about the same time and the second read comes from L2 (a plan of the 128-head BF16
// kernel that ran them at different pages took 1.5-2.2x the time: docs/benchmarks.md,
// "Forty-sixth session"). max_row_tiles: the most 16-row tiles the kernel takes in one block (4, 2
// or 1). Throws InvalidArgument for num_heads not a positive multiple of 16, s_q < 1, or a sequence
// shorter than s_q.
DecodeSchedule plan_decode(const std::vector<int32_t>& seq_lens, int s_q, int num_heads,
                           int multiprocessors, int blocks_per_multiprocessor, int pages_per_split,
                           int max_row_tiles = 2);

// The pages of one run of a batch-invariant plan whose token sees `pages` pages: at least
// kBatchInvariantMinRunPages, and at most kBatchInvariantMaxRuns runs.
int invariant_run_pages(int64_t pages);

// The split of a batch-invariant plan (DecodeSplit::kBatchInvariant): one 16-row tile a block (a
// tile holds one token's heads, num_heads a multiple of 16), each tile taking only the pages its
// token sees (query i of s_q sees seq_len - s_q + i + 1 keys) in runs of invariant_run_pages of
// them from the first, every run a partial result merged by the combine kernel, a single run too.
// A row's runs and their merge then depend on its own position alone: the same when its token is
// decoded alone, in a batch, or inside a prefill chunk. Throws as plan_decode.
DecodeSchedule plan_decode_invariant(const std::vector<int32_t>& seq_lens, int s_q, int num_heads);

// The most blocks, partial results and combine items that plan_decode with pages_per_split = 0 can
// give `batch` sequences of any lengths: the blocks are at most the concurrent ones plus one per
// (sequence, row tile) (each sequence's share is rounded down, then raised to at least 1), and
// only sequences whose share is 2 or more are split, so their runs never exceed the concurrent
// blocks. A plan in a workspace launches this fixed grid (CUDA graphs).
struct DecodeCapacity {
  int items = 0;
  int partials = 0;
  int combines = 0;
  int max_splits = 1;
  int rows_per_block = 16;
};
DecodeCapacity decode_capacity(int batch, int s_q, int num_heads, int multiprocessors,
                               int blocks_per_multiprocessor, int max_row_tiles = 2);

}  // namespace quantmla::gpu
