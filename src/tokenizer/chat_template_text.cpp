#include "tokenizer/chat_template_text.h"

#include <algorithm>
#include <cstdio>

#include "tokenizer/chat_template_value.h"
#include "tokenizer/utf8.h"

namespace quantmla::detail::jinja {
namespace {

// Simple (one-to-one) case pairs of the blocks covered; ß, whose upper case is two letters, and
// the few letters of these blocks without a one-to-one partner are handled by the callers.
char32_t to_upper_one(char32_t c) {
  if (c >= U'a' && c <= U'z') return c - 0x20;
  if (c < 0x80) return c;
  if ((c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 0x20;
  if (c == 0xFF) return 0x178;
  if (c == 0xB5) return 0x39C;
  if (c >= 0x100 && c <= 0x17F) {
    if (c == 0x131) return U'I';
    if (c == 0x17F) return U'S';
    const bool odd_lower = (c <= 0x12F) || (c >= 0x132 && c <= 0x137) || (c >= 0x14A && c <= 0x177);
    const bool even_lower = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
    if (odd_lower && c % 2 == 1) return c - 1;
    if (even_lower && c % 2 == 0) return c - 1;
    return c;
  }
  if (c >= 0x3B1 && c <= 0x3CB) return c == 0x3C2 ? 0x3A3 : c - 0x20;
  if (c == 0x3AC) return 0x386;
  if (c >= 0x3AD && c <= 0x3AF) return c - 0x25;
  if (c == 0x3CC) return 0x38C;
  if (c == 0x3CD || c == 0x3CE) return c - 0x3F;
  if (c >= 0x430 && c <= 0x44F) return c - 0x20;
  if (c >= 0x450 && c <= 0x45F) return c - 0x50;
  return c;
}

char32_t to_lower_one(char32_t c) {
  if (c >= U'A' && c <= U'Z') return c + 0x20;
  if (c < 0x80) return c;
  if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 0x20;
  if (c == 0x178) return 0xFF;
  if (c >= 0x100 && c <= 0x17F) {
    if (c == 0x130) return U'i';
    const bool even_upper =
        (c <= 0x12F) || (c >= 0x132 && c <= 0x137) || (c >= 0x14A && c <= 0x177);
    const bool odd_upper = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
    if (even_upper && c % 2 == 0) return c + 1;
    if (odd_upper && c % 2 == 1) return c + 1;
    return c;
  }
  if (c >= 0x391 && c <= 0x3AB && c != 0x3A2) return c + 0x20;
  if (c == 0x386) return 0x3AC;
  if (c >= 0x388 && c <= 0x38A) return c + 0x25;
  if (c == 0x38C) return 0x3CC;
  if (c == 0x38E || c == 0x38F) return c + 0x3F;
  if (c >= 0x410 && c <= 0x42F) return c + 0x20;
  if (c >= 0x400 && c <= 0x40F) return c + 0x50;
  return c;
}

void append_upper(std::u32string& out, char32_t c) {
  if (c == 0xDF) {
    out += U"SS";
  } else {
    out.push_back(to_upper_one(c));
  }
}

// Python's "cased" characters (upper-, lower- or titlecase letters), within the covered blocks.
bool is_cased(char32_t c) { return c == 0xDF || to_upper_one(c) != c || to_lower_one(c) != c; }

bool in_set(char32_t c, const std::u32string& set) { return set.find(c) != std::u32string::npos; }

// Characters Python's repr() escapes besides the ASCII controls: the C1 controls, the no-break
// and other Zs spaces, the line/paragraph separators and the common format characters.
bool is_unprintable(char32_t c) {
  return (c >= 0x80 && c <= 0xA0) || c == 0xAD || c == 0x61C || c == 0x1680 || c == 0x180E ||
         (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) ||
         (c >= 0x205F && c <= 0x206F) || c == 0x3000 || c == 0xFEFF ||
         (c >= 0xFFF9 && c <= 0xFFFB) || (c >= 0xE000 && c <= 0xF8FF);
}

}  // namespace

std::u32string decode_utf8(std::string_view text) {
  std::u32string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) out.push_back(next_code_point(text, pos));
  return out;
}

std::string encode_utf8(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char32_t c : text) append_utf8(out, c);
  return out;
}

size_t code_point_count(std::string_view text) {
  return static_cast<size_t>(std::count_if(text.begin(), text.end(), [](char byte) {
    return (static_cast<unsigned char>(byte) & 0xC0) != 0x80;
  }));
}

bool is_python_space(char32_t c) { return is_unicode_whitespace(c) || (c >= 0x1C && c <= 0x1F); }

std::string strip(std::string_view text, const std::optional<std::string>& chars, bool left,
                  bool right) {
  const std::u32string points = decode_utf8(text);
  const std::u32string set = chars ? decode_utf8(*chars) : std::u32string();
  const auto stripped = [&](char32_t c) { return chars ? in_set(c, set) : is_python_space(c); };
  size_t begin = 0;
  size_t end = points.size();
  if (left) {
    while (begin < end && stripped(points[begin])) ++begin;
  }
  if (right) {
    while (end > begin && stripped(points[end - 1])) --end;
  }
  return encode_utf8(std::u32string_view(points).substr(begin, end - begin));
}

std::vector<std::string> split(std::string_view text, const std::optional<std::string>& separator,
                               int64_t max_splits, bool from_right) {
  std::vector<std::string> parts;
  if (separator) {
    if (separator->empty()) throw RenderError("ValueError: empty separator");
    // Byte search is code point search in well-formed UTF-8.
    if (!from_right) {
      size_t begin = 0;
      while (max_splits < 0 || static_cast<int64_t>(parts.size()) < max_splits) {
        const size_t found = text.find(*separator, begin);
        if (found == std::string_view::npos) break;
        parts.emplace_back(text.substr(begin, found - begin));
        begin = found + separator->size();
      }
      parts.emplace_back(text.substr(begin));
      return parts;
    }
    size_t end = text.size();
    while (max_splits < 0 || static_cast<int64_t>(parts.size()) < max_splits) {
      if (end < separator->size()) break;
      const size_t found = text.rfind(*separator, end - separator->size());
      if (found == std::string_view::npos) break;
      parts.emplace_back(text.substr(found + separator->size(), end - found - separator->size()));
      end = found;
    }
    parts.emplace_back(text.substr(0, end));
    std::reverse(parts.begin(), parts.end());
    return parts;
  }
  // Runs of whitespace separate; once the splits are used up, the rest is the last part, with the
  // whitespace on its far side kept (Python's '  a  b  '.split(None, 1) is ['a', 'b  ']).
  std::u32string points = decode_utf8(text);
  if (from_right) std::reverse(points.begin(), points.end());
  std::vector<std::u32string> words;
  size_t pos = 0;
  while (pos < points.size()) {
    while (pos < points.size() && is_python_space(points[pos])) ++pos;
    if (pos == points.size()) break;
    if (max_splits >= 0 && static_cast<int64_t>(words.size()) == max_splits) {
      words.push_back(points.substr(pos));
      break;
    }
    const size_t begin = pos;
    while (pos < points.size() && !is_python_space(points[pos])) ++pos;
    words.push_back(points.substr(begin, pos - begin));
  }
  if (from_right) {
    std::reverse(words.begin(), words.end());
    for (std::u32string& word : words) std::reverse(word.begin(), word.end());
  }
  for (const std::u32string& word : words) parts.push_back(encode_utf8(word));
  return parts;
}

std::string replace(std::string_view text, std::string_view old, std::string_view replacement,
                    int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old.empty()) {
    size_t pos = 0;
    while (pos <= text.size()) {
      if (count < 0 || done < count) {
        out.append(replacement);
        ++done;
      }
      if (pos == text.size()) break;
      const size_t begin = pos;
      next_code_point(text, pos);
      out.append(text.substr(begin, pos - begin));
    }
    return out;
  }
  size_t begin = 0;
  while (count < 0 || done < count) {
    const size_t found = text.find(old, begin);
    if (found == std::string_view::npos) break;
    out.append(text.substr(begin, found - begin));
    out.append(replacement);
    begin = found + old.size();
    ++done;
  }
  out.append(text.substr(begin));
  return out;
}

int64_t count(std::string_view text, std::string_view part) {
  if (part.empty()) return static_cast<int64_t>(code_point_count(text)) + 1;
  int64_t found = 0;
  for (size_t pos = text.find(part); pos != std::string_view::npos;
       pos = text.find(part, pos + part.size())) {
    ++found;
  }
  return found;
}

std::string upper(std::string_view text) {
  std::u32string out;
  for (const char32_t c : decode_utf8(text)) append_upper(out, c);
  return encode_utf8(out);
}

std::string lower(std::string_view text) {
  std::u32string points = decode_utf8(text);
  for (char32_t& c : points) c = to_lower_one(c);
  return encode_utf8(points);
}

std::string capitalize(std::string_view text) {
  std::u32string points = decode_utf8(text);
  std::u32string out;
  for (size_t i = 0; i < points.size(); ++i) {
    if (i == 0) {
      append_upper(out, points[i]);
      if (points[i] == 0xDF) out[1] = U's';  // titlecase of ß is "Ss"
    } else {
      out.push_back(to_lower_one(points[i]));
    }
  }
  return encode_utf8(out);
}

std::string title(std::string_view text) {
  std::u32string out;
  bool previous_cased = false;
  for (const char32_t c : decode_utf8(text)) {
    if (previous_cased) {
      out.push_back(to_lower_one(c));
    } else {
      append_upper(out, c);
      if (c == 0xDF) out.back() = U's';
    }
    previous_cased = is_cased(c);
  }
  return encode_utf8(out);
}

std::string jinja_title(std::string_view text) {
  const auto starts_word = [](char32_t c) {
    return c == U'-' || c == U'(' || c == U'{' || c == U'[' || c == U'<' || is_python_space(c);
  };
  std::u32string out;
  bool at_start = true;
  bool previous_separator = false;
  for (const char32_t c : decode_utf8(text)) {
    const bool separator = starts_word(c);
    // A new item of jinja2's split begins wherever separator-ness changes.
    if (out.empty() || separator != previous_separator) at_start = true;
    if (at_start) {
      append_upper(out, c);
      at_start = false;
    } else {
      out.push_back(to_lower_one(c));
    }
    previous_separator = separator;
  }
  return encode_utf8(out);
}

std::string quote_python(std::string_view text) {
  const bool double_quotes =
      text.find('\'') != std::string_view::npos && text.find('"') == std::string_view::npos;
  const char quote = double_quotes ? '"' : '\'';
  std::string out(1, quote);
  char buffer[16];
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t begin = pos;
    const char32_t c = next_code_point(text, pos);
    if (c == static_cast<char32_t>(quote) || c == U'\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == U'\t') {
      out += "\\t";
    } else if (c == U'\n') {
      out += "\\n";
    } else if (c == U'\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F || (c <= 0xFF && is_unprintable(c))) {
      std::snprintf(buffer, sizeof buffer, "\\x%02x", static_cast<unsigned>(c));
      out += buffer;
    } else if (is_unprintable(c)) {
      std::snprintf(buffer, sizeof buffer, "\\u%04x", static_cast<unsigned>(c));
      out += buffer;
    } else {
      out.append(text.substr(begin, pos - begin));
    }
  }
  out.push_back(quote);
  return out;
}

}  // namespace quantmla::detail::jinja
