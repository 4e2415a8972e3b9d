// Host-side index math of the GPU runner's kernels, checked exhaustively without a GPU: the
// grouping of the routed experts into blocks (plan_expert_blocks, against every possible split)
// and the padded layout of the batched expert GEMMs, which puts every (token, choice) in its
// expert's block exactly once. Exit status 0 when every check passes.
#include <algorithm>
#include <bit>
#include <cstdio>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/moe_ops.h"
#include "quantmla/error.h"

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

// plan_expert_blocks against every split of the sorted counts into at most G runs (the host's
// index math, exhaustively on small cases): the fewest rows, blocks that hold each expert's
// count in expert order, every expert with rows in exactly one group.
void check_expert_blocks(std::mt19937_64& local) {
  int cases = 0, wrong = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int experts = 1 + static_cast<int>(local() % 9);
    const int groups = 1 + static_cast<int>(local() % 4);
    std::vector<int32_t> offsets(experts + 1, 0);
    for (int x = 0; x < experts; ++x) {
      const int count = local() % 4 == 0 ? 0 : static_cast<int>(local() % 70);
      offsets[x + 1] = offsets[x] + count;
    }
    const gpu::ExpertBlocks plan = gpu::plan_expert_blocks(offsets.data(), experts, groups);
    std::vector<int64_t> sorted;
    for (int x = 0; x < experts; ++x) {
      if (offsets[x + 1] > offsets[x]) sorted.push_back(offsets[x + 1] - offsets[x]);
    }
    std::sort(sorted.rbegin(), sorted.rend());
    const auto pad = [](int64_t r) { return (r + 15) / 16 * 16; };
    // Brute force: every set of cut points (bit i: a run starts at sorted[i + 1]).
    int64_t fewest = sorted.empty() ? 0 : std::numeric_limits<int64_t>::max();
    const int m = static_cast<int>(sorted.size());
    for (uint32_t cuts = 0; m > 0 && cuts < (1u << (m - 1)); ++cuts) {
      if (std::popcount(cuts) + 1 > groups) continue;
      int64_t rows = 0, run_rows = pad(sorted[0]);
      for (int i = 0; i < m; ++i) {
        if (i > 0 && (cuts >> (i - 1) & 1)) run_rows = pad(sorted[i]);
        rows += run_rows;
      }
      fewest = std::min(fewest, rows);
    }
    bool ok = plan.block_start.size() == static_cast<size_t>(experts) + 1 &&
              plan.block_start[0] == 0 && plan.block_start[experts] == fewest &&
              static_cast<int>(plan.groups.size()) <= groups;
    std::vector<int> seen(experts, 0);
    for (const gpu::ExpertGroup& g : plan.groups) {
      for (int32_t x : g.experts) {
        ++seen[x];
        ok = ok && plan.block_start[x + 1] - plan.block_start[x] == g.rows &&
             g.rows >= offsets[x + 1] - offsets[x] && g.rows % 16 == 0;
      }
    }
    for (int x = 0; ok && x < experts; ++x) {
      const bool has_rows = offsets[x + 1] > offsets[x];
      ok = seen[x] == (has_rows ? 1 : 0) &&
           (has_rows || plan.block_start[x + 1] == plan.block_start[x]);
    }
    ++cases;
    wrong += ok ? 0 : 1;
  }
  expect(wrong == 0, "plan_expert_blocks: the fewest rows and consistent blocks in " +
                         std::to_string(cases) + " random cases (" + std::to_string(wrong) +
                         " wrong)");
  const std::vector<int32_t> bad = {0, 5, 3};
  for (const auto& [what, groups, experts] :
       {std::tuple{"offsets not a prefix sum", 4, 2}, std::tuple{"0 groups", 0, 1}}) {
    bool refused = false;
    try {
      gpu::plan_expert_blocks(bad.data(), experts, groups);
    } catch (const InvalidArgument&) {
      refused = true;
    }
    expect(refused, std::string("plan_expert_blocks refuses ") + what);
  }
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
    // One block size for all (the busiest count, rounded up) and the runner's planned groups.
    std::vector<int32_t> uniform(static_cast<size_t>(num_experts) + 1);
    for (int x = 0; x <= num_experts; ++x) uniform[x] = static_cast<int32_t>(x * rows);
    const std::vector<int32_t> planned =
        gpu::plan_expert_blocks(s.offsets.data(), num_experts, 4).block_start;
    for (const bool use_plan : {false, true}) {
      const std::vector<int32_t>& blocks = use_plan ? planned : uniform;
      std::vector<int32_t> token_of_row, slot_of = s.slot_of;
      gpu::pad_expert_layout(s.offsets.data(), num_experts, s.token_of_slot.data(), blocks,
                             token_of_row, slot_of);
      const std::string name = "E " + std::to_string(num_experts) + " k " + std::to_string(k) +
                               " n " + std::to_string(n) +
                               (use_plan ? " planned" : " rows " + std::to_string(rows));
      expect(token_of_row.size() == static_cast<size_t>(blocks[num_experts]), name + ": row count");
      std::set<int32_t> used;
      bool placed = true;
      for (size_t i = 0; i < experts.size(); ++i) {
        const int32_t e = experts[i], row = slot_of[i];
        if (e < 0) {
          placed = placed && row == -1;
          continue;
        }
        placed = placed && row >= blocks[e] &&
                 row < blocks[e] + (s.offsets[e + 1] - s.offsets[e]) &&
                 token_of_row[static_cast<size_t>(row)] == static_cast<int32_t>(i / k) &&
                 used.insert(row).second;
      }
      expect(placed, name + ": every entry in its expert's block, once, gathering its token");
      int64_t padding = 0;
      for (size_t r = 0; r < token_of_row.size(); ++r) {
        if (!used.count(static_cast<int32_t>(r))) padding += token_of_row[r] == -1;
      }
      expect(padding + static_cast<int64_t>(used.size()) == blocks[num_experts],
             name + ": the other rows are padding");
    }
    if (busiest > 1) {
      bool refused = false;
      try {
        std::vector<int32_t> small(static_cast<size_t>(num_experts) + 1), token_of_row,
            slot_of = s.slot_of;
        for (int x = 0; x <= num_experts; ++x) small[x] = static_cast<int32_t>(x * (busiest - 1));
        gpu::pad_expert_layout(s.offsets.data(), num_experts, s.token_of_slot.data(), small,
                               token_of_row, slot_of);
      } catch (const InvalidArgument&) {
        refused = true;
      }
      expect(refused, "E " + std::to_string(num_experts) + " n " + std::to_string(n) +
                          ": blocks smaller than the busiest expert's count are refused");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t seed =
      argc > 2 && std::string(argv[1]) == "--seed" ? std::stoull(argv[2]) : std::random_device{}();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  check_expert_blocks(rng);
  check_expert_layout(rng);
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
