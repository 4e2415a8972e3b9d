// The Python methods templates call on values: str (strip, split, startswith, ...), dict (get,
// items, keys, values) and list (count, index). Mutating methods are refused as transformers'
// ImmutableSandboxedEnvironment refuses them.
#pragma once

#include <string>

#include "tokenizer/chat_template_value.h"

namespace quantmla::detail::jinja {

// `object.name` bound as a callable, or undefined when the object's type has no such method.
Value find_method(const Value& object, const std::string& name);

}  // namespace quantmla::detail::jinja
