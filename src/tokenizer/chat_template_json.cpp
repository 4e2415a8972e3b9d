#include "tokenizer/chat_template_json.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "tokenizer/utf8.h"

namespace quantmla::detail::jinja {
namespace {

void append_escape(std::string& out, unsigned code) {
  char buffer[16];
  std::snprintf(buffer, sizeof buffer, "\\u%04x", code);
  out += buffer;
}

// json.dumps' string encoder: with ensure_ascii=False only the quote, the backslash and the C0
// controls are escaped; with ensure_ascii=True everything outside printable ASCII too, as UTF-16
// escapes.
void append_json_string(std::string& out, const std::string& text, bool ensure_ascii) {
  out.push_back('"');
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t begin = pos;
    const char32_t c = next_code_point(text, pos);
    switch (c) {
      case U'"':
        out += "\\\"";
        continue;
      case U'\\':
        out += "\\\\";
        continue;
      case U'\n':
        out += "\\n";
        continue;
      case U'\r':
        out += "\\r";
        continue;
      case U'\t':
        out += "\\t";
        continue;
      case U'\b':
        out += "\\b";
        continue;
      case U'\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    if (c < 0x20 || (ensure_ascii && c > 0x7E)) {
      if (c > 0xFFFF) {
        const unsigned v = static_cast<unsigned>(c) - 0x10000;
        append_escape(out, 0xD800 + (v >> 10));
        append_escape(out, 0xDC00 + (v & 0x3FF));
      } else {
        append_escape(out, static_cast<unsigned>(c));
      }
      continue;
    }
    out.append(text, begin, pos - begin);
  }
  out.push_back('"');
}

std::string float_text(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  return float_repr(value);
}

// A dict key as json.dumps writes it: str as is, numbers, bools and None converted to text.
std::string key_text(const Value& key) {
  switch (key.kind()) {
    case Value::Kind::kString:
      return key.as_string();
    case Value::Kind::kBool:
      return key.as_bool() ? "true" : "false";
    case Value::Kind::kInt:
      return std::to_string(key.as_int());
    case Value::Kind::kFloat:
      return float_text(key.as_float());
    case Value::Kind::kNone:
      return "null";
    default:
      throw RenderError("TypeError: keys must be str, int, float, bool or None, not " +
                        type_name(key));
  }
}

class Dumper {
 public:
  explicit Dumper(const JsonDumpOptions& options) : options_(options) {
    const bool indenting = options.indent.has_value();
    item_separator_ = options.item_separator.value_or(indenting ? "," : ", ");
    key_separator_ = options.key_separator.value_or(": ");
  }

  void dump(const Value& value, int depth) {
    switch (value.kind()) {
      case Value::Kind::kNone:
        out_ += "null";
        return;
      case Value::Kind::kBool:
        out_ += value.as_bool() ? "true" : "false";
        return;
      case Value::Kind::kInt:
        out_ += std::to_string(value.as_int());
        return;
      case Value::Kind::kFloat:
        out_ += float_text(value.as_float());
        return;
      case Value::Kind::kString:
        append_json_string(out_, value.as_string(), options_.ensure_ascii);
        return;
      case Value::Kind::kList:
        dump_list(value.as_list(), depth);
        return;
      case Value::Kind::kDict:
        dump_dict(value.as_dict(), depth);
        return;
      default:
        throw RenderError("TypeError: Object of type " + type_name(value) +
                          " is not JSON serializable");
    }
  }

  std::string take() { return std::move(out_); }

 private:
  // Before an element: the separator after the previous one, and the line break and indent.
  void begin_item(bool first, int depth) {
    if (!first) out_ += item_separator_;
    newline(depth);
  }

  void newline(int depth) {
    if (!options_.indent) return;
    out_.push_back('\n');
    for (int i = 0; i < depth; ++i) out_ += *options_.indent;
  }

  void dump_list(const List& items, int depth) {
    if (items.empty()) {
      out_ += "[]";
      return;
    }
    out_.push_back('[');
    for (size_t i = 0; i < items.size(); ++i) {
      begin_item(i == 0, depth + 1);
      dump(items[i], depth + 1);
    }
    newline(depth);
    out_.push_back(']');
  }

  void dump_dict(const Dict& dict, int depth) {
    if (dict.entries.empty()) {
      out_ += "{}";
      return;
    }
    std::vector<const std::pair<Value, Value>*> entries;
    for (const auto& entry : dict.entries) entries.push_back(&entry);
    if (options_.sort_keys) {
      std::stable_sort(entries.begin(), entries.end(),
                       [](const auto* a, const auto* b) { return less(a->first, b->first, "<"); });
    }
    out_.push_back('{');
    for (size_t i = 0; i < entries.size(); ++i) {
      begin_item(i == 0, depth + 1);
      append_json_string(out_, key_text(entries[i]->first), options_.ensure_ascii);
      out_ += key_separator_;
      dump(entries[i]->second, depth + 1);
    }
    newline(depth);
    out_.push_back('}');
  }

  const JsonDumpOptions& options_;
  std::string item_separator_;
  std::string key_separator_;
  std::string out_;
};

}  // namespace

std::string json_dumps(const Value& value, const JsonDumpOptions& options) {
  Dumper dumper(options);
  dumper.dump(value, 0);
  return dumper.take();
}

}  // namespace quantmla::detail::jinja
