// The filters, tests and global functions chat templates call, with jinja2's (and, for tojson and
// raise_exception, transformers') behaviour.
#pragma once

#include <string>

#include "tokenizer/chat_template_value.h"

namespace quantmla::detail::jinja {

bool has_filter(const std::string& name);
bool has_test(const std::string& name);
// operand | name(args). Raises RenderError for a bad operand or argument.
Value apply_filter(const std::string& name, const Value& operand, const CallArgs& args);
// operand is name(args).
bool apply_test(const std::string& name, const Value& operand, const CallArgs& args);
// range, namespace, dict, raise_exception, strftime_now; undefined for any other name.
Value find_global(const std::string& name);

}  // namespace quantmla::detail::jinja
