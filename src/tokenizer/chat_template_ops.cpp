#include "tokenizer/chat_template_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "tokenizer/chat_template_methods.h"
#include "tokenizer/chat_template_text.h"
#include "tokenizer/utf8.h"

namespace quantmla::detail::jinja {
namespace {

[[noreturn]] void unsupported(const std::string& op, const Value& a, const Value& b) {
  throw RenderError("TypeError: unsupported operand type(s) for " + op + ": '" + type_name(a) +
                    "' and '" + type_name(b) + "'");
}

void raise_if_undefined(const Value& value) {
  if (value.is_undefined()) throw RenderError(value.undefined_hint());
}

// Python's integers do not overflow; a template that needs more than 64 bits is refused rather
// than given a wrong number.
[[noreturn]] void overflow(const std::string& op) {
  throw RenderError("integer overflow in '" + op + "' (beyond 64 bits)");
}

int64_t add_int(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) overflow("+");
  return r;
}

int64_t sub_int(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_sub_overflow(a, b, &r)) overflow("-");
  return r;
}

int64_t mul_int(int64_t a, int64_t b, const char* op = "*") {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) overflow(op);
  return r;
}

int64_t int_power(int64_t base, int64_t exponent) {
  int64_t result = 1;
  while (exponent > 0) {
    if (exponent & 1) result = mul_int(result, base, "**");
    exponent >>= 1;
    if (exponent > 0) base = mul_int(base, base, "**");
  }
  return result;
}

// Python's float % and //: the remainder takes the divisor's sign.
double float_mod(double a, double b) {
  double mod = std::fmod(a, b);
  if (mod != 0) {
    if ((b < 0) != (mod < 0)) mod += b;
  } else {
    mod = std::copysign(0.0, b);
  }
  return mod;
}

double float_floor_div(double a, double b) {
  const double mod = std::fmod(a, b);
  double div = (a - mod) / b;
  if (mod != 0 && (b < 0) != (mod < 0)) div -= 1.0;
  if (div != 0) {
    const double floor_div = std::floor(div);
    return div - floor_div > 0.5 ? floor_div + 1.0 : floor_div;
  }
  return std::copysign(0.0, a / b);
}

Value numeric_operation(const std::string& op, const Value& a, const Value& b) {
  const bool integers = a.is_integral() && b.is_integral();
  if (integers) {
    const int64_t x = a.as_int();
    const int64_t y = b.as_int();
    if (op == "+") return Value(add_int(x, y));
    if (op == "-") return Value(sub_int(x, y));
    if (op == "*") return Value(mul_int(x, y));
    if (op == "//" || op == "%") {
      if (y == 0) throw RenderError("ZeroDivisionError: integer division or modulo by zero");
      if (x == std::numeric_limits<int64_t>::min() && y == -1) {
        if (op == "%") return Value(int64_t{0});
        overflow(op);
      }
      int64_t quotient = x / y;
      int64_t remainder = x % y;
      if (remainder != 0 && ((remainder < 0) != (y < 0))) {
        --quotient;
        remainder += y;
      }
      return Value(op == "//" ? quotient : remainder);
    }
    if (op == "**" && y >= 0) return Value(int_power(x, y));
  }
  const double x = a.as_float();
  const double y = b.as_float();
  if (op == "+") return Value(x + y);
  if (op == "-") return Value(x - y);
  if (op == "*") return Value(x * y);
  if (op == "/") {
    if (y == 0) throw RenderError("ZeroDivisionError: division by zero");
    return Value(x / y);
  }
  if (op == "//") {
    if (y == 0) throw RenderError("ZeroDivisionError: float floor division by zero");
    return Value(float_floor_div(x, y));
  }
  if (op == "%") {
    if (y == 0) throw RenderError("ZeroDivisionError: float modulo");
    return Value(float_mod(x, y));
  }
  if (op == "**") {
    if (x == 0 && y < 0) {
      throw RenderError("ZeroDivisionError: 0.0 cannot be raised to a negative power");
    }
    if (x < 0 && y != std::floor(y)) {
      throw RenderError(
          "a negative number to a fractional power is complex, which templates "
          "do not have");
    }
    return Value(std::pow(x, y));
  }
  unsupported(op, a, b);
}

Value repeat(const Value& sequence, int64_t times) {
  const bool string = sequence.is_string();
  const size_t length = string ? sequence.as_string().size() : sequence.as_list().size();
  // Nothing to repeat, or no times: empty at once (not a loop of up to 2^63 empty appends).
  const int64_t copies = length == 0 ? 0 : std::max<int64_t>(times, 0);
  check_built_size(static_cast<long double>(length) * static_cast<long double>(copies), string);
  if (string) {
    std::string out;
    out.reserve(length * static_cast<size_t>(copies));
    for (int64_t i = 0; i < copies; ++i) out += sequence.as_string();
    return Value(std::move(out));
  }
  List items;
  items.reserve(length * static_cast<size_t>(copies));
  for (int64_t i = 0; i < copies; ++i) {
    items.insert(items.end(), sequence.as_list().begin(), sequence.as_list().end());
  }
  return Value::list(std::move(items), sequence.is_tuple());
}

// printf-style "text % args" for the conversions templates use: %s, %r, %d/%i and %%. A tuple
// gives one argument per conversion; anything else is the one argument, and Python does not
// complain that a list, dict or undefined (mapping-like to it) went unused.
Value format_percent(const std::string& format, const Value& args) {
  const List arguments = args.is_tuple() ? args.as_list() : List{args};
  const bool mapping_like =
      !args.is_tuple() && (args.kind() == Value::Kind::kList || args.kind() == Value::Kind::kDict ||
                           args.is_undefined());
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out.push_back(format[i]);
      continue;
    }
    if (i + 1 >= format.size()) throw RenderError("ValueError: incomplete format");
    const char conversion = format[++i];
    if (conversion == '%') {
      out.push_back('%');
      continue;
    }
    if (next >= arguments.size()) {
      throw RenderError("TypeError: not enough arguments for format string");
    }
    const Value& argument = arguments[next++];
    if (conversion == 's') {
      out += to_str(argument);
    } else if (conversion == 'r') {
      out += repr(argument);
    } else if (conversion == 'd' || conversion == 'i') {
      if (!argument.is_number()) {
        throw RenderError("TypeError: %" + std::string(1, conversion) +
                          " format: a real number is required, not " + type_name(argument));
      }
      out += std::to_string(argument.kind() == Value::Kind::kFloat
                                ? static_cast<int64_t>(std::trunc(argument.as_float()))
                                : argument.as_int());
    } else {
      throw RenderError(std::string("unsupported format character '") + conversion +
                        "' (supported: %s %r %d %i %%)");
    }
  }
  if (next < arguments.size() && !mapping_like) {
    throw RenderError("TypeError: not all arguments converted during string formatting");
  }
  return Value(std::move(out));
}

// Python's slice.indices(): the start, stop and step a slice visits in a sequence of `length`.
void slice_indices(const Value& start, const Value& stop, const Value& step, int64_t length,
                   int64_t& first, int64_t& last, int64_t& stride) {
  const auto index = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    if (!v.is_integral()) {
      throw RenderError(std::string("TypeError: slice ") + what +
                        " must be an integer or None, not " + type_name(v));
    }
    return v.as_int();
  };
  stride = index(step, "step").value_or(1);
  if (stride == 0) throw RenderError("ValueError: slice step cannot be zero");
  const auto clamp = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v) return fallback;
    int64_t i = *v;
    if (i < 0) {
      i += length;
      if (i < 0) i = stride < 0 ? -1 : 0;
    } else if (i >= length) {
      i = stride < 0 ? length - 1 : length;
    }
    return i;
  };
  first = clamp(index(start, "start"), stride < 0 ? length - 1 : 0);
  last = clamp(index(stop, "stop"), stride < 0 ? -1 : length);
}

}  // namespace

Value binary_operation(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") {
    std::string left = to_str(a);
    const std::string right = to_str(b);
    check_built_size(static_cast<long double>(left.size()) + right.size(), true);
    return Value(left + right);
  }
  raise_if_undefined(a);
  if (op == "%" && a.is_string()) return format_percent(a.as_string(), b);
  raise_if_undefined(b);
  if (a.is_number() && b.is_number()) return numeric_operation(op, a, b);
  if (op == "+") {
    if (a.is_string()) {
      if (!b.is_string()) {
        throw RenderError("TypeError: can only concatenate str (not \"" + type_name(b) +
                          "\") to str");
      }
      check_built_size(static_cast<long double>(a.as_string().size()) + b.as_string().size(), true);
      return Value(a.as_string() + b.as_string());
    }
    if (a.kind() == Value::Kind::kList) {
      if (b.kind() != Value::Kind::kList || a.is_tuple() != b.is_tuple()) {
        throw RenderError("TypeError: can only concatenate " + type_name(a) + " (not \"" +
                          type_name(b) + "\") to " + type_name(a));
      }
      check_built_size(static_cast<long double>(a.as_list().size()) + b.as_list().size(), false);
      List items = a.as_list();
      items.insert(items.end(), b.as_list().begin(), b.as_list().end());
      return Value::list(std::move(items), a.is_tuple());
    }
  }
  if (op == "*") {
    const bool a_sequence = a.is_string() || a.kind() == Value::Kind::kList;
    const bool b_sequence = b.is_string() || b.kind() == Value::Kind::kList;
    if (a_sequence && b.is_integral()) return repeat(a, b.as_int());
    if (b_sequence && a.is_integral()) return repeat(b, a.as_int());
  }
  unsupported(op, a, b);
}

Value unary_operation(const std::string& op, const Value& a) {
  raise_if_undefined(a);
  if (a.is_integral()) {
    if (op == "+") return Value(a.as_int());
    return Value(sub_int(0, a.as_int()));
  }
  if (a.kind() == Value::Kind::kFloat) return Value(op == "-" ? -a.as_float() : a.as_float());
  throw RenderError("TypeError: bad operand type for unary " + op + ": '" + type_name(a) + "'");
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kUndefined:
      return false;  // jinja2's Undefined iterates as empty
    case Value::Kind::kString:
      if (!item.is_string()) {
        throw RenderError("TypeError: 'in <string>' requires string as left operand, not " +
                          type_name(item));
      }
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kList:
      for (const Value& element : container.as_list()) {
        if (equal(element, item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      return container.as_dict().find(item) != nullptr;
    default:
      throw RenderError("TypeError: argument of type '" + type_name(container) +
                        "' is not iterable");
  }
}

Value get_attribute(const Value& object, const std::string& name) {
  raise_if_undefined(object);
  if (object.kind() == Value::Kind::kNamespace) {
    if (const Value* found = object.namespace_attributes().find(name)) return *found;
    return Value::undefined("'Namespace object' has no attribute '" + name + "'");
  }
  Value method = find_method(object, name);
  if (!method.is_undefined()) return method;
  if (object.kind() == Value::Kind::kDict) {
    if (const Value* found = object.as_dict().find(name)) return *found;
    return Value::undefined("'dict object' has no attribute '" + name + "'");
  }
  if (object.is_none()) return Value::undefined("'None' has no attribute '" + name + "'");
  return method;
}

Value get_item(const Value& object, const Value& key) {
  raise_if_undefined(object);
  switch (object.kind()) {
    case Value::Kind::kDict:
      if (const Value* found = object.as_dict().find(key)) return *found;
      break;
    case Value::Kind::kList:
    case Value::Kind::kString:
      if (key.is_integral()) {
        const bool text = object.is_string();
        const std::u32string points = text ? decode_utf8(object.as_string()) : std::u32string();
        const int64_t length = static_cast<int64_t>(text ? points.size() : object.as_list().size());
        int64_t index = key.as_int();
        if (index < 0) index += length;
        if (index < 0 || index >= length) {
          return Value::undefined(object_description(object) + " has no element " +
                                  std::to_string(key.as_int()));
        }
        if (!text) return object.as_list()[static_cast<size_t>(index)];
        return Value(encode_utf8(std::u32string(1, points[static_cast<size_t>(index)])));
      }
      break;
    case Value::Kind::kNamespace:
      if (key.is_string()) return get_attribute(object, key.as_string());
      break;
    default:
      break;
  }
  // jinja2 falls back to the attribute of that name: d['items'] is the method when there is no
  // 'items' key.
  if (key.is_string()) {
    Value method = find_method(object, key.as_string());
    if (!method.is_undefined()) return method;
    if (object.kind() == Value::Kind::kDict) {
      return Value::undefined("'dict object' has no attribute '" + key.as_string() + "'");
    }
    return method;
  }
  return Value::undefined(object_description(object) + " has no element " + repr(key));
}

Value get_slice(const Value& object, const Value& start, const Value& stop, const Value& step) {
  raise_if_undefined(object);
  // jinja2 compiles a slice to Python's own subscript, so a bad object raises (no undefined).
  if (object.kind() == Value::Kind::kDict) throw RenderError("TypeError: unhashable type: 'slice'");
  if (object.kind() != Value::Kind::kList && !object.is_string()) {
    throw RenderError("TypeError: '" + type_name(object) + "' object is not subscriptable");
  }
  const bool text = object.is_string();
  const std::u32string points = text ? decode_utf8(object.as_string()) : std::u32string();
  const int64_t length = static_cast<int64_t>(text ? points.size() : object.as_list().size());
  int64_t first = 0;
  int64_t last = 0;
  int64_t stride = 1;
  slice_indices(start, stop, step, length, first, last, stride);
  if (text) {
    std::u32string out;
    for (int64_t i = first; stride > 0 ? i < last : i > last; i += stride) {
      out.push_back(points[static_cast<size_t>(i)]);
    }
    return Value(encode_utf8(out));
  }
  List out;
  for (int64_t i = first; stride > 0 ? i < last : i > last; i += stride) {
    out.push_back(object.as_list()[static_cast<size_t>(i)]);
  }
  return Value::list(std::move(out), object.is_tuple());
}

List iterate(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
      return value.as_list();
    case Value::Kind::kDict: {
      List keys;
      for (const auto& entry : value.as_dict().entries) keys.push_back(entry.first);
      return keys;
    }
    case Value::Kind::kString: {
      List characters;
      const std::string& text = value.as_string();
      size_t pos = 0;
      while (pos < text.size()) {
        const size_t begin = pos;
        next_code_point(text, pos);
        characters.emplace_back(text.substr(begin, pos - begin));
      }
      return characters;
    }
    default:
      throw RenderError("TypeError: '" + type_name(value) + "' object is not iterable");
  }
}

Value call_value(const Value& callee, const CallArgs& args) {
  raise_if_undefined(callee);
  if (callee.kind() != Value::Kind::kCallable) {
    throw RenderError("TypeError: '" + type_name(callee) + "' object is not callable");
  }
  return callee.as_callable().call(args);
}

}  // namespace quantmla::detail::jinja
