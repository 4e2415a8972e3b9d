// Python's operators on template values, and jinja2's (sandboxed) attribute and item lookup.
// Everything that Python would raise for raises RenderError with Python's message.
#pragma once

#include <string>

#include "tokenizer/chat_template_value.h"

namespace quantmla::detail::jinja {

// a op b for + - * / // % ** ~.
Value binary_operation(const std::string& op, const Value& a, const Value& b);
// -a and +a.
Value unary_operation(const std::string& op, const Value& a);
// item in container.
bool contains(const Value& container, const Value& item);
// a.name: a method of the object (a dict's get/items/..., a string's strip/split/...) first, then a
// dict key or namespace attribute; undefined when there is neither. Raises on an undefined `a`.
Value get_attribute(const Value& object, const std::string& name);
// a[key]: a dict key, a list/tuple/string index (negative from the end) first, then a method of
// that name; undefined when there is neither. Raises on an undefined `a`.
Value get_item(const Value& object, const Value& key);
// a[start:stop:step], any part none when left out; for lists, tuples and strings (raises for
// anything else, as Python does).
Value get_slice(const Value& object, const Value& start, const Value& stop, const Value& step);
// The items a for loop visits: a list's elements, a dict's keys, a string's characters, nothing
// for undefined. Raises for anything else ("'int' object is not iterable").
List iterate(const Value& value);
// callee(args). Raises for a value that cannot be called.
Value call_value(const Value& callee, const CallArgs& args);

}  // namespace quantmla::detail::jinja
