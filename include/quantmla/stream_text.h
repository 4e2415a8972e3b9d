// The text a client sees of a request's generated tokens while they stream: special tokens and
// ids the tokenizer does not know skipped, invalid UTF-8 repaired as Hugging Face's decode does,
// cut before the first stop string; while more tokens may come, an unfinished character and
// whatever could be the start of a stop string are held back. Updates cost time in the new tokens
// only (a long generation stays linear), and the visible text only ever grows: each update's is a
// prefix of the next one's and of the final text.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "quantmla/tokenizer.h"

namespace quantmla {

class StreamText {
 public:
  StreamText(const Tokenizer& tokenizer, std::vector<std::string> stop);

  // Takes the request's tokens from where the last call left off (`tokens` is the whole list so
  // far). `complete`: no more tokens will come, so nothing is held back.
  void update(std::span<const int32_t> tokens, bool complete);

  const std::string& text() const { return visible_; }
  bool stopped() const { return stopped_; }  // a stop string was found (text ends before it)

 private:
  const Tokenizer& tokenizer_;
  std::vector<std::string> stop_;
  size_t longest_stop_ = 0;
  size_t seen_tokens_ = 0;
  std::string committed_;  // repaired text of every complete character so far
  std::string pending_;    // raw bytes of a character still unfinished
  size_t searched_ = 0;    // bytes of committed_ already searched for stop strings
  std::string visible_;
  bool stopped_ = false;
};

}  // namespace quantmla
