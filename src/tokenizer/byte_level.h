// GPT-2 byte-level alphabet: every byte is shown as a printable code point so that BPE
// vocabularies can be stored as text. Printable Latin-1 bytes stand for themselves; the other 68
// bytes (controls, space, soft hyphen...) take the code points from U+0100 up, in byte order.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace quantmla::detail {

char32_t byte_to_code_point(uint8_t byte);

// The byte-level text of raw bytes: one alphabet code point per byte.
std::string to_byte_level(std::string_view bytes);

// The raw bytes of byte-level text, or nullopt when a character is outside the alphabet.
std::optional<std::string> from_byte_level(std::string_view text);

}  // namespace quantmla::detail
