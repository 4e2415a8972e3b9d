#include "tokenizer/chat_template_methods.h"

#include <algorithm>
#include <map>

#include "tokenizer/chat_template_args.h"
#include "tokenizer/chat_template_ops.h"
#include "tokenizer/chat_template_text.h"

namespace quantmla::detail::jinja {
namespace {

using Method = Value (*)(const Value& self, const CallArgs& args);

std::string method_name(const Value& self, const char* name) {
  return type_name(self) + "." + name;
}

Value strings_to_list(const std::vector<std::string>& parts) {
  List items;
  items.reserve(parts.size());
  for (const std::string& part : parts) items.emplace_back(part);
  return Value::list(std::move(items));
}

Value strip_method(const Value& self, const CallArgs& args, const char* name, bool left,
                   bool right) {
  const BoundArguments bound(method_name(self, name), args, {"chars"});
  return Value(strip(self.as_string(), bound.optional_string(0), left, right));
}

Value split_method(const Value& self, const CallArgs& args, const char* name, bool from_right) {
  const BoundArguments bound(method_name(self, name), args, {"sep", "maxsplit"});
  return strings_to_list(
      split(self.as_string(), bound.optional_string(0), bound.integer(1, -1), from_right));
}

// startswith/endswith take a string or a tuple of strings.
Value affix_method(const Value& self, const CallArgs& args, const char* name, bool prefix) {
  const BoundArguments bound(method_name(self, name), args, {"affix"});
  const Value affix = bound.required(0);
  List candidates;
  if (affix.is_tuple()) {
    candidates = affix.as_list();
  } else {
    candidates.push_back(affix);
  }
  const std::string& text = self.as_string();
  for (const Value& candidate : candidates) {
    if (!candidate.is_string()) {
      throw RenderError("TypeError: " + std::string(name) +
                        " first arg must be str or a tuple of str, not " + type_name(candidate));
    }
    const std::string& part = candidate.as_string();
    if (part.size() > text.size()) continue;
    if (prefix ? text.compare(0, part.size(), part) == 0
               : text.compare(text.size() - part.size(), part.size(), part) == 0) {
      return Value(true);
    }
  }
  return Value(false);
}

// find/rfind: the code point index of the first (last) occurrence, or -1.
Value find_method_impl(const Value& self, const CallArgs& args, const char* name, bool last) {
  const BoundArguments bound(method_name(self, name), args, {"sub"});
  const Value part = bound.required(0);
  if (!part.is_string()) {
    throw RenderError("TypeError: must be str, not " + type_name(part));
  }
  const std::string& text = self.as_string();
  const size_t found = last ? text.rfind(part.as_string()) : text.find(part.as_string());
  if (found == std::string::npos) return Value(int64_t{-1});
  return Value(static_cast<int64_t>(code_point_count(std::string_view(text).substr(0, found))));
}

const std::map<std::string, Method>& string_methods() {
  static const std::map<std::string, Method> methods = {
      {"strip",
       [](const Value& s, const CallArgs& a) { return strip_method(s, a, "strip", true, true); }},
      {"lstrip",
       [](const Value& s, const CallArgs& a) { return strip_method(s, a, "lstrip", true, false); }},
      {"rstrip",
       [](const Value& s, const CallArgs& a) { return strip_method(s, a, "rstrip", false, true); }},
      {"split",
       [](const Value& s, const CallArgs& a) { return split_method(s, a, "split", false); }},
      {"rsplit",
       [](const Value& s, const CallArgs& a) { return split_method(s, a, "rsplit", true); }},
      {"startswith",
       [](const Value& s, const CallArgs& a) { return affix_method(s, a, "startswith", true); }},
      {"endswith",
       [](const Value& s, const CallArgs& a) { return affix_method(s, a, "endswith", false); }},
      {"find",
       [](const Value& s, const CallArgs& a) { return find_method_impl(s, a, "find", false); }},
      {"rfind",
       [](const Value& s, const CallArgs& a) { return find_method_impl(s, a, "rfind", true); }},
      {"replace",
       [](const Value& s, const CallArgs& a) {
         const BoundArguments bound("str.replace", a, {"old", "new", "count"});
         const Value old = bound.required(0);
         const Value replacement = bound.required(1);
         if (!old.is_string() || !replacement.is_string()) {
           throw RenderError("TypeError: replace() arguments must be str, not " +
                             type_name(old.is_string() ? replacement : old));
         }
         return Value(replace(s.as_string(), old.as_string(), replacement.as_string(),
                              bound.integer(2, -1)));
       }},
      {"count",
       [](const Value& s, const CallArgs& a) {
         const BoundArguments bound("str.count", a, {"sub"});
         const Value part = bound.required(0);
         if (!part.is_string()) throw RenderError("TypeError: must be str, not " + type_name(part));
         return Value(count(s.as_string(), part.as_string()));
       }},
      {"join",
       [](const Value& s, const CallArgs& a) {
         const BoundArguments bound("str.join", a, {"iterable"});
         std::string out;
         size_t i = 0;
         for (const Value& item : iterate(bound.required(0))) {
           if (!item.is_string()) {
             throw RenderError("TypeError: sequence item " + std::to_string(i) +
                               ": expected str instance, " + type_name(item) + " found");
           }
           if (i++ > 0) out += s.as_string();
           out += item.as_string();
         }
         return Value(std::move(out));
       }},
      {"upper",
       [](const Value& s, const CallArgs& a) {
         no_arguments("str.upper", a);
         return Value(upper(s.as_string()));
       }},
      {"lower",
       [](const Value& s, const CallArgs& a) {
         no_arguments("str.lower", a);
         return Value(lower(s.as_string()));
       }},
      {"title",
       [](const Value& s, const CallArgs& a) {
         no_arguments("str.title", a);
         return Value(title(s.as_string()));
       }},
      {"capitalize",
       [](const Value& s, const CallArgs& a) {
         no_arguments("str.capitalize", a);
         return Value(capitalize(s.as_string()));
       }},
      {"splitlines",
       [](const Value& s, const CallArgs& a) {
         const BoundArguments bound("str.splitlines", a, {"keepends"});
         const bool keep = truthy(bound.get(0, Value(false)));
         // Line boundaries of the normalized text chat templates see: "\n" and "\r\n", "\r".
         std::vector<std::string> lines;
         const std::string& text = s.as_string();
         size_t begin = 0;
         for (size_t i = 0; i < text.size(); ++i) {
           if (text[i] != '\n' && text[i] != '\r') continue;
           size_t end = i + 1;
           if (text[i] == '\r' && end < text.size() && text[end] == '\n') ++end;
           lines.push_back(text.substr(begin, (keep ? end : i) - begin));
           begin = end;
           i = end - 1;
         }
         if (begin < text.size()) lines.push_back(text.substr(begin));
         return strings_to_list(lines);
       }},
      {"isdigit",
       [](const Value& s, const CallArgs& a) {
         no_arguments("str.isdigit", a);
         const std::string& text = s.as_string();
         return Value(!text.empty() && std::all_of(text.begin(), text.end(),
                                                   [](char c) { return c >= '0' && c <= '9'; }));
       }},
      {"isspace",
       [](const Value& s, const CallArgs& a) {
         no_arguments("str.isspace", a);
         const std::u32string text = decode_utf8(s.as_string());
         return Value(!text.empty() && std::all_of(text.begin(), text.end(), is_python_space));
       }},
  };
  return methods;
}

const std::map<std::string, Method>& dict_methods() {
  static const std::map<std::string, Method> methods = {
      {"get",
       [](const Value& d, const CallArgs& a) {
         const BoundArguments bound("dict.get", a, {"key", "default"});
         const Value* found = d.as_dict().find(bound.required(0));
         return found ? *found : bound.get(1);
       }},
      {"items",
       [](const Value& d, const CallArgs& a) {
         no_arguments("dict.items", a);
         List items;
         for (const auto& [key, value] : d.as_dict().entries) {
           items.push_back(Value::list({key, value}, true));
         }
         return Value::list(std::move(items));
       }},
      {"keys",
       [](const Value& d, const CallArgs& a) {
         no_arguments("dict.keys", a);
         List keys;
         for (const auto& entry : d.as_dict().entries) keys.push_back(entry.first);
         return Value::list(std::move(keys));
       }},
      {"values",
       [](const Value& d, const CallArgs& a) {
         no_arguments("dict.values", a);
         List values;
         for (const auto& entry : d.as_dict().entries) values.push_back(entry.second);
         return Value::list(std::move(values));
       }},
  };
  return methods;
}

const std::map<std::string, Method>& list_methods() {
  static const std::map<std::string, Method> methods = {
      {"count",
       [](const Value& l, const CallArgs& a) {
         const BoundArguments bound("list.count", a, {"value"});
         const Value item = bound.required(0);
         const List& items = l.as_list();
         return Value(static_cast<int64_t>(std::count_if(
             items.begin(), items.end(), [&](const Value& v) { return equal(v, item); })));
       }},
      {"index",
       [](const Value& l, const CallArgs& a) {
         const BoundArguments bound("list.index", a, {"value"});
         const Value item = bound.required(0);
         const List& items = l.as_list();
         for (size_t i = 0; i < items.size(); ++i) {
           if (equal(items[i], item)) return Value(static_cast<int64_t>(i));
         }
         throw RenderError("ValueError: " + repr(item) + " is not in list");
       }},
  };
  return methods;
}

bool is_mutating(const Value& object, const std::string& name) {
  static const std::vector<std::string> list_names = {"append", "extend", "insert", "pop",
                                                      "remove", "clear",  "sort",   "reverse"};
  static const std::vector<std::string> dict_names = {"clear", "pop", "popitem", "setdefault",
                                                      "update"};
  const auto& names = object.kind() == Value::Kind::kDict ? dict_names : list_names;
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

Value find_method(const Value& object, const std::string& name) {
  const std::map<std::string, Method>* methods = nullptr;
  switch (object.kind()) {
    case Value::Kind::kString:
      methods = &string_methods();
      break;
    case Value::Kind::kDict:
      methods = &dict_methods();
      break;
    case Value::Kind::kList:
      methods = &list_methods();
      break;
    default:
      return Value::undefined(object_description(object) + " has no attribute '" + name + "'");
  }
  const auto it = methods->find(name);
  if (it != methods->end()) {
    const Method method = it->second;
    return Value::callable(type_name(object) + "." + name,
                           [object, method](const CallArgs& args) { return method(object, args); });
  }
  if (object.kind() != Value::Kind::kString && is_mutating(object, name)) {
    const std::string message = "SecurityError: access to attribute '" + name + "' of '" +
                                type_name(object) + "' object is unsafe.";
    return Value::callable(name,
                           [message](const CallArgs&) -> Value { throw RenderError(message); });
  }
  return Value::undefined(object_description(object) + " has no attribute '" + name + "'");
}

}  // namespace quantmla::detail::jinja
