// Checked access to tokenizer.json fields: a missing or mistyped field becomes a FormatError that
// names the component it belongs to.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "quantmla/error.h"

namespace quantmla::detail {

// The field `key` of object `owner`; `where` names the owner in the message (e.g. "model").
inline const nlohmann::json& require_field(const nlohmann::json& owner, std::string_view key,
                                           std::string_view where) {
  if (!owner.is_object()) {
    throw FormatError(std::string(where) + " must be an object, got " + owner.type_name());
  }
  const auto it = owner.find(key);
  if (it == owner.end()) {
    throw FormatError(std::string(where) + " has no field '" + std::string(key) + "'");
  }
  return *it;
}

inline std::string require_string(const nlohmann::json& owner, std::string_view key,
                                  std::string_view where) {
  const nlohmann::json& value = require_field(owner, key, where);
  if (!value.is_string()) {
    throw FormatError(std::string(where) + "." + std::string(key) + " must be a string, got " +
                      value.type_name());
  }
  return value.get<std::string>();
}

// A boolean field that may be absent or null, in which case Hugging Face's default applies.
inline bool optional_bool(const nlohmann::json& owner, std::string_view key, bool default_value,
                          std::string_view where) {
  const auto it = owner.find(key);
  if (it == owner.end() || it->is_null()) return default_value;
  if (!it->is_boolean()) {
    throw FormatError(std::string(where) + "." + std::string(key) + " must be a boolean, got " +
                      it->type_name());
  }
  return it->get<bool>();
}

}  // namespace quantmla::detail
