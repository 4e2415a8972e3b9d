// Chat templates: the Jinja templates Hugging Face models ship in tokenizer_config.json, rendered
// byte for byte as transformers' apply_chat_template renders them (jinja2's sandboxed environment
// with trim_blocks, lstrip_blocks and loop controls; transformers' tojson and raise_exception).
//
// The Jinja subset: {{ }}, {% %}, {# #} with the -/+ whitespace markers; if/elif/else, for (with
// tuple targets, an if filter, else, loop.index/index0/revindex/first/last/length/previtem/
// nextitem/cycle, break, continue), set (names, tuples, ns.attr, {% set x %}...{% endset %}),
// macro, generation; Python's literals, operators, comparisons, in, and/or/not, conditional
// expressions, attributes, subscripts and slices; jinja2's common filters and tests; str, dict and
// list methods; range, namespace, dict, raise_exception, strftime_now.
//
// Known differences from jinja2, none of which the DeepSeek, Kimi or Moonlight templates meet:
// integers beyond 64 bits are refused, and so are strings and lists of more than 2^24 bytes or
// items (Python's MemoryError, at once instead of after the allocation); upper/lower/title map
// ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic letters only; filters jinja2 returns as
// generators (map, select, reverse, ...) give lists, which differ only when printed as they are;
// no raw, call, filter, with, include or import blocks, and no *args/**kwargs in calls.
#pragma once

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace quantmla {

class ChatTemplate {
 public:
  // Parses a Jinja template. Throws FormatError naming the line and column and what was expected
  // there (also for a filter or test this interpreter does not have, and for bytes that are not
  // UTF-8).
  explicit ChatTemplate(const std::string& source);

  // Renders with `context` (an object) as the template's variables. Variables it does not name
  // are jinja2's undefined: falsy, rendered as "", `is defined` false; using one in arithmetic or
  // looking into it throws. raise_exception(msg) in the template throws InvalidArgument(msg);
  // other runtime errors (Python's TypeError and the like) throw InvalidArgument naming the
  // template position. nlohmann::json keeps object keys sorted, so `tojson` and dict iteration see
  // them sorted; pass an ordered_json to keep the caller's order, as Python dicts do.
  std::string render(const nlohmann::json& context) const;
  std::string render(const nlohmann::ordered_json& context) const;

  // The chat template of a model directory: DIR/chat_template.jinja when there is one (newer
  // transformers save it there), else tokenizer_config.json's chat_template (a string, or a list
  // of {"name", "template"} objects: the one named "default"); std::nullopt when there is none.
  // Throws IoError for an unreadable file and FormatError for a malformed one or template.
  static std::optional<ChatTemplate> from_model_dir(const std::filesystem::path& dir);
  // A template file: for a .json file (a tokenizer_config.json, a chat_template.json) its
  // chat_template as above, which it must have; any other file is the Jinja source itself.
  static ChatTemplate from_file(const std::filesystem::path& path);

  const std::string& source() const;

 private:
  struct Program;
  std::shared_ptr<const Program> program_;
};

// bos_token and eos_token of DIR/tokenizer_config.json (a string, or an AddedToken object with
// "content"); "" for one that is absent or null, or when there is no tokenizer_config.json.
struct ChatSpecialTokens {
  std::string bos_token;
  std::string eos_token;
};
ChatSpecialTokens read_chat_special_tokens(const std::filesystem::path& dir);

// The prompt text a chat model gets, as transformers' apply_chat_template(messages, tools=...,
// tokenize=False, add_generation_prompt=...) renders it: the template sees messages,
// add_generation_prompt, bos_token, eos_token, tools (None unless given: a list of the OpenAI
// API's tool objects) and documents as None. Throws InvalidArgument for messages that are not a
// list, tools that are neither a list nor null, and what the template raises.
std::string apply_chat_template(const ChatTemplate& chat_template, const nlohmann::json& messages,
                                bool add_generation_prompt, const std::string& bos_token,
                                const std::string& eos_token,
                                const nlohmann::json& tools = nullptr);
std::string apply_chat_template(const ChatTemplate& chat_template,
                                const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                const std::string& bos_token, const std::string& eos_token,
                                const nlohmann::ordered_json& tools = nullptr);

}  // namespace quantmla
