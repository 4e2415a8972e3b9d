// Byte-level BPE model: rank-ordered merging of each pre-token's bytes into vocabulary ids.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/string_map.h"

namespace quantmla::detail {

class BpeModel {
 public:
  // Builds from the "model" object of tokenizer.json. Throws FormatError for a model type other
  // than BPE, options this implementation does not honour, or merges outside the vocabulary.
  explicit BpeModel(const nlohmann::json& spec);

  // Appends the ids of one pre-token, given as raw bytes, to `out`. Thread-safe.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  // Vocabulary entries in their byte-level spelling (e.g. "Ġthe"), as tokenizer.json has them.
  const StringMap<int32_t>& vocab() const { return vocab_; }

 private:
  struct Merge {
    uint32_t rank;
    int32_t merged_id;
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  void load_vocab(const nlohmann::json& vocab);
  void load_merges(const nlohmann::json& merges);
  std::vector<int32_t> initial_symbols(std::string_view word) const;
  std::vector<int32_t> merge_word(std::string_view word) const;

  StringMap<int32_t> vocab_;
  std::array<int32_t, 256> byte_ids_{};  // id of each single byte's token, -1 when absent
  std::unordered_map<uint64_t, Merge> merges_;
  bool ignore_merges_ = false;
  std::optional<int32_t> unknown_id_;  // stands for bytes without a token, when configured
  bool fuse_unknown_ = false;

  // Words repeat a lot in text, so merge results are memoised. Bounded: once full, new words are
  // merged every time rather than evicting (the frequent words arrive early).
  static constexpr size_t kCacheCapacity = 1 << 16;
  static constexpr size_t kMaxCachedWordBytes = 64;
  mutable std::mutex cache_mutex_;
  mutable StringMap<std::vector<int32_t>> cache_;
};

}  // namespace quantmla::detail
