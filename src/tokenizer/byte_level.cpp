#include "tokenizer/byte_level.h"

#include <array>

#include "tokenizer/utf8.h"

namespace quantmla::detail {
namespace {

bool is_self_mapped(unsigned byte) {
  return (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) ||
         (byte >= 0xAE && byte <= 0xFF);
}

struct Alphabet {
  std::array<char32_t, 256> code_point_of_byte{};
  // The alphabet spans U+0021..U+0143, so a dense reverse table is small.
  static constexpr char32_t kCodePointLimit = 0x144;
  std::array<int16_t, kCodePointLimit> byte_of_code_point{};

  Alphabet() {
    byte_of_code_point.fill(-1);
    char32_t next_substitute = 0x100;
    for (unsigned byte = 0; byte < 256; ++byte) {
      const char32_t code_point = is_self_mapped(byte) ? byte : next_substitute++;
      code_point_of_byte[byte] = code_point;
      byte_of_code_point[code_point] = static_cast<int16_t>(byte);
    }
  }
};

const Alphabet& alphabet() {
  static const Alphabet instance;
  return instance;
}

}  // namespace

char32_t byte_to_code_point(uint8_t byte) { return alphabet().code_point_of_byte[byte]; }

std::string to_byte_level(std::string_view bytes) {
  std::string text;
  text.reserve(bytes.size() * 2);
  for (const char byte : bytes) append_utf8(text, byte_to_code_point(static_cast<uint8_t>(byte)));
  return text;
}

std::optional<std::string> from_byte_level(std::string_view text) {
  const Alphabet& table = alphabet();
  std::string bytes;
  bytes.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const char32_t code_point = next_code_point(text, pos);
    if (code_point >= Alphabet::kCodePointLimit) return std::nullopt;
    const int16_t byte = table.byte_of_code_point[code_point];
    if (byte < 0) return std::nullopt;
    bytes.push_back(static_cast<char>(byte));
  }
  return bytes;
}

}  // namespace quantmla::detail
