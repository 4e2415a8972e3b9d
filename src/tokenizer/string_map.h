// Hash map keyed by std::string that can be searched with a std::string_view, without building a
// temporary std::string per lookup.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>

namespace quantmla::detail {

struct StringViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};

template <typename Value>
using StringMap = std::unordered_map<std::string, Value, StringViewHash, std::equal_to<>>;

}  // namespace quantmla::detail
