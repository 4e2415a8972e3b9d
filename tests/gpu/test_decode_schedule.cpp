// The GPU decode's work split, checked exhaustively on the host (no GPU needed): every (sequence,
// row tile, page) is covered exactly once, runs are contiguous and in order (the same for every
// row tile of a sequence), partial slots are unique and the combine items point at them, and bad
// arguments are refused. Also the format check, the fragment kernels' index maps and the plan's
// kernel choice. Exit status 0 when every check passes.
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cuda/decode_kernels.h"
#include "kernels/cuda/decode_schedule.h"
#include "kernels/cuda/fragment_maps.h"
#include "quantmla/cache_format.h"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"

namespace {

using namespace quantmla;
using namespace quantmla::gpu;

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

void check_schedule(const std::vector<int32_t>& lens, int s_q, int heads, int sms, int per_sm,
                    int per_split, int max_tiles) {
  const std::string name = "lens " + std::to_string(lens.size()) + " first " +
                           std::to_string(lens[0]) + " s_q " + std::to_string(s_q) + " heads " +
                           std::to_string(heads) + " sms " + std::to_string(sms) + "x" +
                           std::to_string(per_sm) + " split " + std::to_string(per_split) +
                           " max tiles " + std::to_string(max_tiles);
  const DecodeSchedule schedule = plan_decode(lens, s_q, heads, sms, per_sm, per_split, max_tiles);
  const int rows = s_q * heads;
  // Every row in exactly one tile; only 64-row tiles pad a sequence's last.
  expect(
      schedule.rows_per_block * schedule.row_tiles >= rows &&
          schedule.rows_per_block * (schedule.row_tiles - 1) < rows &&
          (schedule.rows_per_block == 64 || schedule.rows_per_block * schedule.row_tiles == rows),
      name + ": rows covered");
  const int expected_rows = max_tiles >= 4 ? 64 : rows % 32 == 0 && max_tiles >= 2 ? 32 : 16;
  expect(schedule.rows_per_block == expected_rows, name + ": row tile size");
  // (sequence, row tile) -> pages seen, in order.
  std::map<std::pair<int, int>, std::vector<WorkItem>> runs;
  std::vector<int> partial_seen(schedule.num_partials, 0);
  for (const WorkItem& item : schedule.items) {
    runs[{item.batch, item.row_tile}].push_back(item);
    expect(item.page_begin < item.page_end, name + ": non-empty run");
    if (item.partial >= 0) {
      expect(item.partial < schedule.num_partials, name + ": partial slot in range");
      if (item.partial < schedule.num_partials) ++partial_seen[item.partial];
    }
  }
  for (int count : partial_seen) expect(count == 1, name + ": each partial slot used once");
  int max_pages = 0;
  for (size_t b = 0; b < lens.size(); ++b) {
    const int pages = (lens[b] + kPageTokens - 1) / kPageTokens;
    max_pages = std::max(max_pages, pages);
    for (int rt = 0; rt < schedule.row_tiles; ++rt) {
      const auto& list = runs[{static_cast<int>(b), rt}];
      int next = 0;
      for (const WorkItem& item : list) {
        expect(item.page_begin == next, name + ": runs contiguous and ordered");
        next = item.page_end;
        expect((list.size() > 1) == (item.partial >= 0), name + ": partial iff split");
        if (per_split > 0)
          expect(item.page_end - item.page_begin <= per_split, name + ": run size");
      }
      expect(next == pages, name + ": every page covered");
      // The row tiles of a sequence take the same runs, so that their blocks read each page
      // together (the second read from L2; decode_schedule.h).
      const auto& first = runs[{static_cast<int>(b), 0}];
      const bool same =
          std::equal(list.begin(), list.end(), first.begin(), first.end(),
                     [](const WorkItem& x, const WorkItem& y) {
                       return x.page_begin == y.page_begin && x.page_end == y.page_end;
                     });
      expect(same, name + ": row tile " + std::to_string(rt) + " runs as row tile 0");
    }
  }
  expect(schedule.max_pages == max_pages, name + ": max_pages");
  int combined = 0;
  for (const CombineItem& c : schedule.combines) {
    const auto& list = runs[{c.batch, c.row_tile}];
    expect(c.num_splits == static_cast<int>(list.size()), name + ": combine split count");
    for (int s = 0; s < c.num_splits && s < static_cast<int>(list.size()); ++s) {
      expect(list[s].partial == c.first_partial + s, name + ": combine slots consecutive");
    }
    combined += c.num_splits;
  }
  expect(combined == schedule.num_partials, name + ": every partial combined");
  if (per_split == 0) {
    // A uniform batch fits in one wave of the multiprocessors (at least one block a sequence).
    bool uniform = true;
    for (const int32_t len : lens) uniform = uniform && len == lens[0];
    const int floor_blocks = static_cast<int>(lens.size()) * schedule.row_tiles;
    if (uniform && floor_blocks <= sms * per_sm) {
      expect(static_cast<int>(schedule.items.size()) <= sms * per_sm, name + ": one wave");
    }
    for (const auto& [key, list] : runs) {
      expect(static_cast<int>(list.size()) <= std::max(1, sms), name + ": a run per SM at most");
    }
    // A plan in a workspace launches decode_capacity's grid: the schedule must fit in it.
    const DecodeCapacity capacity =
        decode_capacity(static_cast<int>(lens.size()), s_q, heads, sms, per_sm, max_tiles);
    expect(static_cast<int>(schedule.items.size()) <= capacity.items, name + ": items fit");
    expect(schedule.num_partials <= capacity.partials, name + ": partials fit");
    expect(static_cast<int>(schedule.combines.size()) <= capacity.combines,
           name + ": combines fit");
    expect(schedule.max_splits <= capacity.max_splits, name + ": splits fit");
    expect(schedule.rows_per_block == capacity.rows_per_block, name + ": rows per block");
  }
}

// A batch-invariant split (plan_decode_invariant): each 16-row tile's runs cover exactly the pages
// its own token sees, contiguous and in order, at most kBatchInvariantMaxRuns of them, each of at
// most invariant_run_pages; every run a partial result, every tile combined once over its runs'
// slots; and each tile's runs equal those of its token decoded alone (s_q 1 at its own length).
void check_invariant_schedule(const std::vector<int32_t>& lens, int s_q, int heads) {
  const std::string name = "invariant lens " + std::to_string(lens.size()) + " first " +
                           std::to_string(lens[0]) + " s_q " + std::to_string(s_q) + " heads " +
                           std::to_string(heads);
  const DecodeSchedule schedule = plan_decode_invariant(lens, s_q, heads);
  expect(schedule.rows_per_block == 16 && schedule.row_tiles == s_q * heads / 16,
         name + ": 16-row tiles");
  std::map<std::pair<int, int>, std::vector<WorkItem>> runs;
  for (const WorkItem& item : schedule.items) {
    runs[{item.batch, item.row_tile}].push_back(item);
    expect(item.partial >= 0 && item.partial < schedule.num_partials, name + ": every run partial");
  }
  expect(schedule.combines.size() == lens.size() * schedule.row_tiles, name + ": a combine a tile");
  for (const CombineItem& c : schedule.combines) {
    const auto& list = runs[{c.batch, c.row_tile}];
    expect(c.num_splits == static_cast<int>(list.size()), name + ": combine split count");
    for (int s = 0; s < c.num_splits && s < static_cast<int>(list.size()); ++s) {
      expect(list[s].partial == c.first_partial + s, name + ": combine slots consecutive");
    }
  }
  for (size_t b = 0; b < lens.size(); ++b) {
    for (int rt = 0; rt < schedule.row_tiles; ++rt) {
      const int visible = lens[b] - s_q + rt / (heads / 16) + 1;
      const int pages = (visible + kPageTokens - 1) / kPageTokens;
      const auto& list = runs[{static_cast<int>(b), rt}];
      expect(static_cast<int>(list.size()) <= kBatchInvariantMaxRuns, name + ": runs capped");
      int next = 0;
      for (const WorkItem& item : list) {
        expect(item.page_begin == next, name + ": runs contiguous and ordered");
        expect(item.page_end - item.page_begin <= invariant_run_pages(pages), name + ": run size");
        next = item.page_end;
      }
      expect(next == pages, name + ": exactly the token's pages");
      // The same token decoded alone (its first row tile's runs): the same pages.
      const DecodeSchedule alone = plan_decode_invariant({visible}, 1, heads);
      bool same = true;
      for (size_t i = 0; i < list.size(); ++i) {
        same = same && i < alone.items.size() && alone.items[i].row_tile == 0 &&
               alone.items[i].page_begin == list[i].page_begin &&
               alone.items[i].page_end == list[i].page_end;
      }
      expect(same && alone.combines[0].num_splits == static_cast<int>(list.size()),
             name + ": a tile's runs are its token's runs alone");
    }
  }
}

template <class F>
void expect_invalid(const std::string& what, F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    std::printf("refused as expected: %s\n", e.what());
    return;
  }
  expect(false, what + ": not refused");
}

// Every register half of a warp's A fragment over a 64-channel box: k-step s (0-3), lane t (0-3),
// register h and half e (fragment_maps.h's indices).
template <class F>
void for_each_key_register(F&& f) {
  for (int s = 0; s < 4; ++s) {
    for (int t = 0; t < 4; ++t) {
      for (int h = 0; h < 2; ++h) {
        for (int e = 0; e < 2; ++e) f(s, t, h, e);
      }
    }
  }
}

// The fragment kernel's channel maps (fragment_maps.h): each a bijection onto a group's 64
// channels, consistent with the code words and nibbles the kernel reads.
void check_fragment_maps() {
  std::array<int, 64> int4_keys{}, bf16_keys{}, values{};
  for_each_key_register([&](int s, int t, int h, int e) {
    const int channel = int4_key_channel(s, t, h, e);
    if (channel < 0 || channel >= 64) {
      expect(false, "int4_key_channel out of range");
      return;
    }
    ++int4_keys[channel];
    // Q is loaded as the words (c, c + 1) and (c + 4, c + 5), c = the (h, e) = (0, 0)
    // channel.
    expect(channel == int4_key_channel(s, t, 0, 0) + h + 4 * e,
           "int4_key_channel: register h, half e at c + h + 4e");
    expect(bf16_key_channel(s, t, h, e) == bf16_key_channel(s, t, h, 0) + e,
           "bf16_key_channel: a register's halves adjacent");
    const FragmentPlace place = int4_key_place(channel);
    expect(place.s == s && place.t == t && place.h == h && place.e == e,
           "int4_key_place inverts int4_key_channel at channel " + std::to_string(channel));
    // Word 2t + (s >> 1) of the group, nibble int4_key_nibble: channel 8 word + nibble.
    expect(channel == 8 * (2 * t + (s >> 1)) + int4_key_nibble(s, h, e),
           "int4_key_channel agrees with the word and nibble read");
    // Shifted by int4_key_word_shift, the nibble sits at int4_code_position of its half.
    expect(4 * int4_key_nibble(s, h, e) - int4_key_word_shift(s) ==
               int4_code_position(channel) + 16 * e,
           "int4 key code position of channel " + std::to_string(channel));
    // The B fragment's k index 2t + e (h = 0) or 2t + 8 + e (h = 1) of k-step s: each k
    // index of a k-step is one channel, and the 16 of a k-step are distinct.
    const int bf16 = bf16_key_channel(s, t, h, e);
    if (bf16 >= 0 && bf16 < 64) ++bf16_keys[bf16];
    expect(bf16 == 16 * s + 2 * t + 8 * h + e, "bf16_key_channel is the mma's k index");
  });
  // The transposed kernel's converting form: a bijection onto a box's 64 tile columns, each the
  // code that its word and shift give in the tile column order of the codes' span.
  std::array<int, 64> transposed_keys{};
  for_each_key_register([&](int s, int t, int h, int e) {
    const int column = transposed_key_column(s, t, h, e);
    if (column < 0 || column >= 64) {
      expect(false, "transposed_key_column out of range");
      return;
    }
    ++transposed_keys[column];
    // Int4: nibble n + 4e of word u at column 8u + 2n + e; int2: code i + 8e of word w at
    // column 16w + 2i + e.
    const int nibble = transposed_key_code_shift(4, t, h) / 4 + 4 * e;
    expect(column / 8 == transposed_key_code_word(4, s, h) &&
               column % 8 == 2 * (nibble % 4) + nibble / 4,
           "transposed_key_column: int4, the nibble its word and shift give at column " +
               std::to_string(column));
    const int code = transposed_key_code_shift(2, t, h) / 2 + 8 * e;
    expect(column / 16 == transposed_key_code_word(2, s, h) &&
               column % 16 == 2 * (code % 8) + code / 8,
           "transposed_key_column: int2, the code its word and shift give at column " +
               std::to_string(column));
    expect(column == 16 * s + 2 * t + 8 * h + e, "transposed_key_column is the mma's k index");
    const FragmentPlace place = transposed_key_place(column);
    expect(
        place.s == s && place.t == t && place.h == h && place.e == e,
        "transposed_key_place inverts transposed_key_column at column " + std::to_string(column));
  });
  expect(std::all_of(transposed_keys.begin(), transposed_keys.end(), [](int n) { return n == 1; }),
         "transposed_key_column covers each column once");
  for (int j = 0; j < 4; ++j) {
    for (int row = 0; row < 16; ++row) {
      const int channel = int4_value_channel(j, row);
      if (channel >= 0 && channel < 64) ++values[channel];
      // Row g, g + 8: low and high nibble of byte j of code word g.
      const int word = row % 8, nibble = 2 * j + row / 8;
      expect(channel == 8 * word + nibble, "int4_value_channel agrees with the byte read");
      expect(4 * (row / 8) == int4_code_position(channel), "int4 value code position");
    }
  }
  // Int2: word t of the group, the code at bit int2_key_shift (+ 16 for the high half).
  std::array<int, 64> int2_keys{}, int2_values{};
  for_each_key_register([&](int s, int t, int h, int e) {
    const int channel = int2_key_channel(s, t, h, e);
    if (channel >= 0 && channel < 64) ++int2_keys[channel];
    // Q is loaded as the words (c, c + 1) and (c + 8, c + 9).
    expect(channel == int2_key_channel(s, t, 0, 0) + h + 8 * e,
           "int2_key_channel: register h, half e at c + h + 8e");
    const int bit = int2_key_shift(s, h) + 16 * e;
    expect(channel == 16 * t + bit / 2 && bit % 2 == 0,
           "int2_key_channel agrees with the word and bits read");
    // Shifted by int2_key_word_shift, within FP16's 10 mantissa bits.
    const int position = int2_key_shift(s, h) - int2_key_word_shift(s, h);
    expect(position == int2_key_code_position(channel) && position >= 0 && position <= 8,
           "int2 key code position of channel " + std::to_string(channel));
  });
  for (int j = 0; j < 4; ++j) {
    for (int row = 0; row < 16; ++row) {
      const int channel = int2_value_channel(j, row);
      if (channel >= 0 && channel < 64) ++int2_values[channel];
      // Byte row % 8 % 4 of word row % 8 / 4 (+ 2 for j >= 2); the code at int2_value_shift (+ 2
      // for row + 8) of that byte: channel 16 word + 4 byte + code.
      const int word = (row % 8) / 4 + 2 * (j / 2), byte = (row % 8) % 4;
      const int code = (int2_value_shift(j) + 2 * (row / 8)) / 2;
      expect(channel == 16 * word + 4 * byte + code,
             "int2_value_channel agrees with the byte read");
      expect(int2_value_shift(j) + 2 * (row / 8) == int2_value_code_position(channel),
             "int2 value code position");
    }
  }
  for (int c = 0; c < 64; ++c) {
    expect(int4_keys[c] == 1 && bf16_keys[c] == 1 && values[c] == 1 && int2_keys[c] == 1 &&
               int2_values[c] == 1,
           "channel " + std::to_string(c) + " held exactly once by each fragment map");
  }
  // fp8: a group of 128 channels, keys by k-step over the whole group, values by halves of 64.
  std::array<int, 128> fp8_keys{}, fp8_values{};
  for (int s = 0; s < 8; ++s) {
    for (int t = 0; t < 4; ++t) {
      for (int h = 0; h < 2; ++h) {
        for (int e = 0; e < 2; ++e) {
          const int channel = fp8_key_channel(s, t, h, e);
          if (channel >= 0 && channel < 128) ++fp8_keys[channel];
          // Byte 2h + e of the group's word 4s + t; Q loaded as the pair (c, c + 1).
          expect(channel == 4 * (4 * s + t) + 2 * h + e,
                 "fp8_key_channel agrees with the word and byte read");
          expect(channel == fp8_key_channel(s, t, h, 0) + e, "fp8_key_channel: pairs adjacent");
        }
      }
    }
  }
  for (int half = 0; half < 2; ++half) {
    for (int j = 0; j < 4; ++j) {
      for (int row = 0; row < 16; ++row) {
        const int channel = 64 * half + fp8_value_channel(j, row);
        if (channel >= 0 && channel < 128) ++fp8_values[channel];
        // Byte 2 (j % 2) + row / 8 of the half's word row % 8 + 8 (j / 2).
        const int word = 16 * half + row % 8 + 8 * (j / 2), byte = 2 * (j % 2) + row / 8;
        expect(channel == 4 * word + byte, "fp8_value_channel agrees with the byte read");
      }
    }
  }
  for (int c = 0; c < 128; ++c) {
    expect(fp8_keys[c] == 1 && fp8_values[c] == 1,
           "fp8 channel " + std::to_string(c) + " held exactly once by each fragment map");
  }
}

// The plan's kernel choice (select_decode_kernel, decode.cu), on the host: over formats, batches,
// head counts, s_q, both context classes, SM counts and batch-invariant plans, every choice reads
// its format, a batch-invariant plan keeps to the 16-row kernels, the two-tile form takes rows in
// 32s; then each rule the measurements set, at its edges. Returns the choices checked.
int check_kernel_choice() {
  unsetenv("QUANTMLA_DECODE_KERNEL");  // the plan's own choice
  const auto reads = [](DecodeKernel kernel, const CacheFormat& format) {
    switch (kernel) {
      case DecodeKernel::kTiled:
        return true;
      case DecodeKernel::kFragments:
        return fragments_kernel_reads(format);
      case DecodeKernel::kFragmentsThreeBlocks:
        return fragments_three_blocks_reads(format);
      case DecodeKernel::kWarpgroup:
        return warpgroup_kernel_reads(format);
      case DecodeKernel::kTransposed:
      case DecodeKernel::kTransposedTwoTiles:
        return transposed_kernel_reads(format);
    }
    return false;
  };
  // As the plan asks (decode.cu's device_shape): a batch-invariant plan as for the largest batch.
  const auto choose = [](const CacheFormat& format, int batch, int s_q, int heads, bool invariant,
                         bool long_context, int sms = 132) {
    return select_decode_kernel(format, invariant ? std::numeric_limits<int>::max() : batch, s_q,
                                heads, invariant, long_context, (s_q * heads + 15) / 16, sms);
  };
  int checked = 0;
  for (const char* spec :
       {"content=bf16,rope=bf16", "content=fp8,rope=bf16", "content=int4:g64,rope=int4:g64",
        "content=int4:g64,rope=bf16", "content=int4:g64,rope=int4:g64:bf16pairs=0+21",
        "content=int4:g128,rope=int4:g64", "content=int4:g128,rope=bf16",
        "content=int2:g64,rope=int4:g64", "content=int2:g128,rope=bf16"}) {
    const CacheFormat format = CacheFormat::parse(spec);
    check_gpu_format(format);
    for (const int batch : {1, 2, 15, 16, 31, 32, 63, 64, 128, 1000}) {
      for (const int heads : {16, 32, 48, 64, 128}) {
        for (const int s_q : {1, 2}) {
          for (const bool long_context : {false, true}) {
            for (const bool invariant : {false, true}) {
              for (const int sms : {78, 114, 132}) {
                const DecodeKernel kernel =
                    choose(format, batch, s_q, heads, invariant, long_context, sms);
                const std::string name = std::string(spec) + " batch " + std::to_string(batch) +
                                         " heads " + std::to_string(heads) + " s_q " +
                                         std::to_string(s_q) + (long_context ? " long" : "") +
                                         (invariant ? " invariant" : "") + " on " +
                                         std::to_string(sms) + " SMs";
                expect(reads(kernel, format), name + ": the chosen kernel reads the format");
                expect(!invariant || kernel == DecodeKernel::kTiled ||
                           kernel == DecodeKernel::kFragments,
                       name + ": a batch-invariant plan takes a 16-row kernel");
                expect(kernel != DecodeKernel::kTransposedTwoTiles || (s_q * heads) % 32 == 0,
                       name + ": the two-tile form takes rows in 32s");
                ++checked;
              }
            }
          }
        }
      }
    }
  }
  const CacheFormat bf16 = CacheFormat::parse("content=bf16,rope=bf16");
  const CacheFormat int4 = CacheFormat::parse("content=int4:g64,rope=int4:g64");
  const CacheFormat int4_g128 = CacheFormat::parse("content=int4:g128,rope=bf16");
  const CacheFormat int2 = CacheFormat::parse("content=int2:g64,rope=int4:g64");
  // BF16: the transposed kernel below 64 heads (its two-tile form where the rows come in 32s and
  // the sequences are many and long); the warpgroup kernel from 64, but the transposed kernel for
  // one sequence of one token up to kLongContextPages pages.
  expect(choose(bf16, 64, 1, 16, false, true) == DecodeKernel::kTransposed &&
             choose(bf16, 1, 1, 32, false, false) == DecodeKernel::kTransposed &&
             choose(bf16, 128, 1, 48, false, false) == DecodeKernel::kTransposed &&
             choose(bf16, 64, 1, 32, false, true) == DecodeKernel::kTransposedTwoTiles,
         "bf16 below 64 heads: the transposed kernel (32 rows a block at 32 heads, 64 long)");
  expect(choose(bf16, 1, 1, 32, true, false) == DecodeKernel::kTiled,
         "bf16 at 32 heads, batch-invariant: the tiled kernel");
  for (const int heads : {64, 128}) {
    const std::string at = " at " + std::to_string(heads) + " heads";
    expect(choose(bf16, 1, 1, heads, false, false) == DecodeKernel::kTransposed,
           "bf16, one short sequence" + at + ": the transposed kernel");
    expect(choose(bf16, 1, 1, heads, false, true) == DecodeKernel::kWarpgroup,
           "bf16, one long sequence" + at + ": the warpgroup kernel");
    expect(choose(bf16, 1, 2, heads, false, false) == DecodeKernel::kWarpgroup,
           "bf16, one short sequence at s_q = 2" + at + ": the warpgroup kernel");
    expect(choose(bf16, 2, 1, heads, false, false) == DecodeKernel::kWarpgroup,
           "bf16, two short sequences" + at + ": the warpgroup kernel");
  }
  // Int content at 16 heads: the converting form below 16 sequences (int4 g64 below
  // fragments_min_batch), the fragment kernel from 32 (from 16 at long contexts, its three-block
  // form there), int g128 the tiled kernel from 16.
  expect(choose(int4, 1, 1, 16, false, false) == DecodeKernel::kTransposed &&
             choose(int4, 15, 1, 16, false, true) == DecodeKernel::kTransposed,
         "int4 g64 below 16 sequences: the converting form");
  expect(choose(int4, 16, 1, 16, false, false) == DecodeKernel::kTiled &&
             choose(int4, 32, 1, 16, false, false) == DecodeKernel::kFragments &&
             choose(int4, 16, 1, 16, false, true) == DecodeKernel::kFragmentsThreeBlocks,
         "int4 g64 from 16 sequences: the tiled, the fragment kernel and its three-block form");
  expect(choose(int4_g128, 15, 1, 16, false, false) == DecodeKernel::kTransposed &&
             choose(int4_g128, 16, 1, 16, false, false) == DecodeKernel::kTiled,
         "int4 g128: the converting form below 16 sequences, the tiled kernel from 16");
  expect(choose(int2, 1, 1, 16, false, false) == DecodeKernel::kFragments &&
             choose(int2, 64, 1, 16, false, true) == DecodeKernel::kFragmentsThreeBlocks,
         "int2 g64: the fragment kernel from one sequence, its three-block form from 64 long");
  // Quantized caches from 64 heads: the warpgroup kernel from two sequences or at long contexts.
  expect(choose(int4, 2, 1, 128, false, false) == DecodeKernel::kWarpgroup &&
             choose(int4, 1, 1, 64, false, true) == DecodeKernel::kWarpgroup &&
             choose(int4, 1, 1, 128, false, false) != DecodeKernel::kWarpgroup,
         "int4 from 64 heads: the warpgroup kernel from two sequences or at long contexts");
  expect(choose(int4, 2, 1, 128, true, false) == DecodeKernel::kFragments,
         "int4 at 128 heads, batch-invariant: the fragment kernel");
  return checked;
}

}  // namespace

int main() {
  check_fragment_maps();
  const int choices = check_kernel_choice();
  int cases = 0;
  for (const int heads : {16, 32, 48, 64, 128}) {
    for (const int s_q : {1, 2}) {
      for (const int sms : {1, 7, 132}) {
        for (const int per_split : {0, 1, 3, 64}) {
          const int per_sm = 1 + (per_split + sms) % 2;
          for (const std::vector<int32_t>& lens :
               {std::vector<int32_t>{2}, std::vector<int32_t>{64, 65, 2, 4096},
                std::vector<int32_t>(16, 32768), std::vector<int32_t>{262144, 3, 130},
                std::vector<int32_t>(128, 4096)}) {
            for (const int max_tiles : {1, 2, 4}) {
              check_schedule(lens, s_q, heads, sms, per_sm, per_split, max_tiles);
              ++cases;
            }
          }
        }
      }
    }
  }
  for (const int heads : {16, 32, 128}) {
    for (const int s_q : {1, 2, 8}) {
      for (const std::vector<int32_t>& lens :
           {std::vector<int32_t>{8}, std::vector<int32_t>{64, 65, 511, 513},
            std::vector<int32_t>{13316, 9, 130}, std::vector<int32_t>{262144}}) {
        check_invariant_schedule(lens, s_q, heads);
      }
    }
  }
  for (const auto& [pages, per_run] : std::vector<std::array<int64_t, 2>>{
           {1, 8}, {128, 8}, {129, 9}, {208, 13}, {209, 14}, {4096, 256}}) {
    expect(invariant_run_pages(pages) == per_run,
           "invariant_run_pages(" + std::to_string(pages) +
               ") = " + std::to_string(invariant_run_pages(pages)) + ", expected " +
               std::to_string(per_run));
  }
  // The capacity bound against random batches of random lengths (the worst cases are skewed).
  std::mt19937 rng(20261201);
  for (int trial = 0; trial < 3000; ++trial) {
    const int batch = 1 + static_cast<int>(rng() % 300);
    std::vector<int32_t> lens(static_cast<size_t>(batch));
    const int spread = 1 << (rng() % 19);
    for (auto& len : lens) len = 2 + static_cast<int32_t>(rng() % spread);
    if (trial % 3 == 0) lens[0] = 1 << 18;  // one long sequence among short ones
    const int sms = 1 + static_cast<int>(rng() % 140);
    check_schedule(lens, 1 + static_cast<int>(rng() % 2), 16 << (rng() % 3), sms,
                   1 + static_cast<int>(rng() % 3), 0, 1 << (rng() % 3));
    ++cases;
  }
  // The split rule (decode_schedule.h) on the shapes it was measured on: one sequence alone on
  // the H200 (132 SMs), and a share that binds first.
  for (const auto& [pages, share, runs] : std::vector<std::array<int64_t, 3>>{{1, 132, 1},
                                                                              {3, 132, 1},
                                                                              {16, 132, 8},
                                                                              {64, 132, 27},
                                                                              {256, 132, 55},
                                                                              {2048, 132, 132},
                                                                              {16, 8, 8},
                                                                              {1000, 1, 1}}) {
    expect(split_count(pages, share) == runs,
           "split_count(" + std::to_string(pages) + ", " + std::to_string(share) + ") = " +
               std::to_string(split_count(pages, share)) + ", expected " + std::to_string(runs));
  }
  // The blocks at once of a uniform batch against the plan's own (one 16-row tile a sequence).
  for (const int sms : {1, 16, 132}) {
    for (const int per_sm : {2, 3}) {
      for (const int64_t pages : {1, 2, 4, 257, 2048}) {
        for (int batch = 1; batch <= 3 * sms + 7; batch += 1 + batch / 16) {
          const DecodeSchedule schedule =
              plan_decode(std::vector<int32_t>(batch, static_cast<int32_t>(pages * kPageTokens)), 1,
                          16, sms, per_sm, 0, 1);
          const int64_t at_once =
              std::min<int64_t>(static_cast<int64_t>(schedule.items.size()), sms * per_sm);
          const int64_t blocks = uniform_blocks_at_once(batch, pages, sms, per_sm);
          expect(blocks == at_once, "uniform_blocks_at_once(" + std::to_string(batch) + ", " +
                                        std::to_string(pages) + ", " + std::to_string(sms) + " x " +
                                        std::to_string(per_sm) + ") = " + std::to_string(blocks) +
                                        ", the plan's " + std::to_string(at_once));
        }
      }
    }
  }
  // Where three blocks an SM keep more running than two can hold on 132 SMs: at least three runs
  // a tile up to 132 tiles, two up to 198 (more than 264 blocks), one each past 198, which fills
  // no more than two blocks an SM up to 264 tiles; the 128 x 2 tiles of s_q = 2 measured.
  for (const auto& [units, more] : std::vector<std::pair<int64_t, bool>>{{16, true},
                                                                         {132, true},
                                                                         {133, true},
                                                                         {198, true},
                                                                         {199, false},
                                                                         {256, false},
                                                                         {264, false},
                                                                         {265, true},
                                                                         {1024, true}}) {
    expect(more_blocks_fill_more(units, 132, 3, 2) == more,
           "more_blocks_fill_more(" + std::to_string(units) + " tiles, 132 SMs, 3, 2) = " +
               std::to_string(more_blocks_fill_more(units, 132, 3, 2)));
  }
  // The transposed kernel's 32-row blocks (s_q = 2 at 16 heads: two tiles a sequence): from 16
  // sequences at long contexts, or where the 16-row blocks outnumber the SMs.
  for (const auto& [batch, long_context, two] :
       std::initializer_list<std::tuple<int, bool, bool>>{{1, true, false},
                                                          {15, true, false},
                                                          {16, true, true},
                                                          {16, false, false},
                                                          {66, false, false},
                                                          {67, false, true},
                                                          {128, false, true}}) {
    expect(!transposed_two_tiles(batch, 1, long_context, 132) &&
               !transposed_two_tiles(batch, 3, long_context, 132),
           "transposed_two_tiles(" + std::to_string(batch) +
               " sequences of 1 or 3 tiles): not where the tiles come unpaired");
    expect(transposed_two_tiles(batch, 2, long_context, 132) == two,
           "transposed_two_tiles(" + std::to_string(batch) + " sequences of 2 tiles, " +
               (long_context ? "long" : "short") +
               ", 132 SMs) = " + std::to_string(transposed_two_tiles(batch, 2, long_context, 132)));
  }
  expect_invalid("heads not a multiple of 16", [] { plan_decode({100}, 1, 24, 132, 1, 0); });
  expect_invalid("no heads", [] { plan_decode({100}, 1, 0, 132, 1, 0); });
  expect_invalid("s_q 0", [] { plan_decode({100}, 0, 16, 132, 1, 0); });
  expect_invalid("sequence shorter than s_q", [] { plan_decode({100, 1}, 2, 16, 132, 1, 0); });
  expect_invalid("empty batch", [] { plan_decode({}, 1, 16, 132, 1, 0); });
  expect_invalid("no multiprocessors", [] { plan_decode({100}, 1, 16, 0, 1, 0); });
  expect_invalid("invariant: s_q 0", [] { plan_decode_invariant({100}, 0, 16); });
  expect_invalid("invariant: heads 24", [] { plan_decode_invariant({100}, 1, 24); });
  expect_invalid("invariant: sequence shorter than s_q", [] { plan_decode_invariant({1}, 2, 16); });
  // A batch-invariant plan's blocks follow the lengths, so it has no fixed grid (refused before
  // any device work).
  expect_invalid("batch-invariant plan with a fixed grid", [] {
    MlaDecodePlan(CacheFormat::parse("bf16"), {100}, 1, 16, MlaDecodeWorkspace{}, true, nullptr,
                  DecodeSplit::kBatchInvariant);
  });
  for (const char* spec : {"content=bf16,rope=bf16", "content=fp8,rope=bf16",
                           "content=int4:g64,rope=int4:g64", "content=int2:g128:clip0.8,rope=bf16",
                           "content=int4:g128,rope=int4:g64:bf16pairs=0+5+21+31"}) {
    try {
      check_gpu_format(CacheFormat::parse(spec));
    } catch (const Error& e) {
      expect(false, std::string(spec) + ": refused: " + e.what());
    }
  }
  for (const char* spec :
       {"content=q4_0,rope=bf16", "content=int4:g32,rope=bf16", "content=int8:g64,rope=bf16",
        "content=int4:g64,rope=int4:g32", "content=int4:g64,rope=int2:g64", "content=bf16,rope=fp8",
        "content=int4:g64,rope=int4:g64:bf16pairs=0+1+2+3+4", "content=f32,rope=f32"}) {
    expect_invalid(spec, [&] { check_gpu_format(CacheFormat::parse(spec)); });
  }
  std::printf("%d schedules and %d kernel choices checked, %d failures\n", cases, choices,
              failures);
  return failures == 0 ? 0 : 1;
}
