#include "tokenizer/utf8.h"

#include <cstdint>

namespace quantmla::detail {
namespace {

// Length of the well-formed sequence at `pos`, or 0 with `consumed` set to the length of the
// maximal ill-formed prefix (at least 1). Ranges follow Table 3-7 of the Unicode standard,
// which excludes overlong forms, surrogates and code points above U+10FFFF.
size_t scan_sequence(std::string_view text, size_t pos, size_t& consumed) {
  const auto byte_at = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t lead = byte_at(pos);
  consumed = 1;
  if (lead < 0x80) return 1;
  size_t length = 0;
  uint8_t second_min = 0x80;
  uint8_t second_max = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) second_min = 0xA0;
    if (lead == 0xED) second_max = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) second_min = 0x90;
    if (lead == 0xF4) second_max = 0x8F;
  } else {
    return 0;
  }
  for (size_t i = 1; i < length; ++i) {
    if (pos + i >= text.size()) return 0;
    const uint8_t byte = byte_at(pos + i);
    const uint8_t min = i == 1 ? second_min : 0x80;
    const uint8_t max = i == 1 ? second_max : 0xBF;
    if (byte < min || byte > max) return 0;
    consumed = i + 1;
  }
  return length;
}

}  // namespace

std::optional<size_t> find_invalid_utf8(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    // ASCII dominates real text; skip it without the general scan.
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    size_t consumed = 0;
    const size_t length = scan_sequence(text, pos, consumed);
    if (length == 0) return pos;
    pos += length;
  }
  return std::nullopt;
}

size_t complete_utf8_prefix(std::string_view bytes) {
  for (size_t back = 1; back <= 3 && back <= bytes.size(); ++back) {
    const auto byte = static_cast<unsigned char>(bytes[bytes.size() - back]);
    if ((byte & 0xC0) != 0x80) {  // a lead byte: is its sequence complete?
      const size_t needed = byte >= 0xF0 ? 4 : byte >= 0xE0 ? 3 : byte >= 0xC0 ? 2 : 1;
      return needed > back ? bytes.size() - back : bytes.size();
    }
  }
  return bytes.size();
}

std::string repair_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    size_t consumed = 0;
    const size_t length = scan_sequence(bytes, pos, consumed);
    if (length == 0) {
      append_utf8(out, U'\uFFFD');
      pos += consumed;
    } else {
      out.append(bytes.substr(pos, length));
      pos += length;
    }
  }
  return out;
}

char32_t next_code_point(std::string_view text, size_t& pos) {
  const auto byte_at = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t lead = byte_at(pos);
  if (lead < 0x80) {
    ++pos;
    return lead;
  }
  const size_t length = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
  char32_t code_point = lead & (0x7F >> length);
  for (size_t i = 1; i < length; ++i) code_point = (code_point << 6) | (byte_at(pos + i) & 0x3F);
  pos += length;
  return code_point;
}

size_t char_start_before(std::string_view text, size_t end) {
  size_t start = end - 1;
  while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
  return start;
}

void append_utf8(std::string& out, char32_t code_point) {
  if (code_point < 0x80) {
    out.push_back(static_cast<char>(code_point));
  } else if (code_point < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (code_point >> 6)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  } else if (code_point < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (code_point >> 12)));
    out.push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (code_point >> 18)));
    out.push_back(static_cast<char>(0x80 | ((code_point >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  }
}

bool is_unicode_whitespace(char32_t code_point) {
  if (code_point < 0x80) return code_point == 0x20 || (code_point >= 0x09 && code_point <= 0x0D);
  return code_point == 0x85 || code_point == 0xA0 || code_point == 0x1680 ||
         (code_point >= 0x2000 && code_point <= 0x200A) || code_point == 0x2028 ||
         code_point == 0x2029 || code_point == 0x202F || code_point == 0x205F ||
         code_point == 0x3000;
}

}  // namespace quantmla::detail
