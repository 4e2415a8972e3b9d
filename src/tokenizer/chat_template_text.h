// Python's str operations on UTF-8 text, as chat templates call them: Python counts, slices and
// strips code points, not bytes, and its whitespace and case rules are Unicode's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace quantmla::detail::jinja {

// Code points of well-formed UTF-8 and back.
std::u32string decode_utf8(std::string_view text);
std::string encode_utf8(std::u32string_view text);
// len(s): the number of code points.
size_t code_point_count(std::string_view text);

// str.isspace() of one character (Unicode White_Space plus the information separators 0x1C..0x1F).
bool is_python_space(char32_t c);

// str.strip / lstrip / rstrip: `chars` absent strips whitespace, else any of its characters.
std::string strip(std::string_view text, const std::optional<std::string>& chars, bool left,
                  bool right);
// str.split / str.rsplit: `separator` absent splits on runs of whitespace and drops empty parts;
// `max_splits` < 0 is unlimited. An empty separator raises ValueError (RenderError).
std::vector<std::string> split(std::string_view text, const std::optional<std::string>& separator,
                               int64_t max_splits, bool from_right);
// str.replace: `count` < 0 replaces all; an empty `old` inserts `replacement` around every
// character, as Python does.
std::string replace(std::string_view text, std::string_view old, std::string_view replacement,
                    int64_t count);
// str.count of a non-overlapping substring (an empty one counts the gaps: len + 1).
int64_t count(std::string_view text, std::string_view part);

// str.upper / lower / capitalize / title. Case mapping covers ASCII, Latin-1, Latin Extended-A,
// Greek and Cyrillic (ß upper-cases to "SS"); other letters stay as they are, where Python would
// map some of them.
std::string upper(std::string_view text);
std::string lower(std::string_view text);
std::string capitalize(std::string_view text);
std::string title(std::string_view text);
// jinja2's `title` filter, which is not str.title: words start after "-", whitespace or an
// opening bracket, and each word is first-upper, rest-lower.
std::string jinja_title(std::string_view text);

// A string literal as Python writes it: single quotes unless the text has ' and no ".
std::string quote_python(std::string_view text);

}  // namespace quantmla::detail::jinja
