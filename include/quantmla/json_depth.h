// How deep a JSON value nests, for input that a program copies, dumps or converts: nlohmann's
// parser and destructor do not recurse, but those operations recurse once a level, so a value
// nested 100,000 deep (600 bytes of brackets a thousand times over) would exhaust the stack.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

namespace quantmla {

// 0 for a scalar, 1 for an array or object of scalars, and so on; walked with a stack of its own,
// and stopped as soon as the depth passes `limit` (the result is then limit + 1).
template <class Json>
int json_nesting_depth(const Json& root, int limit) {
  int deepest = 0;
  std::vector<std::pair<const Json*, int>> pending = {{&root, 1}};
  while (!pending.empty()) {
    const auto [value, depth] = pending.back();
    pending.pop_back();
    if (!value->is_structured()) continue;
    deepest = std::max(deepest, depth);
    if (deepest > limit) return limit + 1;
    for (const Json& item : *value) pending.emplace_back(&item, depth + 1);
  }
  return deepest;
}

}  // namespace quantmla
