// Host-side index math of the GPU runner's kernels, checked exhaustively without a GPU: the
// padded layout of the batched expert GEMMs puts every (token, choice) in its expert's block
// exactly once, and moe_sort's scan cuts every expert's column of chunk counts into runs that
// cover it once, in order; the warpgroup decode kernel reads a page's tensor-map boxes as its
// values through the MN-major operand layout; and an operand descriptor stepped by an offset is
// the one made at the offset's address. Exit status 0 when every check passes.
#include <algorithm>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/moe_ops.h"
#include "kernels/cuda/sort_scan_runs.h"
#include "kernels/cuda/swizzle_layouts.h"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"

namespace {

using namespace quantmla;

int failures = 0, checks = 0;

void expect(bool ok, const std::string& what) {
  ++checks;
  if (!ok && failures++ < 20) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
}

// moe_sort's outputs, as its stable counting sort defines them.
struct Sorted {
  std::vector<int32_t> offsets, slot_of, token_of_slot;
};
Sorted sort_entries(const std::vector<int32_t>& experts, int k, int num_experts) {
  Sorted s;
  s.offsets.assign(static_cast<size_t>(num_experts) + 1, 0);
  for (const int32_t e : experts) {
    if (e >= 0 && e < num_experts) ++s.offsets[static_cast<size_t>(e) + 1];
  }
  for (int e = 0; e < num_experts; ++e) s.offsets[e + 1] += s.offsets[e];
  std::vector<int32_t> next(s.offsets.begin(), s.offsets.end() - 1);
  s.slot_of.assign(experts.size(), -1);
  s.token_of_slot.assign(static_cast<size_t>(s.offsets.back()), -1);
  for (size_t i = 0; i < experts.size(); ++i) {
    const int32_t e = experts[i];
    if (e < 0 || e >= num_experts) continue;
    s.slot_of[i] = next[static_cast<size_t>(e)]++;
    s.token_of_slot[static_cast<size_t>(s.slot_of[i])] = static_cast<int32_t>(i / k);
  }
  return s;
}

void check_expert_layout(std::mt19937_64& rng) {
  for (int trial = 0; trial < 300; ++trial) {
    const int num_experts = std::uniform_int_distribution<int>(1, 64)(rng);
    const int k = std::uniform_int_distribution<int>(1, std::min(8, num_experts))(rng);
    const int64_t n = std::uniform_int_distribution<int64_t>(1, 500)(rng);
    std::vector<int32_t> experts(static_cast<size_t>(n * k));
    const bool skewed = trial % 3 == 0;
    for (int32_t& e : experts) {
      e = std::uniform_int_distribution<int32_t>(0, num_experts - 1)(rng);
      if (skewed && e % 2 == 1) e = 0;
      if (trial % 5 == 0 && rng() % 50 == 0) e = -1;  // an entry without an expert
    }
    const Sorted s = sort_entries(experts, k, num_experts);
    int64_t busiest = 0;
    for (int e = 0; e < num_experts; ++e) {
      busiest = std::max<int64_t>(busiest, s.offsets[e + 1] - s.offsets[e]);
    }
    const int64_t rows = std::max<int64_t>((busiest + 15) / 16 * 16, 1);
    std::vector<int32_t> token_of_row, slot_of = s.slot_of;
    gpu::pad_expert_layout(s.offsets.data(), num_experts, s.token_of_slot.data(), rows,
                           token_of_row, slot_of);
    const std::string name = "E " + std::to_string(num_experts) + " k " + std::to_string(k) +
                             " n " + std::to_string(n) + " rows " + std::to_string(rows);
    expect(token_of_row.size() == static_cast<size_t>(num_experts * rows), name + ": row count");
    std::set<int32_t> used;
    bool placed = true;
    for (size_t i = 0; i < experts.size(); ++i) {
      const int32_t e = experts[i], row = slot_of[i];
      if (e < 0) {
        placed = placed && row == -1;
        continue;
      }
      placed = placed && row >= e * rows && row < e * rows + (s.offsets[e + 1] - s.offsets[e]) &&
               token_of_row[static_cast<size_t>(row)] == static_cast<int32_t>(i / k) &&
               used.insert(row).second;
    }
    expect(placed, name + ": every entry in its expert's block, once, gathering its token");
    int64_t padding = 0;
    for (size_t r = 0; r < token_of_row.size(); ++r) {
      if (!used.count(static_cast<int32_t>(r))) padding += token_of_row[r] == -1;
    }
    expect(padding + static_cast<int64_t>(used.size()) == num_experts * rows,
           name + ": the other rows are padding");
    if (busiest > 1) {
      bool refused = false;
      try {
        gpu::pad_expert_layout(s.offsets.data(), num_experts, s.token_of_slot.data(), busiest - 1,
                               token_of_row, slot_of);
      } catch (const InvalidArgument&) {
        refused = true;
      }
      expect(refused, name + ": fewer rows than the busiest expert's count are refused");
    }
  }
}

// The scan's runs (sort_scan_runs.h), over every thread of its block: each expert's runs, taken
// in the order of their parts (the order their sums are prefixed in), are its chunks 0 ..
// chunks - 1 exactly once, and the parts of an expert are 0 .. scan_parts - 1, once each.
void check_scan_runs() {
  for (const int num_experts : {1, 2, 3, 6, 16, 64, 100, 160, 256, 1000, 1023, 1024, 1025, 4096}) {
    for (const int64_t chunks : {0, 1, 2, 3, 15, 16, 17, 48, 100, 192, 1025, 4096}) {
      const int parts = gpu::scan_parts(num_experts);
      std::vector<std::vector<gpu::ScanRun>> runs(static_cast<size_t>(num_experts));
      for (int t = 0; t < gpu::kScanThreads; ++t) {
        const gpu::ScanRun run = gpu::scan_run(t, num_experts, chunks);
        if (run.part < 0) continue;
        for (int e = run.first_expert; e < num_experts; e += gpu::kScanThreads) {
          runs[static_cast<size_t>(e)].push_back(run);
        }
      }
      bool in_order = true;
      for (auto& column : runs) {
        std::sort(column.begin(), column.end(),
                  [](const auto& a, const auto& b) { return a.part < b.part; });
        int64_t next = 0;
        in_order = in_order && static_cast<int>(column.size()) == parts;
        for (size_t q = 0; q < column.size(); ++q) {
          in_order = in_order && column[q].part == static_cast<int>(q) &&
                     column[q].first_chunk == next && column[q].end_chunk >= next;
          next = column[q].end_chunk;
        }
        in_order = in_order && next == chunks;
      }
      expect(in_order, "scan runs, E " + std::to_string(num_experts) + ", " +
                           std::to_string(chunks) + " chunks: each column once, in order");
    }
  }
}

}  // namespace

// The warpgroup decode kernel (decode_warpgroup.cu) copies a page of 64 records as nine boxes of
// 64 channels, 8 KB apart, and reads channels [256 w, 256 w + 256) of keys [16 k, 16 k + 16) as
// the B operand of O += P V from box 4 w, byte 16 k x 128, with an MN-major descriptor whose
// column blocks are 8 KB apart: every (key, channel) of the operand must be the copy's byte.
void check_values_operand() {
  constexpr uint32_t kBoxBytes = 64 * 128;
  std::set<uint32_t> seen;
  for (int w = 0; w < 2; ++w) {
    for (int k = 0; k < 4; ++k) {
      const uint32_t start = 4 * w * kBoxBytes + 16 * k * 128;
      for (int key = 0; key < 16; ++key) {
        for (int n = 0; n < 256; ++n) {
          const int channel = 256 * w + n, record = 16 * k + key;
          const uint32_t copied =
              (channel / 64) * kBoxBytes + gpu::tma_box_offset(record, channel % 64);
          const uint32_t operand = start + gpu::mn_major_offset(key, n, kBoxBytes);
          expect(operand == copied,
                 "values operand w " + std::to_string(w) + " k-step " + std::to_string(k) +
                     " key " + std::to_string(key) + " channel " + std::to_string(n) + ": byte " +
                     std::to_string(operand) + ", copied to " + std::to_string(copied));
          seen.insert(copied);
        }
      }
    }
  }
  expect(seen.size() == 64u * 512u, "the operands cover the page's 512 content channels once");
}

// The kernels make an operand's descriptor once and step it a k-step at a time (descriptor_at):
// for every 16-byte-aligned shared address and every offset that stays below 2^18 (a block's
// shared memory, 227 KB, lies there), the stepped descriptor must be the one made anew at the
// offset's address, for both operand layouts (the MN-major one with the decode kernels' 8 KB
// column blocks in its leading-offset field, which the step must not touch). Counted as one check
// a layout, each failure reported.
void check_descriptor_steps() {
  constexpr uint32_t kLimit = 1u << 18;
  for (const bool mn_major : {false, true}) {
    const auto made = [&](uint32_t address) {
      return mn_major ? gpu::wgmma_descriptor_mn(address, 64 * 128)
                      : gpu::wgmma_descriptor(address);
    };
    bool all = true;
    for (uint32_t address = 0; address < kLimit; address += 16) {
      const uint64_t base = made(address);
      for (uint32_t bytes = 0; address + bytes < kLimit; bytes += 16) {
        if (gpu::descriptor_at(base, bytes) == made(address + bytes)) continue;
        all = false;
        expect(false, std::string(mn_major ? "MN-major" : "K-major") + " descriptor at " +
                          std::to_string(address) + " stepped by " + std::to_string(bytes) +
                          " bytes differs from the one made at " + std::to_string(address + bytes));
      }
    }
    if (all) expect(true, "");
  }
}

// The plan's kernel choice (and a captured decode step's graph key) turns on the longest sequence
// holding more than kLongContextPages pages: 16,384 tokens fill 256 pages exactly, one more
// token opens the 257th.
void check_long_context() {
  const int32_t edge = gpu::kLongContextPages * gpu::kPageTokens;
  const std::vector<std::pair<std::vector<int32_t>, bool>> cases = {
      {{}, false},        {{1}, false},        {{edge}, false},
      {{edge + 1}, true}, {{5, edge}, false},  {{5, edge + 1, 7}, true},
      {{131072}, true},   {{edge - 63}, false}};
  for (const auto& [lens, expected] : cases) {
    std::string shown;
    for (const int32_t len : lens) shown += std::to_string(len) + " ";
    expect(gpu::decode_long_context(lens) == expected,
           "decode_long_context(" + shown + ") should be " + (expected ? "true" : "false"));
  }
}

int main(int argc, char** argv) {
  const uint64_t seed =
      argc > 2 && std::string(argv[1]) == "--seed" ? std::stoull(argv[2]) : std::random_device{}();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  check_expert_layout(rng);
  check_scan_runs();
  check_values_operand();
  check_descriptor_steps();
  check_long_context();
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
