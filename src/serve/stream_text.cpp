#include "quantmla/stream_text.h"

#include <algorithm>

#include "tokenizer/utf8.h"

namespace quantmla {

StreamText::StreamText(const Tokenizer& tokenizer, std::vector<std::string> stop)
    : tokenizer_(tokenizer), stop_(std::move(stop)) {
  for (const std::string& s : stop_) longest_stop_ = std::max(longest_stop_, s.size());
}

void StreamText::update(std::span<const int32_t> tokens, bool complete) {
  if (stopped_) return;
  for (size_t i = seen_tokens_; i < tokens.size(); ++i) {
    const int32_t id = tokens[i];
    if (tokenizer_.knows(id) && !tokenizer_.is_special(id)) pending_ += tokenizer_.token_bytes(id);
  }
  seen_tokens_ = std::max(seen_tokens_, tokens.size());
  // Characters split between tokens are repaired only once whole: repairing the complete prefix
  // alone gives the same text as repairing everything at the end.
  const size_t whole = complete ? pending_.size() : detail::complete_utf8_prefix(pending_);
  committed_ += detail::repair_utf8(std::string_view(pending_).substr(0, whole));
  pending_.erase(0, whole);
  // A stop string may straddle the bytes searched before and the new ones.
  const size_t from = searched_ - std::min(searched_, longest_stop_ > 0 ? longest_stop_ - 1 : 0);
  size_t cut = std::string::npos;
  for (const std::string& s : stop_) {
    if (!s.empty()) cut = std::min(cut, committed_.find(s, from));
  }
  searched_ = committed_.size();
  if (cut != std::string::npos) {
    committed_.resize(cut);
    visible_ = committed_;
    stopped_ = true;
    return;
  }
  size_t shown = committed_.size();
  if (!complete && longest_stop_ > 1) {
    // Hold back what could be the start of a stop string, and never split a character.
    shown -= std::min(shown, longest_stop_ - 1);
    shown = detail::complete_utf8_prefix(committed_.substr(0, shown));
  }
  visible_.assign(committed_, 0, std::max(shown, visible_.size()));
}

}  // namespace quantmla
