// Binds the arguments of a builtin (filter, test, method, global) to its parameter names the way
// Python does, so templates may pass them by position or by keyword.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/chat_template_value.h"

namespace quantmla::detail::jinja {

// For builtins without parameters: raises RenderError when given any argument.
inline void no_arguments(const std::string& function, const CallArgs& args) {
  if (!args.positional.empty() || !args.keyword.empty()) {
    throw RenderError("TypeError: " + function + "() takes no arguments (" +
                      std::to_string(args.positional.size() + args.keyword.size()) + " given)");
  }
}

class BoundArguments {
 public:
  // Raises RenderError for more positionals than parameters, an unknown keyword or a parameter
  // given twice. `function` names the builtin in the messages.
  BoundArguments(std::string function, const CallArgs& args,
                 std::initializer_list<std::string_view> parameters)
      : function_(std::move(function)), names_(parameters.begin(), parameters.end()) {
    values_.resize(names_.size());
    if (args.positional.size() > names_.size()) {
      throw RenderError("TypeError: " + function_ + "() takes at most " +
                        std::to_string(names_.size()) + " argument(s), " +
                        std::to_string(args.positional.size()) + " given");
    }
    for (size_t i = 0; i < args.positional.size(); ++i) values_[i] = args.positional[i];
    for (const auto& [key, value] : args.keyword) {
      size_t i = 0;
      while (i < names_.size() && names_[i] != key) ++i;
      if (i == names_.size()) {
        throw RenderError("TypeError: " + function_ + "() got an unexpected keyword argument '" +
                          key + "'");
      }
      if (values_[i]) {
        throw RenderError("TypeError: " + function_ + "() got multiple values for argument '" +
                          key + "'");
      }
      values_[i] = value;
    }
  }

  bool given(size_t i) const { return values_[i].has_value(); }
  Value get(size_t i, Value fallback = Value::none()) const {
    return values_[i] ? *values_[i] : fallback;
  }
  Value required(size_t i) const {
    if (!values_[i]) {
      throw RenderError("TypeError: " + function_ + "() missing required argument '" +
                        std::string(names_[i]) + "'");
    }
    return *values_[i];
  }
  // A str argument, or absent/None.
  std::optional<std::string> optional_string(size_t i) const {
    if (!values_[i] || values_[i]->is_none()) return std::nullopt;
    if (!values_[i]->is_string()) throw wrong_type(i, "str");
    return values_[i]->as_string();
  }
  std::string string(size_t i, std::string fallback) const {
    return optional_string(i).value_or(std::move(fallback));
  }
  int64_t integer(size_t i, int64_t fallback) const {
    if (!values_[i] || values_[i]->is_none()) return fallback;
    if (!values_[i]->is_integral()) throw wrong_type(i, "int");
    return values_[i]->as_int();
  }

 private:
  RenderError wrong_type(size_t i, const char* expected) const {
    return RenderError("TypeError: " + function_ + "() argument '" + std::string(names_[i]) +
                       "' must be " + expected + ", not " + type_name(*values_[i]));
  }

  std::string function_;
  std::vector<std::string_view> names_;
  std::vector<std::optional<Value>> values_;
};

}  // namespace quantmla::detail::jinja
