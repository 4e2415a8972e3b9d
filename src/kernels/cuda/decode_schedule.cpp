#include "kernels/cuda/decode_schedule.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"

namespace quantmla::gpu {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// What every split needs of its batch (plan_decode's errors).
void check_batch(const std::vector<int32_t>& seq_lens, int s_q, int num_heads) {
  if (num_heads <= 0 || num_heads % 16 != 0) {
    throw InvalidArgument("GPU decode: num_heads " + std::to_string(num_heads) +
                          ", expected a positive multiple of 16");
  }
  if (s_q < 1) throw InvalidArgument("GPU decode: s_q " + std::to_string(s_q) + ", expected >= 1");
  if (seq_lens.empty()) throw InvalidArgument("GPU decode: empty batch");
  for (size_t b = 0; b < seq_lens.size(); ++b) {
    if (seq_lens[b] < s_q) {
      throw InvalidArgument("GPU decode: sequence " + std::to_string(b) + " holds " +
                            std::to_string(seq_lens[b]) + " tokens, fewer than its " +
                            std::to_string(s_q) + " queries");
    }
  }
}

}  // namespace

int split_count(int64_t pages, int64_t share) {
  const auto latency_optimum =
      static_cast<int64_t>(std::sqrt(static_cast<double>(kSplitCostRatio) * pages));
  const int64_t runs = std::min({share, latency_optimum, pages / kMinPagesPerSplit});
  return static_cast<int>(std::max<int64_t>(runs, 1));
}

int64_t plan_run_pages(int64_t pages, int64_t total_units, int64_t concurrent_blocks,
                       int multiprocessors) {
  const int64_t share =
      std::clamp<int64_t>(pages * concurrent_blocks / total_units, 1, multiprocessors);
  return ceil_div(pages, split_count(pages, share));
}

int64_t uniform_blocks_at_once(int64_t units, int64_t pages, int multiprocessors,
                               int blocks_per_multiprocessor) {
  const int64_t concurrent = static_cast<int64_t>(multiprocessors) * blocks_per_multiprocessor;
  const int64_t runs =
      ceil_div(pages, plan_run_pages(pages, units * pages, concurrent, multiprocessors));
  return std::min(units * runs, concurrent);
}

bool more_blocks_fill_more(int64_t units, int multiprocessors, int more, int fewer) {
  // Any long context: the runs' other limits (split_count) bind only where the shares are large.
  return uniform_blocks_at_once(units, kLongContextPages + 1, multiprocessors, more) >
         static_cast<int64_t>(multiprocessors) * fewer;
}

bool transposed_two_tiles(int batch, int row_tiles, bool long_context, int multiprocessors) {
  return row_tiles % 2 == 0 && batch >= kTransposedTwoTilesMinBatch &&
         (long_context || static_cast<int64_t>(batch) * row_tiles > multiprocessors);
}

int row_tiles_per_block(int s_q, int num_heads, int max_row_tiles) {
  if (max_row_tiles >= 4) return 4;
  return max_row_tiles >= 2 && (s_q * num_heads) % 32 == 0 ? 2 : 1;
}

DecodeSchedule plan_decode(const std::vector<int32_t>& seq_lens, int s_q, int num_heads,
                           int multiprocessors, int blocks_per_multiprocessor, int pages_per_split,
                           int max_row_tiles) {
  const int64_t concurrent_blocks =
      static_cast<int64_t>(multiprocessors) * blocks_per_multiprocessor;
  check_batch(seq_lens, s_q, num_heads);
  if (pages_per_split < 0 ||
      (pages_per_split == 0 && (multiprocessors <= 0 || blocks_per_multiprocessor <= 0))) {
    throw InvalidArgument("GPU decode: pages_per_split " + std::to_string(pages_per_split) +
                          " with " + std::to_string(multiprocessors) + " multiprocessors x " +
                          std::to_string(blocks_per_multiprocessor) + " blocks");
  }
  DecodeSchedule schedule;
  const int rows = s_q * num_heads;
  // Two (four) row tiles per block read each page once for 32 (64) rows; 16 rows otherwise.
  schedule.row_tiles_per_block = row_tiles_per_block(s_q, num_heads, max_row_tiles);
  schedule.rows_per_block = 16 * schedule.row_tiles_per_block;
  schedule.row_tiles = static_cast<int>(ceil_div(rows, schedule.rows_per_block));

  int64_t total_units = 0;
  for (const int32_t len : seq_lens) {
    const int64_t pages = ceil_div(len, kPageTokens);
    schedule.max_pages = std::max<int>(schedule.max_pages, static_cast<int>(pages));
    total_units += pages * schedule.row_tiles;
  }

  for (size_t b = 0; b < seq_lens.size(); ++b) {
    const int64_t pages = ceil_div(seq_lens[b], kPageTokens);
    int64_t per_split = pages_per_split;
    if (per_split == 0) {
      // Each row tile's runs (their pages: plan_run_pages).
      per_split = plan_run_pages(pages, total_units, concurrent_blocks, multiprocessors);
    }
    const int64_t splits = ceil_div(pages, per_split);
    schedule.max_splits = std::max<int>(schedule.max_splits, static_cast<int>(splits));
    for (int rt = 0; rt < schedule.row_tiles; ++rt) {
      const int first_partial = splits > 1 ? schedule.num_partials : -1;
      for (int64_t s = 0; s < splits; ++s) {
        WorkItem item;
        item.batch = static_cast<int32_t>(b);
        item.row_tile = rt;
        item.page_begin = static_cast<int32_t>(s * per_split);
        item.page_end = static_cast<int32_t>(std::min(pages, (s + 1) * per_split));
        item.partial = splits > 1 ? schedule.num_partials++ : -1;
        schedule.items.push_back(item);
      }
      if (splits > 1) {
        schedule.combines.push_back(
            {static_cast<int32_t>(b), rt, first_partial, static_cast<int32_t>(splits)});
      }
    }
  }
  return schedule;
}

int invariant_run_pages(int64_t pages) {
  return static_cast<int>(
      std::max<int64_t>(kBatchInvariantMinRunPages, ceil_div(pages, kBatchInvariantMaxRuns)));
}

DecodeSchedule plan_decode_invariant(const std::vector<int32_t>& seq_lens, int s_q, int num_heads) {
  check_batch(seq_lens, s_q, num_heads);
  DecodeSchedule schedule;
  schedule.row_tiles = s_q * num_heads / 16;
  const int tiles_per_token = num_heads / 16;
  for (size_t b = 0; b < seq_lens.size(); ++b) {
    schedule.max_pages =
        std::max<int>(schedule.max_pages, static_cast<int>(ceil_div(seq_lens[b], kPageTokens)));
    for (int rt = 0; rt < schedule.row_tiles; ++rt) {
      // The tile's token, query rt / tiles_per_token of s_q, sees this many keys.
      const int64_t visible = seq_lens[b] - s_q + rt / tiles_per_token + 1;
      const int64_t pages = ceil_div(visible, kPageTokens);
      const int64_t per_run = invariant_run_pages(pages);
      const int64_t runs = ceil_div(pages, per_run);
      schedule.max_splits = std::max<int>(schedule.max_splits, static_cast<int>(runs));
      schedule.combines.push_back(
          {static_cast<int32_t>(b), rt, schedule.num_partials, static_cast<int32_t>(runs)});
      for (int64_t r = 0; r < runs; ++r) {
        schedule.items.push_back({static_cast<int32_t>(b), rt, static_cast<int32_t>(r * per_run),
                                  static_cast<int32_t>(std::min(pages, (r + 1) * per_run)),
                                  schedule.num_partials++});
      }
    }
  }
  return schedule;
}

DecodeCapacity decode_capacity(int batch, int s_q, int num_heads, int multiprocessors,
                               int blocks_per_multiprocessor, int max_row_tiles) {
  if (batch < 1 || s_q < 1 || num_heads <= 0 || num_heads % 16 != 0 || multiprocessors < 1 ||
      blocks_per_multiprocessor < 1) {
    throw InvalidArgument("GPU decode capacity: batch " + std::to_string(batch) + ", s_q " +
                          std::to_string(s_q) + ", heads " + std::to_string(num_heads) + ", " +
                          std::to_string(multiprocessors) + " multiprocessors x " +
                          std::to_string(blocks_per_multiprocessor) + " blocks");
  }
  const int64_t concurrent = static_cast<int64_t>(multiprocessors) * blocks_per_multiprocessor;
  DecodeCapacity capacity;
  capacity.rows_per_block = 16 * row_tiles_per_block(s_q, num_heads, max_row_tiles);
  const int64_t row_tiles =
      ceil_div(static_cast<int64_t>(s_q) * num_heads, capacity.rows_per_block);
  const int64_t items = concurrent + batch * row_tiles;
  if (items > (int64_t{1} << 31) - 1) {
    throw InvalidArgument("GPU decode capacity: " + std::to_string(items) + " blocks");
  }
  capacity.items = static_cast<int>(items);
  capacity.partials = static_cast<int>(concurrent);
  capacity.combines = static_cast<int>(std::min<int64_t>(batch * row_tiles, concurrent / 2));
  capacity.max_splits = multiprocessors;
  return capacity;
}

}  // namespace quantmla::gpu
