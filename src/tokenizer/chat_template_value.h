// The values a chat template computes with, and the Python semantics jinja2 gives them: truthiness,
// str() and repr(), equality and ordering. Templates were written against Python, so every rule
// here is Python's (bool is an int, 1 == 1.0, None renders "None", dicts keep insertion order).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace quantmla::detail::jinja {

// A Python exception raised while rendering (TypeError, UndefinedError, ...). The renderer turns it
// into InvalidArgument with the template position of the expression that raised it.
class RenderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Value;
using List = std::vector<Value>;
struct Dict;

// Positional and keyword arguments of a call, a filter or a test (the operand excluded).
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// A function value: a global (range, namespace), a bound method ('x'.strip), a macro.
struct Callable {
  std::string name;
  std::function<Value(const CallArgs&)> call;
};

class Value {
 public:
  enum class Kind : uint8_t {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,       // a Python list, or a tuple (is_tuple)
    kDict,       // insertion-ordered, immutable once built (the sandbox forbids mutation)
    kNamespace,  // jinja2's namespace(): mutable attributes, shared by every copy
    kCallable,
  };

  // Undefined. `hint` is jinja2's message for using it ("'x' is undefined").
  Value() = default;
  static Value undefined(std::string hint);
  static Value none();
  Value(bool value);  // NOLINT: implicit, like Python's literals
  Value(int64_t value);
  Value(int value) : Value(static_cast<int64_t>(value)) {}
  Value(double value);
  Value(std::string value);
  Value(const char* value) : Value(std::string(value)) {}
  // Lists and dicts nest at most kMaxNesting deep (RenderError, Python's RecursionError, past
  // it): what prints, compares, dumps or frees them recurses once a level, and a value nested
  // thousands deep (a client's messages, a template's loop) would exhaust the stack.
  static constexpr int kMaxNesting = 512;
  static Value list(List items, bool tuple = false);
  static Value dict(Dict items);
  static Value new_namespace(Dict attributes);
  static Value callable(std::string name, std::function<Value(const CallArgs&)> call);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_tuple() const { return kind_ == Kind::kList && tuple_; }
  // bool, int or float: what Python's numbers.Number admits.
  bool is_number() const {
    return kind_ == Kind::kBool || kind_ == Kind::kInt || kind_ == Kind::kFloat;
  }
  // bool or int: usable as an index or a count.
  bool is_integral() const { return kind_ == Kind::kBool || kind_ == Kind::kInt; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }  // also a bool's 0/1
  double as_float() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& as_string() const { return string_; }
  const std::string& undefined_hint() const { return string_; }
  const List& as_list() const { return *list_; }
  const Dict& as_dict() const { return *dict_; }
  Dict& namespace_attributes() const { return *dict_; }
  const Callable& as_callable() const { return *callable_; }
  int nesting() const { return nesting_; }
  // Identity of a namespace or callable, for `is sameas` and ==.
  const void* identity() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool tuple_ = false;
  uint16_t nesting_ = 0;  // lists and dicts: 1 + the deepest item's (a namespace's count as 0)
  int64_t int_ = 0;
  double float_ = 0;
  std::string string_;  // the string, or an undefined's hint
  std::shared_ptr<const List> list_;
  std::shared_ptr<Dict> dict_;  // const by convention for kDict
  std::shared_ptr<const Callable> callable_;
};

struct Dict {
  std::vector<std::pair<Value, Value>> entries;

  const Value* find(const Value& key) const;
  const Value* find(const std::string& key) const;
  // Python's d[key] = value: a new key goes last, an existing one keeps its place.
  void set(Value key, Value value);
};

// Throws RenderError (Python's MemoryError) for a string (bytes) or list (items) of more than
// 2^24: Python would try to build it and fail at some point; a template (from a model's files)
// that builds one past any sane prompt is refused at once instead of hanging the renderer.
void check_built_size(long double size, bool string);

// Python's type name ("int", "str", "NoneType"), for error messages like Python's.
std::string type_name(const Value& value);
// jinja2's name of a value's type in undefined-value messages: "'dict object'".
std::string object_description(const Value& value);
bool truthy(const Value& value);
// str(value) as jinja2 renders it: undefined is "", None "None", True "True", floats as repr().
std::string to_str(const Value& value);
// repr(value): strings quoted as Python quotes them, containers with their elements' repr.
std::string repr(const Value& value);
// Python ==. Never throws: values of unrelated types are unequal.
bool equal(const Value& a, const Value& b);
// Python's <, <=, >, >= for numbers, strings and lists/tuples; anything else raises TypeError.
// `op` is the operator's spelling, for the message.
bool less(const Value& a, const Value& b, const std::string& op);

// A JSON document as template values. Objects keep the order the JSON type has them in: sorted for
// nlohmann::json, as written for nlohmann::ordered_json. Throws RenderError for a string that is
// not valid UTF-8.
Value from_json(const nlohmann::json& json);
Value from_json(const nlohmann::ordered_json& json);

// Python's repr() of a float ("1.0", "0.30000000000000004", "1e+16", "inf").
std::string float_repr(double value);

}  // namespace quantmla::detail::jinja
