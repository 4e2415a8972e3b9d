// Pre-tokenization: the regex splits that cut text into the words BPE merges independently.
#pragma once

#include <nlohmann/json.hpp>
#include <string_view>
#include <vector>

#include "tokenizer/regex.h"

namespace quantmla::detail {

class PreTokenizer {
 public:
  // Accepts ByteLevel, or a Sequence of Split(Isolated) steps ending with ByteLevel. The
  // byte-level mapping itself is left to BPE, which works on raw bytes; ByteLevel only adds
  // its GPT-2 split when use_regex is true. Throws FormatError for anything else.
  explicit PreTokenizer(const nlohmann::json& spec);

  // Appends the pre-tokens of `text` (valid UTF-8), as views into it, to `out`.
  void split(std::string_view text, std::vector<std::string_view>& out) const;

 private:
  void add_byte_level(const nlohmann::json& spec, std::string_view where);
  void add_split(const nlohmann::json& spec, std::string_view where);

  std::vector<Regex> stages_;  // applied in order, each to every piece of the previous one
};

}  // namespace quantmla::detail
