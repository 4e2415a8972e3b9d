// UTF-8 helpers shared by the tokenizer: validation, lossy repair, code point access.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace quantmla::detail {

// Byte offset of the first byte that does not start a well-formed UTF-8 sequence, if any.
std::optional<size_t> find_invalid_utf8(std::string_view text);

// Replaces every maximal ill-formed subsequence with U+FFFD, as Unicode recommends (and as
// Rust's String::from_utf8_lossy does, which Hugging Face decoding uses).
std::string repair_utf8(std::string_view bytes);

// Length of the longest prefix of `bytes` that does not end inside a UTF-8 sequence (a lead byte
// whose continuation bytes have not all come): what can be shown of a stream of token bytes.
size_t complete_utf8_prefix(std::string_view bytes);

// Decodes the code point at `pos` of well-formed UTF-8 and advances `pos` past it.
char32_t next_code_point(std::string_view text, size_t& pos);

// Offset where the character ending at `end` (exclusive) starts, in well-formed UTF-8; `end` > 0.
size_t char_start_before(std::string_view text, size_t end);

void append_utf8(std::string& out, char32_t code_point);

// Unicode White_Space, the set of Rust's char::is_whitespace and of Oniguruma's \s.
bool is_unicode_whitespace(char32_t code_point);

}  // namespace quantmla::detail
