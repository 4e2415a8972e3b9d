#include "tokenizer/pre_tokenizer.h"

#include <string>

#include "quantmla/error.h"
#include "tokenizer/json_fields.h"

namespace quantmla::detail {
namespace {

// The GPT-2 pattern that ByteLevel(use_regex = true) splits with.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

PreTokenizer::PreTokenizer(const nlohmann::json& spec) {
  if (spec.is_null()) {
    throw FormatError("pre_tokenizer is null; only byte-level pre-tokenization is supported");
  }
  const std::string type = require_string(spec, "type", "pre_tokenizer");
  if (type == "ByteLevel") {
    add_byte_level(spec, "pre_tokenizer");
    return;
  }
  if (type != "Sequence") {
    throw FormatError("unsupported pre_tokenizer type '" + type +
                      "' (supported: ByteLevel, Sequence of Split + ByteLevel)");
  }
  const nlohmann::json& steps = require_field(spec, "pretokenizers", "pre_tokenizer");
  if (!steps.is_array() || steps.empty()) {
    throw FormatError("pre_tokenizer.pretokenizers must be a non-empty array");
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string where = "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]";
    const std::string step_type = require_string(steps[i], "type", where);
    const bool is_last = i + 1 == steps.size();
    if (step_type == "Split" && !is_last) {
      add_split(steps[i], where);
    } else if (step_type == "ByteLevel" && is_last) {
      add_byte_level(steps[i], where);
    } else if (step_type == "Split" || step_type == "ByteLevel") {
      // Splits after ByteLevel would see byte-level text, and BPE needs the mapping last.
      throw FormatError(where +
                        ": a pre_tokenizer Sequence must be Split steps then one "
                        "ByteLevel, got " +
                        step_type + " at this position");
    } else {
      throw FormatError(where + ": unsupported pre_tokenizer type '" + step_type +
                        "' in Sequence (supported: Split, ByteLevel)");
    }
  }
}

void PreTokenizer::add_byte_level(const nlohmann::json& spec, std::string_view where) {
  // add_prefix_space would make pre-tokens that are not slices of the input.
  if (optional_bool(spec, "add_prefix_space", true, where)) {
    throw FormatError(std::string(where) + ": ByteLevel add_prefix_space=true is not supported");
  }
  if (optional_bool(spec, "use_regex", true, where)) {
    stages_.emplace_back(kGpt2Pattern, Regex::Syntax::kOniguruma, where);
  }
}

void PreTokenizer::add_split(const nlohmann::json& spec, std::string_view where) {
  const std::string behavior = require_string(spec, "behavior", where);
  if (behavior != "Isolated") {
    throw FormatError(std::string(where) + ": unsupported Split behavior '" + behavior +
                      "' (supported: Isolated)");
  }
  if (optional_bool(spec, "invert", false, where)) {
    throw FormatError(std::string(where) + ": Split invert=true is not supported");
  }
  const nlohmann::json& pattern = require_field(spec, "pattern", where);
  const std::string pattern_where = std::string(where) + ".pattern";
  if (pattern.contains("Regex")) {
    stages_.emplace_back(require_string(pattern, "Regex", pattern_where), Regex::Syntax::kOniguruma,
                         where);
  } else if (pattern.contains("String")) {
    stages_.emplace_back(require_string(pattern, "String", pattern_where), Regex::Syntax::kLiteral,
                         where);
  } else {
    throw FormatError(pattern_where + " must hold 'Regex' or 'String'");
  }
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& out) const {
  std::vector<std::string_view> pieces{text};
  std::vector<std::string_view> next;
  for (const Regex& stage : stages_) {
    next.clear();
    stage.split_isolated(pieces, next);
    pieces.swap(next);
  }
  out.insert(out.end(), pieces.begin(), pieces.end());
}

}  // namespace quantmla::detail
