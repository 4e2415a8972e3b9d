// PCRE2 (JIT) regular expressions standing in for the Oniguruma ones of Hugging Face tokenizers.
#pragma once

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace quantmla::detail {

class Regex {
 public:
  enum class Syntax { kOniguruma, kLiteral };

  // Compiles with Unicode semantics (UTF + UCP) and JIT. Throws FormatError naming `component`
  // when the pattern does not compile.
  Regex(std::string_view pattern, Syntax syntax, std::string_view component);

  // Splits every piece of `pieces` the way Split(behavior = Isolated) does: each match and each
  // gap between matches becomes a piece of `out`, empty ones dropped. Pieces are valid UTF-8.
  void split_isolated(const std::vector<std::string_view>& pieces,
                      std::vector<std::string_view>& out) const;

  // Whether the pattern matches at exactly `offset` of valid UTF-8 `text`.
  bool matches_at(std::string_view text, size_t offset) const;

 private:
  struct CodeDeleter {
    void operator()(pcre2_code* code) const { pcre2_code_free(code); }
  };
  std::unique_ptr<pcre2_code, CodeDeleter> code_;
  std::string pattern_;  // as written in tokenizer.json, for error messages
};

// Rewrites an Oniguruma pattern into the PCRE2 pattern with the same meaning. The syntaxes agree
// except that PCRE2 counts U+180E MONGOLIAN VOWEL SEPARATOR as \s, so \s and \S outside a class,
// and \s inside one, are spelled out as Oniguruma's set (Unicode White_Space).
std::string oniguruma_to_pcre2(std::string_view pattern);

}  // namespace quantmla::detail
