#include "tokenizer/chat_template_builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <map>

#include "quantmla/error.h"
#include "tokenizer/chat_template_args.h"
#include "tokenizer/chat_template_json.h"
#include "tokenizer/chat_template_ops.h"
#include "tokenizer/chat_template_text.h"

namespace quantmla::detail::jinja {
namespace {

using Filter = std::function<Value(const Value& operand, const CallArgs& args)>;
using Test = std::function<bool(const Value& operand, const CallArgs& args)>;

int64_t length_of(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return static_cast<int64_t>(code_point_count(value.as_string()));
    case Value::Kind::kList:
      return static_cast<int64_t>(value.as_list().size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(value.as_dict().entries.size());
    default:
      throw RenderError("TypeError: object of type '" + type_name(value) + "' has no len()");
  }
}

// Python's float(text): surrounding whitespace allowed, underscores between digits, inf/nan.
std::optional<double> parse_float(const std::string& text) {
  std::string cleaned;
  for (const char c : strip(text, std::nullopt, true, true)) {
    if (c != '_') cleaned.push_back(c);
  }
  if (cleaned.empty()) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(cleaned.c_str(), &end);
  if (end != cleaned.c_str() + cleaned.size()) return std::nullopt;
  // strtod reads hex floats and "infinity" spellings Python rejects or spells alike; hex is the
  // only one to refuse.
  if (cleaned.find('x') != std::string::npos || cleaned.find('X') != std::string::npos) {
    return std::nullopt;
  }
  return value;
}

std::optional<int64_t> parse_int(const std::string& text, int64_t base) {
  std::string cleaned;
  for (const char c : strip(text, std::nullopt, true, true)) {
    if (c != '_') cleaned.push_back(c);
  }
  if (cleaned.empty() || base < 2 || base > 36) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(cleaned.c_str(), &end, static_cast<int>(base));
  if (errno != 0 || end != cleaned.c_str() + cleaned.size()) return std::nullopt;
  return static_cast<int64_t>(value);
}

// The item's attribute for the *attr filters: "a.b" walks nested attributes, "0" indexes.
Value attribute_path(const Value& item, const std::string& path) {
  Value current = item;
  size_t begin = 0;
  while (true) {
    const size_t dot = path.find('.', begin);
    const std::string part = path.substr(begin, dot == std::string::npos ? dot : dot - begin);
    const bool numeric = !part.empty() && std::all_of(part.begin(), part.end(),
                                                      [](char c) { return c >= '0' && c <= '9'; });
    current = numeric ? get_item(current, Value(static_cast<int64_t>(std::stoll(part))))
                      : get_item(current, Value(part));
    if (dot == std::string::npos) return current;
    begin = dot + 1;
  }
}

// Positional arguments after the first `skip`, for the test that select/map pass on.
CallArgs rest_of(const CallArgs& args, size_t skip) {
  CallArgs rest;
  rest.positional.assign(
      args.positional.begin() + static_cast<ptrdiff_t>(std::min(skip, args.positional.size())),
      args.positional.end());
  rest.keyword = args.keyword;
  return rest;
}

// select / reject / selectattr / rejectattr: keep the items whose (attribute's) test is `keep`.
Value select_items(const Value& operand, const CallArgs& args, bool by_attribute, bool keep,
                   const char* name) {
  size_t next = 0;
  std::string attribute;
  if (by_attribute) {
    if (args.positional.empty() || !args.positional[0].is_string()) {
      throw RenderError(std::string(name) + " needs the attribute name as its first argument");
    }
    attribute = args.positional[0].as_string();
    next = 1;
  }
  std::string test;
  if (args.positional.size() > next) {
    if (!args.positional[next].is_string()) {
      throw RenderError(std::string(name) + ": the test name must be a string");
    }
    test = args.positional[next].as_string();
    if (!has_test(test)) throw RenderError("TemplateRuntimeError: No test named '" + test + "'.");
    ++next;
  }
  const CallArgs test_args = rest_of(args, next);
  List out;
  for (const Value& item : iterate(operand)) {
    const Value subject = by_attribute ? attribute_path(item, attribute) : item;
    const bool passed = test.empty() ? truthy(subject) : apply_test(test, subject, test_args);
    if (passed == keep) out.push_back(item);
  }
  return Value::list(std::move(out));
}

Value map_items(const Value& operand, const CallArgs& args) {
  List out;
  for (const auto& [key, value] : args.keyword) {
    if (key != "attribute" && key != "default") {
      throw RenderError("TypeError: map() got an unexpected keyword argument '" + key + "'");
    }
  }
  const auto attribute = std::find_if(args.keyword.begin(), args.keyword.end(),
                                      [](const auto& kw) { return kw.first == "attribute"; });
  if (attribute != args.keyword.end()) {
    const auto fallback = std::find_if(args.keyword.begin(), args.keyword.end(),
                                       [](const auto& kw) { return kw.first == "default"; });
    for (const Value& item : iterate(operand)) {
      Value value = attribute_path(item, to_str(attribute->second));
      if (value.is_undefined() && fallback != args.keyword.end()) value = fallback->second;
      out.push_back(std::move(value));
    }
    return Value::list(std::move(out));
  }
  if (args.positional.empty() || !args.positional[0].is_string()) {
    throw RenderError("map needs a filter name or attribute=");
  }
  const std::string filter = args.positional[0].as_string();
  if (!has_filter(filter))
    throw RenderError("TemplateRuntimeError: No filter named '" + filter + "'.");
  const CallArgs filter_args = rest_of(args, 1);
  for (const Value& item : iterate(operand)) out.push_back(apply_filter(filter, item, filter_args));
  return Value::list(std::move(out));
}

// The sort key of jinja2's sort/unique: strings compare case-insensitively unless asked not to.
Value sort_key(const Value& item, bool case_sensitive,
               const std::optional<std::string>& attribute) {
  Value key = attribute ? attribute_path(item, *attribute) : item;
  if (!case_sensitive && key.is_string()) key = Value(lower(key.as_string()));
  return key;
}

std::string html_escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

Value round_filter(const Value& operand, const CallArgs& args) {
  const BoundArguments bound("round", args, {"precision", "method"});
  const int64_t precision = bound.integer(0, 0);
  const std::string method = bound.string(1, "common");
  if (!operand.is_number()) {
    throw RenderError("TypeError: round() needs a number, not " + type_name(operand));
  }
  const double value = operand.as_float();
  // Python's round() of an int is that int.
  if (method == "common" && operand.is_integral() && precision >= 0) return Value(operand.as_int());
  if (method == "common") {
    // Python's round(): correctly rounded, ties to even, which is what printf's decimal
    // conversion does too.
    if (precision < 0 || !std::isfinite(value)) {
      const double scale = std::pow(10.0, static_cast<double>(precision));
      return Value(std::nearbyint(value * scale) / scale);
    }
    char buffer[512];
    std::snprintf(buffer, sizeof buffer, "%.*f",
                  static_cast<int>(std::min<int64_t>(precision, 300)), value);
    return Value(std::strtod(buffer, nullptr));
  }
  if (method != "ceil" && method != "floor") {
    throw RenderError("FilterArgumentError: method must be common, ceil or floor, not '" + method +
                      "'");
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double scaled = value * scale;
  return Value((method == "ceil" ? std::ceil(scaled) : std::floor(scaled)) / scale);
}

Value indent_filter(const Value& operand, const CallArgs& args) {
  const BoundArguments bound("indent", args, {"width", "first", "blank"});
  const Value width = bound.get(0, Value(int64_t{4}));
  if (width.is_integral()) check_built_size(static_cast<long double>(width.as_int()), true);
  const std::string indentation =
      width.is_string()
          ? width.as_string()
          : std::string(static_cast<size_t>(std::max<int64_t>(0, width.as_int())), ' ');
  const bool first = truthy(bound.get(1, Value(false)));
  const bool blank = truthy(bound.get(2, Value(false)));
  // jinja2 appends a newline before splitting, so a trailing newline is not kept.
  const std::string text = to_str(operand) + "\n";
  std::vector<std::string> lines;
  size_t begin = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\n' && text[i] != '\r') continue;
    lines.push_back(text.substr(begin, i - begin));
    if (text[i] == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
    begin = i + 1;
  }
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) {
      out += "\n";
      if (blank || !lines[i].empty()) out += indentation;
    }
    out += lines[i];
  }
  return Value(first ? indentation + out : out);
}

Value tojson_filter(const Value& operand, const CallArgs& args) {
  // transformers' signature: tojson(x, ensure_ascii=False, indent=None, separators=None,
  // sort_keys=False).
  const BoundArguments bound("tojson", args, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonDumpOptions options;
  options.ensure_ascii = truthy(bound.get(0, Value(false)));
  const Value indent = bound.get(1);
  if (indent.is_integral()) {
    check_built_size(static_cast<long double>(indent.as_int()), true);
    options.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, indent.as_int())), ' ');
  } else if (indent.is_string()) {
    options.indent = indent.as_string();
  } else if (!indent.is_none()) {
    throw RenderError("TypeError: tojson indent must be an int or a string, not " +
                      type_name(indent));
  }
  const Value separators = bound.get(2);
  if (!separators.is_none()) {
    if (separators.kind() != Value::Kind::kList || separators.as_list().size() != 2 ||
        !separators.as_list()[0].is_string() || !separators.as_list()[1].is_string()) {
      throw RenderError("ValueError: tojson separators must be a pair of strings, got " +
                        repr(separators));
    }
    options.item_separator = separators.as_list()[0].as_string();
    options.key_separator = separators.as_list()[1].as_string();
  }
  options.sort_keys = truthy(bound.get(3, Value(false)));
  return Value(json_dumps(operand, options));
}

Value unary_string_filter(const char* name, const Value& operand, const CallArgs& args,
                          std::string (*transform)(std::string_view)) {
  no_arguments(name, args);
  return Value(transform(to_str(operand)));
}

const std::map<std::string, Filter>& filters() {
  static const std::map<std::string, Filter> table = [] {
    std::map<std::string, Filter> t;
    t["abs"] = [](const Value& v, const CallArgs& a) {
      no_arguments("abs", a);
      if (v.kind() == Value::Kind::kFloat) return Value(std::fabs(v.as_float()));
      if (v.is_integral()) return v.as_int() < 0 ? unary_operation("-", v) : Value(v.as_int());
      throw RenderError("TypeError: bad operand type for abs(): '" + type_name(v) + "'");
    };
    t["capitalize"] = [](const Value& v, const CallArgs& a) {
      return unary_string_filter("capitalize", v, a, capitalize);
    };
    t["length"] = [](const Value& v, const CallArgs& a) {
      no_arguments("length", a);
      return Value(length_of(v));
    };
    t["count"] = t["length"];
    t["default"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("default", a, {"default_value", "boolean"});
      const bool boolean = truthy(bound.get(1, Value(false)));
      if (v.is_undefined() || (boolean && !truthy(v))) return bound.get(0, Value(""));
      return v;
    };
    t["d"] = t["default"];
    t["escape"] = [](const Value& v, const CallArgs& a) {
      no_arguments("escape", a);
      return Value(html_escape(to_str(v)));
    };
    t["e"] = t["escape"];
    t["first"] = [](const Value& v, const CallArgs& a) {
      no_arguments("first", a);
      const List items = iterate(v);
      return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
    };
    t["last"] = [](const Value& v, const CallArgs& a) {
      no_arguments("last", a);
      const List items = iterate(v);
      return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
    };
    t["float"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("float", a, {"default"});
      if (v.is_undefined()) throw RenderError(v.undefined_hint());  // float(Undefined) raises
      if (v.is_number()) return Value(v.as_float());
      if (v.is_string()) {
        if (const auto parsed = parse_float(v.as_string())) return Value(*parsed);
      }
      return bound.get(0, Value(0.0));
    };
    t["int"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("int", a, {"default", "base"});
      if (v.is_undefined()) throw RenderError(v.undefined_hint());  // int(Undefined) raises
      if (v.is_integral()) return Value(v.as_int());
      if (v.kind() == Value::Kind::kFloat && std::isfinite(v.as_float())) {
        return Value(static_cast<int64_t>(std::trunc(v.as_float())));
      }
      if (v.is_string()) {
        if (const auto parsed = parse_int(v.as_string(), bound.integer(1, 10))) {
          return Value(*parsed);
        }
        // jinja2's quirk: "42.23"|int is 42.
        if (const auto parsed = parse_float(v.as_string()); parsed && std::isfinite(*parsed)) {
          return Value(static_cast<int64_t>(std::trunc(*parsed)));
        }
      }
      return bound.get(0, Value(int64_t{0}));
    };
    t["items"] = [](const Value& v, const CallArgs& a) {
      no_arguments("items", a);
      if (v.is_undefined()) return Value::list({});
      if (v.kind() != Value::Kind::kDict) {
        throw RenderError("TypeError: Can only get item pairs from a mapping.");
      }
      List items;
      for (const auto& [key, value] : v.as_dict().entries) {
        items.push_back(Value::list({key, value}, true));
      }
      return Value::list(std::move(items));
    };
    t["join"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("join", a, {"d", "attribute"});
      const std::string separator = to_str(bound.get(0, Value("")));
      const std::optional<std::string> attribute =
          bound.given(1) ? std::optional<std::string>(to_str(bound.get(1))) : std::nullopt;
      std::string out;
      bool first = true;
      for (const Value& item : iterate(v)) {
        if (!first) out += separator;
        first = false;
        out += to_str(attribute ? attribute_path(item, *attribute) : item);
      }
      return Value(std::move(out));
    };
    t["list"] = [](const Value& v, const CallArgs& a) {
      no_arguments("list", a);
      return Value::list(iterate(v));
    };
    t["lower"] = [](const Value& v, const CallArgs& a) {
      return unary_string_filter("lower", v, a, lower);
    };
    t["upper"] = [](const Value& v, const CallArgs& a) {
      return unary_string_filter("upper", v, a, upper);
    };
    t["title"] = [](const Value& v, const CallArgs& a) {
      return unary_string_filter("title", v, a, jinja_title);
    };
    t["map"] = map_items;
    t["select"] = [](const Value& v, const CallArgs& a) {
      return select_items(v, a, false, true, "select");
    };
    t["reject"] = [](const Value& v, const CallArgs& a) {
      return select_items(v, a, false, false, "reject");
    };
    t["selectattr"] = [](const Value& v, const CallArgs& a) {
      return select_items(v, a, true, true, "selectattr");
    };
    t["rejectattr"] = [](const Value& v, const CallArgs& a) {
      return select_items(v, a, true, false, "rejectattr");
    };
    t["replace"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("replace", a, {"old", "new", "count"});
      return Value(replace(to_str(v), to_str(bound.required(0)), to_str(bound.required(1)),
                           bound.integer(2, -1)));
    };
    t["reverse"] = [](const Value& v, const CallArgs& a) {
      no_arguments("reverse", a);
      if (v.is_string()) {
        std::u32string points = decode_utf8(v.as_string());
        std::reverse(points.begin(), points.end());
        return Value(encode_utf8(points));
      }
      List items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    };
    t["round"] = round_filter;
    t["safe"] = [](const Value& v, const CallArgs& a) {
      no_arguments("safe", a);
      return v;
    };
    t["sort"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("sort", a, {"reverse", "case_sensitive", "attribute"});
      const bool reverse = truthy(bound.get(0, Value(false)));
      const bool case_sensitive = truthy(bound.get(1, Value(false)));
      const std::optional<std::string> attribute = bound.optional_string(2);
      List items = iterate(v);
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        const Value kx = sort_key(x, case_sensitive, attribute);
        const Value ky = sort_key(y, case_sensitive, attribute);
        return reverse ? less(ky, kx, "<") : less(kx, ky, "<");
      });
      return Value::list(std::move(items));
    };
    t["dictsort"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("dictsort", a, {"case_sensitive", "by", "reverse"});
      const bool case_sensitive = truthy(bound.get(0, Value(false)));
      const std::string by = bound.string(1, "key");
      const bool reverse = truthy(bound.get(2, Value(false)));
      if (by != "key" && by != "value") {
        throw RenderError("FilterArgumentError: You can only sort by either \"key\" or \"value\"");
      }
      if (v.kind() != Value::Kind::kDict) {
        throw RenderError("TypeError: dictsort needs a mapping, not " + type_name(v));
      }
      List items;
      for (const auto& [key, value] : v.as_dict().entries) {
        items.push_back(Value::list({key, value}, true));
      }
      const size_t part = by == "key" ? 0 : 1;
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        const Value kx = sort_key(x.as_list()[part], case_sensitive, std::nullopt);
        const Value ky = sort_key(y.as_list()[part], case_sensitive, std::nullopt);
        return reverse ? less(ky, kx, "<") : less(kx, ky, "<");
      });
      return Value::list(std::move(items));
    };
    t["unique"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("unique", a, {"case_sensitive", "attribute"});
      const bool case_sensitive = truthy(bound.get(0, Value(false)));
      const std::optional<std::string> attribute = bound.optional_string(1);
      List out;
      List seen;
      for (const Value& item : iterate(v)) {
        const Value key = sort_key(item, case_sensitive, attribute);
        if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, key); })) {
          continue;
        }
        seen.push_back(key);
        out.push_back(item);
      }
      return Value::list(std::move(out));
    };
    t["string"] = [](const Value& v, const CallArgs& a) {
      no_arguments("string", a);
      return Value(to_str(v));
    };
    t["sum"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("sum", a, {"attribute", "start"});
      const std::optional<std::string> attribute = bound.optional_string(0);
      Value total = bound.get(1, Value(int64_t{0}));
      for (const Value& item : iterate(v)) {
        total = binary_operation("+", total, attribute ? attribute_path(item, *attribute) : item);
      }
      return total;
    };
    t["tojson"] = tojson_filter;
    t["trim"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("trim", a, {"chars"});
      return Value(strip(to_str(v), bound.optional_string(0), true, true));
    };
    t["indent"] = indent_filter;
    return t;
  }();
  return table;
}

// jinja2's odd and even: value % 2 == 1 and value % 2 == 0 (so 2.5 is neither).
bool number_test(const Value& v, const CallArgs& a, const char* name, bool odd) {
  no_arguments(name, a);
  return equal(binary_operation("%", v, Value(int64_t{2})), Value(int64_t{odd ? 1 : 0}));
}

Test comparison(const char* op) {
  return [op](const Value& v, const CallArgs& a) {
    const BoundArguments bound(op, a, {"other"});
    const Value other = bound.required(0);
    const std::string spelled = op;
    if (spelled == "==") return equal(v, other);
    if (spelled == "!=") return !equal(v, other);
    return less(v, other, spelled);
  };
}

const std::map<std::string, Test>& tests() {
  static const std::map<std::string, Test> table = [] {
    std::map<std::string, Test> t;
    const auto kind_test = [](const char* name, std::function<bool(const Value&)> check) {
      return [name, check](const Value& v, const CallArgs& a) {
        no_arguments(name, a);
        return check(v);
      };
    };
    t["defined"] = kind_test("defined", [](const Value& v) { return !v.is_undefined(); });
    t["undefined"] = kind_test("undefined", [](const Value& v) { return v.is_undefined(); });
    t["none"] = kind_test("none", [](const Value& v) { return v.is_none(); });
    t["boolean"] =
        kind_test("boolean", [](const Value& v) { return v.kind() == Value::Kind::kBool; });
    t["true"] = kind_test(
        "true", [](const Value& v) { return v.kind() == Value::Kind::kBool && v.as_bool(); });
    t["false"] = kind_test(
        "false", [](const Value& v) { return v.kind() == Value::Kind::kBool && !v.as_bool(); });
    t["integer"] =
        kind_test("integer", [](const Value& v) { return v.kind() == Value::Kind::kInt; });
    t["float"] = kind_test("float", [](const Value& v) { return v.kind() == Value::Kind::kFloat; });
    t["number"] = kind_test("number", [](const Value& v) { return v.is_number(); });
    t["string"] = kind_test("string", [](const Value& v) { return v.is_string(); });
    t["mapping"] =
        kind_test("mapping", [](const Value& v) { return v.kind() == Value::Kind::kDict; });
    // jinja2's Undefined iterates (as empty), has a length and is callable (it raises when called).
    t["iterable"] = kind_test("iterable", [](const Value& v) {
      return v.is_undefined() || v.is_string() || v.kind() == Value::Kind::kList ||
             v.kind() == Value::Kind::kDict;
    });
    t["sequence"] = t["iterable"];
    t["callable"] = kind_test("callable", [](const Value& v) {
      return v.is_undefined() || v.kind() == Value::Kind::kCallable;
    });
    t["lower"] = kind_test("lower", [](const Value& v) {
      const std::string text = to_str(v);
      return lower(text) == text && upper(text) != text;
    });
    t["upper"] = kind_test("upper", [](const Value& v) {
      const std::string text = to_str(v);
      return upper(text) == text && lower(text) != text;
    });
    t["odd"] = [](const Value& v, const CallArgs& a) { return number_test(v, a, "odd", true); };
    t["even"] = [](const Value& v, const CallArgs& a) { return number_test(v, a, "even", false); };
    t["divisibleby"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("divisibleby", a, {"num"});
      const Value remainder = binary_operation("%", v, bound.required(0));
      return !truthy(remainder);
    };
    t["sameas"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("sameas", a, {"other"});
      const Value other = bound.required(0);
      if (v.kind() != other.kind()) return false;
      if (v.identity() != nullptr) return v.identity() == other.identity();
      return equal(v, other);
    };
    t["in"] = [](const Value& v, const CallArgs& a) {
      const BoundArguments bound("in", a, {"seq"});
      return contains(bound.required(0), v);
    };
    t["eq"] = t["equalto"] = t["=="] = comparison("==");
    t["ne"] = t["!="] = comparison("!=");
    t["lt"] = t["lessthan"] = t["<"] = comparison("<");
    t["le"] = t["<="] = comparison("<=");
    t["gt"] = t["greaterthan"] = t[">"] = comparison(">");
    t["ge"] = t[">="] = comparison(">=");
    return t;
  }();
  return table;
}

Value range_function(const CallArgs& args) {
  if (!args.keyword.empty()) throw RenderError("TypeError: range() takes no keyword arguments");
  const auto& p = args.positional;
  if (p.empty() || p.size() > 3) {
    throw RenderError("TypeError: range expected 1 to 3 arguments, got " +
                      std::to_string(p.size()));
  }
  for (const Value& v : p) {
    if (!v.is_integral()) {
      throw RenderError("TypeError: '" + type_name(v) +
                        "' object cannot be interpreted as an integer");
    }
  }
  const int64_t start = p.size() == 1 ? 0 : p[0].as_int();
  const int64_t stop = p.size() == 1 ? p[0].as_int() : p[1].as_int();
  const int64_t step = p.size() == 3 ? p[2].as_int() : 1;
  if (step == 0) throw RenderError("ValueError: range() arg 3 must not be zero");
  // The sandbox's limit (jinja2.sandbox.MAX_RANGE).
  constexpr int64_t kMaxRange = 100000;
  const long double span = (static_cast<long double>(stop) - start) / step;
  if (span > kMaxRange) {
    throw RenderError(
        "OverflowError: Range too big. The sandbox blocks ranges larger than "
        "MAX_RANGE (100000).");
  }
  List items;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) items.emplace_back(i);
  return Value::list(std::move(items));
}

// dict(mapping, **kwargs) as namespace() and dict() take it.
Dict dict_from_arguments(const char* function, const CallArgs& args) {
  if (args.positional.size() > 1) {
    throw RenderError(std::string("TypeError: ") + function + " expected at most 1 argument, got " +
                      std::to_string(args.positional.size()));
  }
  Dict dict;
  if (!args.positional.empty()) {
    const Value& source = args.positional[0];
    if (source.kind() == Value::Kind::kDict) {
      dict = source.as_dict();
    } else {
      for (const Value& pair : iterate(source)) {
        if (pair.kind() != Value::Kind::kList || pair.as_list().size() != 2) {
          throw RenderError(std::string("ValueError: ") + function +
                            " needs a mapping or pairs, got an item " + repr(pair));
        }
        dict.set(pair.as_list()[0], pair.as_list()[1]);
      }
    }
  }
  for (const auto& [key, value] : args.keyword) dict.set(Value(key), value);
  return dict;
}

Value strftime_now(const CallArgs& args) {
  const BoundArguments bound("strftime_now", args, {"format"});
  const Value format = bound.required(0);
  if (!format.is_string()) throw RenderError("TypeError: strftime_now() needs a format string");
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  std::string buffer(256 + format.as_string().size() * 8, '\0');
  const size_t written =
      std::strftime(buffer.data(), buffer.size(), format.as_string().c_str(), &local);
  buffer.resize(written);
  return Value(std::move(buffer));
}

}  // namespace

bool has_filter(const std::string& name) { return filters().count(name) != 0; }
bool has_test(const std::string& name) { return tests().count(name) != 0; }

Value apply_filter(const std::string& name, const Value& operand, const CallArgs& args) {
  return filters().at(name)(operand, args);
}

bool apply_test(const std::string& name, const Value& operand, const CallArgs& args) {
  return tests().at(name)(operand, args);
}

Value find_global(const std::string& name) {
  if (name == "range") return Value::callable("range", range_function);
  if (name == "namespace") {
    return Value::callable("namespace", [](const CallArgs& args) {
      return Value::new_namespace(dict_from_arguments("namespace", args));
    });
  }
  if (name == "dict") {
    return Value::callable("dict", [](const CallArgs& args) {
      return Value::dict(dict_from_arguments("dict", args));
    });
  }
  if (name == "raise_exception") {
    // transformers' raise_exception: the template's own message, which is for the user.
    return Value::callable("raise_exception", [](const CallArgs& args) -> Value {
      const BoundArguments bound("raise_exception", args, {"message"});
      throw InvalidArgument(to_str(bound.get(0, Value(""))));
    });
  }
  if (name == "strftime_now") return Value::callable("strftime_now", strftime_now);
  return Value::undefined("'" + name + "' is undefined");
}

}  // namespace quantmla::detail::jinja
