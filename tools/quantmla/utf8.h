// Streaming text out of token bytes without splitting a UTF-8 character.
#pragma once

#include <cstddef>
#include <string>

namespace quantmla::cli {

// Length of the longest prefix of `bytes` that does not end inside a UTF-8 sequence.
inline size_t complete_utf8_prefix(const std::string& bytes) {
  size_t end = bytes.size();
  for (size_t back = 1; back <= 3 && back <= bytes.size(); ++back) {
    const unsigned char byte = static_cast<unsigned char>(bytes[bytes.size() - back]);
    if ((byte & 0xC0) != 0x80) {  // a lead byte: is its sequence complete?
      const size_t needed = byte >= 0xF0 ? 4 : byte >= 0xE0 ? 3 : byte >= 0xC0 ? 2 : 1;
      if (needed > back) end = bytes.size() - back;
      break;
    }
  }
  return end;
}

}  // namespace quantmla::cli
