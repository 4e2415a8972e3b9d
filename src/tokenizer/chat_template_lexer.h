// Chat template source to tokens, with jinja2's whitespace rules as transformers configures them
// already applied to the text between tags: trim_blocks (the newline after a block or comment tag
// goes), lstrip_blocks (spaces before a block or comment tag at the start of a line go), the
// "-" markers ({%- -%} {{- -}} {#- -#}: all whitespace on that side goes) and "+" ({%+ +%}: keep).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace quantmla::detail::jinja {

enum class TokenType {
  kText,           // template text between tags (value: the text, whitespace rules applied)
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kName,           // identifier or keyword (value: the name)
  kString,         // string literal (value: the decoded string)
  kInteger,        // value: the digits, underscores removed
  kFloat,          // value: the literal, underscores removed
  kOperator,       // value: the operator ("+", "//", "==", "(", ...)
  kEnd,            // end of the template
};

struct Token {
  TokenType type;
  std::string value;
  size_t offset = 0;  // in the normalized source, for error positions
};

// Line and column (1-based, columns in characters) of offsets in a source.
class SourcePositions {
 public:
  explicit SourcePositions(std::string_view source);
  // "line L, column C".
  std::string describe(size_t offset) const;
  int line(size_t offset) const;

 private:
  std::string_view source_;
  std::vector<size_t> line_starts_;
};

// jinja2 reads a template with its newlines normalized to "\n" and one trailing newline dropped
// (keep_trailing_newline=False).
std::string normalize_template_source(std::string_view source);

// Tokens of a normalized source, ending with kEnd. Throws FormatError (with the position) for an
// unclosed tag, comment or string, or a character that starts no token.
std::vector<Token> tokenize_template(std::string_view source, const SourcePositions& positions);

// A token as jinja2's messages name it: "end of statement block", "'x'", "end of template".
std::string describe_token(const Token& token);

}  // namespace quantmla::detail::jinja
