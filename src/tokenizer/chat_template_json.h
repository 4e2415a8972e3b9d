// The `tojson` filter as transformers defines it for chat templates: Python's json.dumps (not
// jinja2's HTML-safe tojson), with ensure_ascii=False unless the template asks otherwise.
#pragma once

#include <optional>
#include <string>

#include "tokenizer/chat_template_value.h"

namespace quantmla::detail::jinja {

struct JsonDumpOptions {
  bool ensure_ascii = false;
  // Absent: one line. Else each nesting level on its own line, indented by this string.
  std::optional<std::string> indent;
  // Absent: json.dumps' defaults, (", ", ": ") on one line and (",", ": ") when indenting.
  std::optional<std::string> item_separator;
  std::optional<std::string> key_separator;
  bool sort_keys = false;
};

// json.dumps(value, ...). Undefined, namespaces and functions raise TypeError (RenderError), as
// Python's encoder does for objects it does not know.
std::string json_dumps(const Value& value, const JsonDumpOptions& options);

}  // namespace quantmla::detail::jinja
