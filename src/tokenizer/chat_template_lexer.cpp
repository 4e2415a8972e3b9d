#include "tokenizer/chat_template_lexer.h"

#include <algorithm>
#include <array>
#include <cctype>

#include "quantmla/error.h"
#include "tokenizer/chat_template_text.h"
#include "tokenizer/utf8.h"

namespace quantmla::detail::jinja {

SourcePositions::SourcePositions(std::string_view source) : source_(source) {
  line_starts_.push_back(0);
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\n') line_starts_.push_back(i + 1);
  }
}

int SourcePositions::line(size_t offset) const {
  return static_cast<int>(std::upper_bound(line_starts_.begin(), line_starts_.end(), offset) -
                          line_starts_.begin());
}

std::string SourcePositions::describe(size_t offset) const {
  offset = std::min(offset, source_.size());
  const int line_number = line(offset);
  const size_t start = line_starts_[static_cast<size_t>(line_number - 1)];
  const size_t column = code_point_count(source_.substr(start, offset - start)) + 1;
  return "line " + std::to_string(line_number) + ", column " + std::to_string(column);
}

std::string normalize_template_source(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] != '\r') {
      out.push_back(source[i]);
    } else {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

std::string describe_token(const Token& token) {
  switch (token.type) {
    case TokenType::kText:
      return "template data";
    case TokenType::kBlockBegin:
      return "begin of statement block";
    case TokenType::kBlockEnd:
      return "end of statement block";
    case TokenType::kVariableBegin:
      return "begin of print statement";
    case TokenType::kVariableEnd:
      return "end of print statement";
    case TokenType::kString:
      return "string";
    case TokenType::kInteger:
      return "integer";
    case TokenType::kFloat:
      return "float";
    case TokenType::kEnd:
      return "end of template";
    case TokenType::kName:
    case TokenType::kOperator:
      return "'" + token.value + "'";
  }
  return "token";
}

namespace {

// Operators, longest first so "//" wins over "/".
constexpr std::array<std::string_view, 24> kOperators = {
    "**", "//", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~",
    "[",  "]",  "(",  ")",  "{",  "}",  ">", "<", "=", ".", ":", "|"};

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

class Lexer {
 public:
  Lexer(std::string_view source, const SourcePositions& positions)
      : source_(source), positions_(positions) {}

  std::vector<Token> run() {
    bool line_starting = true;  // the previous tag ended a line (or nothing came before)
    size_t pos = 0;
    while (true) {
      const size_t tag = find_tag_start(pos);
      if (tag == std::string_view::npos) {
        emit_text(std::string(source_.substr(pos)), pos);
        break;
      }
      std::string text(source_.substr(pos, tag - pos));
      const char kind = source_[tag + 1];
      const char marker = tag + 2 < source_.size() ? source_[tag + 2] : '\0';
      const bool has_marker = marker == '-' || marker == '+';
      if (marker == '-') {
        text = strip(text, std::nullopt, false, true);
      } else if (marker != '+' && kind != '{') {
        lstrip_line(text, line_starting);
      }
      emit_text(std::move(text), pos);
      const size_t inner = tag + 2 + (has_marker ? 1 : 0);
      if (kind == '#') {
        pos = skip_comment(tag, inner, line_starting);
      } else {
        pos = lex_tag(tag, inner, kind == '%', line_starting);
      }
    }
    tokens_.push_back(Token{TokenType::kEnd, "", source_.size()});
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail(size_t offset, const std::string& what) const {
    throw FormatError("chat template " + positions_.describe(offset) + ": " + what);
  }

  size_t find_tag_start(size_t pos) const {
    for (size_t i = source_.find('{', pos); i != std::string_view::npos;
         i = source_.find('{', i + 1)) {
      if (i + 1 < source_.size() &&
          (source_[i + 1] == '{' || source_[i + 1] == '%' || source_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string_view::npos;
  }

  void emit_text(std::string text, size_t offset) {
    if (!text.empty()) tokens_.push_back(Token{TokenType::kText, std::move(text), offset});
  }

  // lstrip_blocks: whitespace between the start of the line and a block or comment tag goes. A
  // text without a newline is at a line start only if the previous tag ended one.
  static void lstrip_line(std::string& text, bool line_starting) {
    const size_t line_start = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
    if (line_start == 0 && !line_starting) return;
    const std::u32string tail = decode_utf8(std::string_view(text).substr(line_start));
    if (tail.empty() || !std::all_of(tail.begin(), tail.end(), is_python_space)) return;
    text.erase(line_start);
  }

  // After a tag's closing delimiter at `pos`: "-" swallows all following whitespace, trim_blocks
  // one newline after a block or comment tag, "+" nothing. Returns where the text resumes.
  size_t after_tag_end(size_t pos, char marker, bool block_like, bool& line_starting) const {
    const size_t before = pos;
    if (marker == '-') {
      while (pos < source_.size()) {
        size_t next = pos;
        if (!is_python_space(next_code_point(source_, next))) break;
        pos = next;
      }
    } else if (marker != '+' && block_like && pos < source_.size() && source_[pos] == '\n') {
      ++pos;
    }
    line_starting = pos > before && source_[pos - 1] == '\n';
    return pos;
  }

  size_t skip_comment(size_t tag, size_t inner, bool& line_starting) {
    const size_t end = source_.find("#}", inner);
    if (end == std::string_view::npos) fail(tag, "missing end of comment tag '#}'");
    char marker = '\0';
    if (end > inner && (source_[end - 1] == '-' || source_[end - 1] == '+')) {
      marker = source_[end - 1];
    }
    return after_tag_end(end + 2, marker, true, line_starting);
  }

  // The expression tokens of a {% %} or {{ }} tag; returns the offset after its end.
  size_t lex_tag(size_t tag, size_t pos, bool block, bool& line_starting) {
    tokens_.push_back(Token{block ? TokenType::kBlockBegin : TokenType::kVariableBegin, "", tag});
    const std::string_view close = block ? "%}" : "}}";
    std::vector<char> open_brackets;  // the end delimiter only counts outside brackets
    while (true) {
      while (pos < source_.size()) {
        size_t next = pos;
        if (!is_python_space(next_code_point(source_, next))) break;
        pos = next;
      }
      if (pos >= source_.size()) {
        fail(tag, std::string("unexpected end of template, expected '") + std::string(close) +
                      "' to close the tag opened here");
      }
      const std::string_view rest = source_.substr(pos);
      if (open_brackets.empty()) {
        char marker = '\0';
        if ((rest[0] == '-' || (block && rest[0] == '+')) && rest.substr(1, 2) == close) {
          marker = rest[0];
        }
        if (marker != '\0' || rest.substr(0, 2) == close) {
          tokens_.push_back(Token{block ? TokenType::kBlockEnd : TokenType::kVariableEnd, "", pos});
          return after_tag_end(pos + 2 + (marker != '\0' ? 1 : 0), marker, block, line_starting);
        }
      }
      pos = lex_expression_token(pos, open_brackets);
    }
  }

  size_t lex_expression_token(size_t pos, std::vector<char>& open_brackets) {
    const char c = source_[pos];
    if (is_digit(c)) return lex_number(pos);
    if (is_name_start(c)) {
      size_t end = pos;
      while (end < source_.size() && is_name_char(source_[end])) ++end;
      tokens_.push_back(Token{TokenType::kName, std::string(source_.substr(pos, end - pos)), pos});
      return end;
    }
    if (c == '\'' || c == '"') return lex_string(pos);
    for (const std::string_view op : kOperators) {
      if (source_.substr(pos, op.size()) != op) continue;
      if (op == "(" || op == "[" || op == "{") {
        open_brackets.push_back(op == "(" ? ')' : (op == "[" ? ']' : '}'));
      } else if (op == ")" || op == "]" || op == "}") {
        if (open_brackets.empty()) fail(pos, "unexpected '" + std::string(op) + "'");
        if (open_brackets.back() != op[0]) {
          fail(pos, "unexpected '" + std::string(op) + "', expected '" +
                        std::string(1, open_brackets.back()) + "'");
        }
        open_brackets.pop_back();
      }
      tokens_.push_back(Token{TokenType::kOperator, std::string(op), pos});
      return pos + op.size();
    }
    if (c == ',' || c == ';') {
      tokens_.push_back(Token{TokenType::kOperator, std::string(1, c), pos});
      return pos + 1;
    }
    size_t end = pos;
    next_code_point(source_, end);
    fail(pos, "unexpected character '" + std::string(source_.substr(pos, end - pos)) + "'");
  }

  // Digits with single underscores between them ("1_000"); returns the end offset.
  size_t digit_run(size_t pos, std::string& digits) const {
    while (pos < source_.size()) {
      if (is_digit(source_[pos])) {
        digits.push_back(source_[pos++]);
      } else if (source_[pos] == '_' && pos + 1 < source_.size() && is_digit(source_[pos + 1]) &&
                 !digits.empty()) {
        ++pos;
      } else {
        break;
      }
    }
    return pos;
  }

  // jinja2's numbers: 12, 1_000, 0x1f, 0o17, 0b101, 1.5, 1e3, 2.5E-3. A float never follows a
  // "." (so x.0.1 is two subscripts).
  size_t lex_number(size_t pos) {
    const size_t start = pos;
    const bool after_dot = pos > 0 && source_[pos - 1] == '.';
    std::string digits;
    size_t end = digit_run(pos, digits);
    std::string literal = digits;
    bool is_float = false;
    if (!after_dot) {
      size_t cursor = end;
      if (cursor + 1 < source_.size() && source_[cursor] == '.' && is_digit(source_[cursor + 1])) {
        std::string fraction;
        cursor = digit_run(cursor + 1, fraction);
        literal += "." + fraction;
        end = cursor;
        is_float = true;
      }
      if (cursor < source_.size() && (source_[cursor] == 'e' || source_[cursor] == 'E')) {
        size_t exp = cursor + 1;
        std::string exponent;
        if (exp < source_.size() && (source_[exp] == '+' || source_[exp] == '-')) {
          exponent.push_back(source_[exp++]);
        }
        if (exp < source_.size() && is_digit(source_[exp])) {
          exp = digit_run(exp, exponent);
          literal += "e" + exponent;
          end = exp;
          is_float = true;
        }
      }
    }
    if (is_float) {
      tokens_.push_back(Token{TokenType::kFloat, literal, start});
      return end;
    }
    // Prefixed integers; a leading 0 otherwise stands alone ("0" then "7" in "07", as jinja2).
    if (source_[start] == '0' && start + 1 < source_.size()) {
      const char prefix =
          static_cast<char>(std::tolower(static_cast<unsigned char>(source_[start + 1])));
      const int base = prefix == 'x' ? 16 : (prefix == 'o' ? 8 : (prefix == 'b' ? 2 : 0));
      if (base != 0) {
        size_t cursor = start + 2;
        uint64_t value = 0;
        bool any = false;
        while (cursor < source_.size()) {
          const char d =
              static_cast<char>(std::tolower(static_cast<unsigned char>(source_[cursor])));
          int digit = -1;
          if (is_digit(d)) digit = d - '0';
          if (d >= 'a' && d <= 'f') digit = d - 'a' + 10;
          if (d == '_') {
            ++cursor;
            continue;
          }
          if (digit < 0 || digit >= base) break;
          value = value * static_cast<uint64_t>(base) + static_cast<uint64_t>(digit);
          any = true;
          ++cursor;
        }
        if (any) {
          tokens_.push_back(Token{TokenType::kInteger, std::to_string(value), start});
          return cursor;
        }
      }
      tokens_.push_back(Token{TokenType::kInteger, "0", start});
      size_t cursor = start + 1;
      while (cursor + 1 < source_.size() && source_[cursor] == '_' && source_[cursor + 1] == '0') {
        cursor += 2;
      }
      while (cursor < source_.size() && source_[cursor] == '0') ++cursor;
      return cursor;
    }
    tokens_.push_back(Token{TokenType::kInteger, digits, start});
    return end;
  }

  // A quoted literal with Python's escapes (jinja2 decodes them as "unicode-escape"); unknown
  // escapes stay as written.
  size_t lex_string(size_t start) {
    const char quote = source_[start];
    std::string value;
    size_t pos = start + 1;
    const auto hex_escape = [&](size_t digits) {
      if (pos + digits > source_.size()) fail(pos, "truncated \\x, \\u or \\U escape");
      uint32_t code = 0;
      for (size_t i = 0; i < digits; ++i) {
        const char d =
            static_cast<char>(std::tolower(static_cast<unsigned char>(source_[pos + i])));
        if (!std::isxdigit(static_cast<unsigned char>(d))) {
          fail(pos, "truncated \\x, \\u or \\U escape");
        }
        code = code * 16 + static_cast<uint32_t>(is_digit(d) ? d - '0' : d - 'a' + 10);
      }
      if (code > 0x10FFFF) fail(pos, "escape names no character (above U+10FFFF)");
      pos += digits;
      append_utf8(value, static_cast<char32_t>(code));
    };
    while (true) {
      if (pos >= source_.size()) fail(start, "unterminated string literal");
      const char c = source_[pos];
      if (c == quote) break;
      if (c != '\\') {
        value.push_back(c);
        ++pos;
        continue;
      }
      if (pos + 1 >= source_.size()) fail(start, "unterminated string literal");
      const char e = source_[pos + 1];
      pos += 2;
      switch (e) {
        case '\n':
          break;  // a line continuation
        case '\\':
        case '\'':
        case '"':
          value.push_back(e);
          break;
        case 'n':
          value.push_back('\n');
          break;
        case 't':
          value.push_back('\t');
          break;
        case 'r':
          value.push_back('\r');
          break;
        case 'a':
          value.push_back('\a');
          break;
        case 'b':
          value.push_back('\b');
          break;
        case 'f':
          value.push_back('\f');
          break;
        case 'v':
          value.push_back('\v');
          break;
        case 'x':
          hex_escape(2);
          break;
        case 'u':
          hex_escape(4);
          break;
        case 'U':
          hex_escape(8);
          break;
        default:
          if (e >= '0' && e <= '7') {
            uint32_t code = static_cast<uint32_t>(e - '0');
            for (int i = 0;
                 i < 2 && pos < source_.size() && source_[pos] >= '0' && source_[pos] <= '7'; ++i) {
              code = code * 8 + static_cast<uint32_t>(source_[pos++] - '0');
            }
            append_utf8(value, static_cast<char32_t>(code));
          } else {
            value.push_back('\\');
            --pos;  // the character after the backslash is ordinary text
          }
      }
    }
    tokens_.push_back(Token{TokenType::kString, std::move(value), start});
    return pos + 1;
  }

  std::string_view source_;
  const SourcePositions& positions_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize_template(std::string_view source, const SourcePositions& positions) {
  return Lexer(source, positions).run();
}

}  // namespace quantmla::detail::jinja
