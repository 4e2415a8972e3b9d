#include "tokenizer/chat_template_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>

#include "tokenizer/chat_template_text.h"
#include "tokenizer/utf8.h"

namespace quantmla::detail::jinja {

Value Value::undefined(std::string hint) {
  Value value;
  value.string_ = std::move(hint);
  return value;
}

Value Value::none() {
  Value value;
  value.kind_ = Kind::kNone;
  return value;
}

Value::Value(bool value) : kind_(Kind::kBool), int_(value ? 1 : 0) {}
Value::Value(int64_t value) : kind_(Kind::kInt), int_(value) {}
Value::Value(double value) : kind_(Kind::kFloat), float_(value) {}
Value::Value(std::string value) : kind_(Kind::kString), string_(std::move(value)) {}

namespace {

// 1 + `deepest` (the deepest item's nesting), or RenderError past Value::kMaxNesting.
uint16_t one_level_deeper(int deepest) {
  if (deepest + 1 > Value::kMaxNesting) {
    throw RenderError("RecursionError: lists and dicts nested deeper than " +
                      std::to_string(Value::kMaxNesting) + " levels");
  }
  return static_cast<uint16_t>(deepest + 1);
}

}  // namespace

Value Value::list(List items, bool tuple) {
  int deepest = 0;
  for (const Value& item : items) deepest = std::max(deepest, item.nesting());
  Value value;
  value.kind_ = Kind::kList;
  value.tuple_ = tuple;
  value.nesting_ = one_level_deeper(deepest);
  value.list_ = std::make_shared<const List>(std::move(items));
  return value;
}

Value Value::dict(Dict items) {
  int deepest = 0;
  for (const auto& [key, item] : items.entries) {
    deepest = std::max({deepest, key.nesting(), item.nesting()});
  }
  Value value;
  value.kind_ = Kind::kDict;
  value.nesting_ = one_level_deeper(deepest);
  value.dict_ = std::make_shared<Dict>(std::move(items));
  return value;
}

Value Value::new_namespace(Dict attributes) {
  Value value = dict(std::move(attributes));
  value.kind_ = Kind::kNamespace;
  value.nesting_ = 0;  // its attributes change after this; it prints without them
  return value;
}

Value Value::callable(std::string name, std::function<Value(const CallArgs&)> call) {
  Value value;
  value.kind_ = Kind::kCallable;
  value.callable_ = std::make_shared<const Callable>(Callable{std::move(name), std::move(call)});
  return value;
}

const void* Value::identity() const {
  if (kind_ == Kind::kCallable) return callable_.get();
  if (kind_ == Kind::kList) return list_.get();
  if (kind_ == Kind::kDict || kind_ == Kind::kNamespace) return dict_.get();
  return nullptr;
}

const Value* Dict::find(const Value& key) const {
  for (const auto& [k, v] : entries) {
    if (equal(k, key)) return &v;
  }
  return nullptr;
}

const Value* Dict::find(const std::string& key) const {
  for (const auto& [k, v] : entries) {
    if (k.is_string() && k.as_string() == key) return &v;
  }
  return nullptr;
}

void Dict::set(Value key, Value value) {
  for (auto& [k, v] : entries) {
    if (equal(k, key)) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

std::string type_name(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return value.is_tuple() ? "tuple" : "list";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kNamespace:
      return "Namespace";
    case Value::Kind::kCallable:
      return "function";
  }
  return "object";
}

std::string object_description(const Value& value) {
  std::string out = "'";
  out += type_name(value);
  out += " object'";
  return out;
}

bool truthy(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
    case Value::Kind::kInt:
      return value.as_int() != 0;
    case Value::Kind::kFloat:
      return value.as_float() != 0.0;
    case Value::Kind::kString:
      return !value.as_string().empty();
    case Value::Kind::kList:
      return !value.as_list().empty();
    case Value::Kind::kDict:
      return !value.as_dict().entries.empty();
    case Value::Kind::kNamespace:
    case Value::Kind::kCallable:
      return true;
  }
  return false;
}

std::string float_repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  // The shortest digits that round-trip, then Python's layout: positional for exponents in
  // [-4, 16), scientific otherwise, and always a ".0" on a whole number.
  char buffer[64];
  const auto result =
      std::to_chars(buffer, buffer + sizeof buffer, value, std::chars_format::scientific);
  const std::string scientific(buffer, result.ptr);
  const size_t e = scientific.find('e');
  const int exponent = std::stoi(scientific.substr(e + 1));
  std::string mantissa = scientific.substr(0, e);
  const bool negative = mantissa[0] == '-';
  if (negative) mantissa.erase(0, 1);
  if (exponent < -4 || exponent >= 16) {
    // to_chars already writes "1.5e+16", "1e-05": Python's spelling.
    return scientific;
  }
  std::string digits;
  for (const char c : mantissa) {
    if (c != '.') digits.push_back(c);
  }
  std::string out = negative ? "-" : "";
  if (exponent < 0) {
    out += "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  } else {
    const size_t whole = static_cast<size_t>(exponent) + 1;
    if (digits.size() <= whole) {
      out += digits + std::string(whole - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, whole) + "." + digits.substr(whole);
    }
  }
  return out;
}

void check_built_size(long double size, bool string) {
  constexpr int64_t kMaxBuilt = int64_t{1} << 24;
  if (size > kMaxBuilt) {
    char count[64];
    std::snprintf(count, sizeof count, "%.0Lf", size);
    throw RenderError("MemoryError: a " + std::string(string ? "string" : "list") + " of " + count +
                      (string ? " bytes" : " items") + "; a template may build at most " +
                      std::to_string(kMaxBuilt));
  }
}

namespace {

std::string sequence_repr(const Value& value) {
  const List& items = value.as_list();
  std::string out = value.is_tuple() ? "(" : "[";
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += ", ";
    out += repr(items[i]);
    check_built_size(static_cast<long double>(out.size()), true);
  }
  if (value.is_tuple() && items.size() == 1) out += ",";
  out += value.is_tuple() ? ")" : "]";
  return out;
}

std::string dict_repr(const Dict& dict) {
  std::string out = "{";
  bool first = true;
  for (const auto& [key, item] : dict.entries) {
    if (!first) out += ", ";
    first = false;
    out += repr(key) + ": " + repr(item);
    check_built_size(static_cast<long double>(out.size()), true);
  }
  return out + "}";
}

}  // namespace

std::string to_str(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kString:
      return value.as_string();
    default:
      return repr(value);
  }
}

std::string repr(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return value.as_bool() ? "True" : "False";
    case Value::Kind::kInt:
      return std::to_string(value.as_int());
    case Value::Kind::kFloat:
      return float_repr(value.as_float());
    case Value::Kind::kString:
      return quote_python(value.as_string());
    case Value::Kind::kList:
      return sequence_repr(value);
    case Value::Kind::kDict:
      return dict_repr(value.as_dict());
    case Value::Kind::kNamespace:
      return "<Namespace " + dict_repr(value.namespace_attributes()) + ">";
    case Value::Kind::kCallable:
      return "<function " + value.as_callable().name + ">";
  }
  return "";
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    return a.as_float() == b.as_float();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.as_string() == b.as_string();
    case Value::Kind::kList: {
      if (a.is_tuple() != b.is_tuple()) return false;
      const List& x = a.as_list();
      const List& y = b.as_list();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!equal(x[i], y[i])) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      const Dict& x = a.as_dict();
      const Dict& y = b.as_dict();
      if (x.entries.size() != y.entries.size()) return false;
      for (const auto& [key, item] : x.entries) {
        const Value* other = y.find(key);
        if (other == nullptr || !equal(item, *other)) return false;
      }
      return true;
    }
    default:
      return a.identity() == b.identity();
  }
}

bool less(const Value& a, const Value& b, const std::string& op) {
  if (a.is_undefined() || b.is_undefined()) {
    throw RenderError(a.is_undefined() ? a.undefined_hint() : b.undefined_hint());
  }
  // Three-way result of comparing a with b, computed once; `op` then reads it.
  int order = 0;
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) {
      order = a.as_int() < b.as_int() ? -1 : (a.as_int() > b.as_int() ? 1 : 0);
    } else {
      const double x = a.as_float();
      const double y = b.as_float();
      if (std::isnan(x) || std::isnan(y)) return false;
      order = x < y ? -1 : (x > y ? 1 : 0);
    }
  } else if (a.is_string() && b.is_string()) {
    // Byte order of UTF-8 is code point order, which is Python's.
    const int c = a.as_string().compare(b.as_string());
    order = c < 0 ? -1 : (c > 0 ? 1 : 0);
  } else if (a.kind() == Value::Kind::kList && b.kind() == Value::Kind::kList &&
             a.is_tuple() == b.is_tuple()) {
    const List& x = a.as_list();
    const List& y = b.as_list();
    size_t i = 0;
    while (i < x.size() && i < y.size() && equal(x[i], y[i])) ++i;
    if (i < x.size() && i < y.size()) return less(x[i], y[i], op);
    order = x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  } else {
    throw RenderError("TypeError: '" + op + "' not supported between instances of '" +
                      type_name(a) + "' and '" + type_name(b) + "'");
  }
  if (op == "<") return order < 0;
  if (op == "<=") return order <= 0;
  if (op == ">") return order > 0;
  return order >= 0;
}

namespace {

template <typename Json>
Value convert_json(const Json& json, int depth = 0) {
  // Checked before descending: the recursion here is as deep as the JSON.
  if (depth >= Value::kMaxNesting) {
    throw RenderError("RecursionError: the context nests deeper than " +
                      std::to_string(Value::kMaxNesting) + " levels");
  }
  switch (json.type()) {
    case nlohmann::json::value_t::null:
      return Value::none();
    case nlohmann::json::value_t::boolean:
      return Value(json.template get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value(json.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const uint64_t number = json.template get<uint64_t>();
      if (number > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        throw RenderError("integer " + std::to_string(number) + " does not fit in 64 bits");
      }
      return Value(static_cast<int64_t>(number));
    }
    case nlohmann::json::value_t::number_float:
      return Value(json.template get<double>());
    case nlohmann::json::value_t::string: {
      std::string text = json.template get<std::string>();
      if (const auto bad = find_invalid_utf8(text)) {
        throw RenderError("a string of the context is not valid UTF-8 (byte " +
                          std::to_string(*bad) + " of " + std::to_string(text.size()) + ")");
      }
      return Value(std::move(text));
    }
    case nlohmann::json::value_t::array: {
      List items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(convert_json(item, depth + 1));
      return Value::list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      Dict dict;
      dict.entries.reserve(json.size());
      for (auto it = json.begin(); it != json.end(); ++it) {
        dict.entries.emplace_back(Value(it.key()), convert_json(it.value(), depth + 1));
      }
      return Value::dict(std::move(dict));
    }
    default:
      throw RenderError(std::string("unsupported JSON value of type ") + json.type_name());
  }
}

}  // namespace

Value from_json(const nlohmann::json& json) { return convert_json(json); }
Value from_json(const nlohmann::ordered_json& json) { return convert_json(json); }

}  // namespace quantmla::detail::jinja
