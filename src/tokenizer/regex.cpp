#include "tokenizer/regex.h"

#include <new>

#include "quantmla/error.h"

namespace quantmla::detail {
namespace {

constexpr std::string_view kWhitespaceSet = "\\x{9}-\\x{d}\\x{85}\\p{Z}";

struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};
using MatchData = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

MatchData make_match_data(const pcre2_code* code) {
  MatchData data(pcre2_match_data_create_from_pattern(code, nullptr));
  if (!data) throw std::bad_alloc();
  return data;
}

std::string pcre2_message(int error_code) {
  PCRE2_UCHAR buffer[256];
  const int length = pcre2_get_error_message(error_code, buffer, sizeof(buffer));
  return length < 0 ? "PCRE2 error " + std::to_string(error_code)
                    : std::string(reinterpret_cast<const char*>(buffer), length);
}

size_t utf8_sequence_length(char lead) {
  const auto byte = static_cast<unsigned char>(lead);
  return byte < 0x80 ? 1 : byte >= 0xF0 ? 4 : byte >= 0xE0 ? 3 : 2;
}

}  // namespace

std::string oniguruma_to_pcre2(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char escaped = pattern[++i];
      if (escaped == 's') {
        out += in_class ? std::string(kWhitespaceSet) : "[" + std::string(kWhitespaceSet) + "]";
      } else if (escaped == 'S' && !in_class) {
        out += "[^" + std::string(kWhitespaceSet) + "]";
      } else {
        out += c;
        out += escaped;
      }
      continue;
    }
    out += c;
    if (!in_class && c == '[') {
      in_class = true;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
    } else if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      // POSIX class such as [:alpha:]: copy through its closing ":]".
      const size_t close = pattern.find(":]", i + 2);
      if (close != std::string_view::npos) {
        out.append(pattern.substr(i + 1, close + 1 - i));
        i = close + 1;
      }
    } else if (in_class && c == ']') {
      in_class = false;
    }
  }
  return out;
}

Regex::Regex(std::string_view pattern, Syntax syntax, std::string_view component)
    : pattern_(pattern) {
  const std::string compiled_pattern =
      syntax == Syntax::kOniguruma ? oniguruma_to_pcre2(pattern) : std::string(pattern);
  // PCRE2 rejects UCP together with LITERAL, and a literal has no classes for UCP to affect.
  const uint32_t options = PCRE2_UTF | (syntax == Syntax::kLiteral ? PCRE2_LITERAL : PCRE2_UCP);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  code_.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled_pattern.data()),
                            compiled_pattern.size(), options, &error_code, &error_offset, nullptr));
  if (!code_) {
    throw FormatError(std::string(component) + ": regex '" + pattern_ + "' does not compile: " +
                      pcre2_message(error_code) + " at offset " + std::to_string(error_offset));
  }
  // Without JIT (unsupported CPU) PCRE2 falls back to its interpreter: slower, same results.
  pcre2_jit_compile(code_.get(), PCRE2_JIT_COMPLETE);
}

void Regex::split_isolated(const std::vector<std::string_view>& pieces,
                           std::vector<std::string_view>& out) const {
  const MatchData match_data = make_match_data(code_.get());
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_data.get());
  for (const std::string_view piece : pieces) {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
    size_t gap_start = 0;
    size_t search_from = 0;
    while (search_from <= piece.size()) {
      // The caller validated the UTF-8 once; PCRE2 would otherwise rescan the piece every call.
      const int rc = pcre2_match(code_.get(), subject, piece.size(), search_from,
                                 PCRE2_NO_UTF_CHECK, match_data.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        throw Error("tokenizer regex '" + pattern_ + "' failed: " + pcre2_message(rc));
      }
      const size_t match_start = ovector[0];
      const size_t match_end = ovector[1];
      if (match_start > gap_start) out.push_back(piece.substr(gap_start, match_start - gap_start));
      gap_start = match_end;
      if (match_end > match_start) {
        out.push_back(piece.substr(match_start, match_end - match_start));
        search_from = match_end;
      } else if (match_start < piece.size()) {
        // An empty match: resume one character later so the scan makes progress.
        search_from = match_start + utf8_sequence_length(piece[match_start]);
      } else {
        break;
      }
    }
    if (gap_start < piece.size()) out.push_back(piece.substr(gap_start));
  }
}

bool Regex::matches_at(std::string_view text, size_t offset) const {
  const MatchData match_data = make_match_data(code_.get());
  const int rc =
      pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), offset,
                  PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, match_data.get(), nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) throw Error("tokenizer regex '" + pattern_ + "' failed: " + pcre2_message(rc));
  return true;
}

}  // namespace quantmla::detail
