#include "tokenizer/added_tokens.h"

#include "tokenizer/utf8.h"

namespace quantmla::detail {

AddedTokenMatcher::Trie::Trie() : node_token_{-1} {}

void AddedTokenMatcher::Trie::insert(std::string_view key, int32_t token_index) {
  first_bytes_[static_cast<uint8_t>(key.front())] = true;
  int32_t node = 0;
  for (const char byte : key) {
    const auto [it, inserted] =
        edges_.try_emplace(edge_key(node, byte), static_cast<int32_t>(node_token_.size()));
    if (inserted) node_token_.push_back(-1);
    node = it->second;
  }
  node_token_[node] = token_index;
}

std::optional<std::pair<size_t, int32_t>> AddedTokenMatcher::Trie::longest_match(
    std::string_view text, size_t pos) const {
  std::optional<std::pair<size_t, int32_t>> best;
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto it = edges_.find(edge_key(node, text[i]));
    if (it == edges_.end()) break;
    node = it->second;
    if (node_token_[node] >= 0) best.emplace(i + 1 - pos, node_token_[node]);
  }
  return best;
}

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedToken>& tokens) : tokens_(tokens) {
  bool any_single_word = false;
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const AddedToken& token = tokens_[i];
    if (token.content.empty()) continue;  // an empty string cannot be cut out of text
    (token.normalized ? normalized_tokens_ : raw_tokens_)
        .insert(token.content, static_cast<int32_t>(i));
    any_single_word |= token.single_word;
  }
  if (any_single_word) {
    word_character_.emplace(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])",
                            Regex::Syntax::kOniguruma, "added_tokens single_word");
  }
}

std::vector<TextSegment> AddedTokenMatcher::split(std::string_view text) const {
  std::vector<TextSegment> raw_pass;
  split_pass(raw_tokens_, text, raw_pass);
  if (normalized_tokens_.empty()) return raw_pass;
  std::vector<TextSegment> segments;
  for (const TextSegment& segment : raw_pass) {
    if (segment.added_token_id) {
      segments.push_back(segment);
    } else {
      split_pass(normalized_tokens_, segment.text, segments);
    }
  }
  return segments;
}

void AddedTokenMatcher::split_pass(const Trie& trie, std::string_view text,
                                   std::vector<TextSegment>& out) const {
  size_t plain_start = 0;  // start of the plain text not yet emitted
  size_t pos = 0;
  while (!trie.empty() && pos < text.size()) {
    if (!trie.may_start_with(text[pos])) {
      ++pos;
      continue;
    }
    const auto match = trie.longest_match(text, pos);
    if (!match) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens_[match->second];
    size_t start = pos;
    size_t stop = pos + match->first;
    // Scanning resumes after a match even when single_word rejects it, as Aho-Corasick does.
    pos = stop;
    if (token.single_word) {
      const bool word_before =
          start > 0 && is_word_character_at(text, char_start_before(text, start));
      const bool word_after = stop < text.size() && is_word_character_at(text, stop);
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      while (start > plain_start) {
        const size_t char_start = char_start_before(text, start);
        size_t after = char_start;
        if (!is_unicode_whitespace(next_code_point(text, after))) break;
        start = char_start;
      }
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t after = stop;
        if (!is_unicode_whitespace(next_code_point(text, after))) break;
        stop = after;
      }
      pos = stop;
    }
    if (start > plain_start) out.push_back({text.substr(plain_start, start - plain_start), {}});
    out.push_back({text.substr(start, stop - start), token.id});
    plain_start = stop;
  }
  if (plain_start < text.size()) out.push_back({text.substr(plain_start), {}});
}

bool AddedTokenMatcher::is_word_character_at(std::string_view text, size_t char_start) const {
  return word_character_->matches_at(text, char_start);
}

}  // namespace quantmla::detail
