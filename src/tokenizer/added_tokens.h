// Added tokens: strings (mostly special tokens) cut out of the raw text before pre-tokenization
// and mapped straight to their ids.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/regex.h"

namespace quantmla::detail {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;  // match only when not inside a word
  bool lstrip = false;       // the match swallows whitespace on its left
  bool rstrip = false;       // ... and on its right
  bool normalized = false;   // matched against normalized text (a second pass)
  bool special = false;      // dropped by decode(skip_special)
};

struct TextSegment {
  std::string_view text;
  std::optional<int32_t> added_token_id;  // empty: plain text, still to pre-tokenize
};

class AddedTokenMatcher {
 public:
  explicit AddedTokenMatcher(const std::vector<AddedToken>& tokens);

  // Cuts `text` (valid UTF-8) into added tokens and the plain text between them. Like Hugging
  // Face, tokens with normalized=false are matched first over the whole text, then tokens with
  // normalized=true inside the remaining plain text; each pass takes the leftmost, then longest,
  // match and resumes after it.
  std::vector<TextSegment> split(std::string_view text) const;

 private:
  // Byte trie over token contents, for longest-match lookups.
  class Trie {
   public:
    Trie();
    void insert(std::string_view key, int32_t token_index);
    bool empty() const { return node_token_.size() == 1; }
    bool may_start_with(char byte) const { return first_bytes_[static_cast<uint8_t>(byte)]; }
    // The longest key starting at `pos`: (length, token index).
    std::optional<std::pair<size_t, int32_t>> longest_match(std::string_view text,
                                                            size_t pos) const;

   private:
    static uint64_t edge_key(int32_t node, char byte) {
      return (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(byte);
    }
    std::vector<int32_t> node_token_;  // token index ending at each node, -1 for none
    std::unordered_map<uint64_t, int32_t> edges_;
    std::array<bool, 256> first_bytes_{};
  };

  void split_pass(const Trie& trie, std::string_view text, std::vector<TextSegment>& out) const;
  // Whether the character starting at `char_start` is a word character for single_word.
  bool is_word_character_at(std::string_view text, size_t char_start) const;

  std::vector<AddedToken> tokens_;
  Trie raw_tokens_;
  Trie normalized_tokens_;
  // Rust regex's \w, which Hugging Face uses for single_word; compiled only when needed.
  std::optional<Regex> word_character_;
};

}  // namespace quantmla::detail
