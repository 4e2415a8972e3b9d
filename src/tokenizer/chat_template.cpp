// ChatTemplate: source -> tokens -> statement tree once; render() walks the tree per request.
#include "quantmla/chat_template.h"

#include "quantmla/error.h"
#include "quantmla/io.h"
#include "quantmla/json_depth.h"
#include "tokenizer/chat_template_ast.h"
#include "tokenizer/chat_template_frames.h"
#include "tokenizer/chat_template_lexer.h"
#include "tokenizer/chat_template_parser.h"
#include "tokenizer/chat_template_render.h"
#include "tokenizer/utf8.h"

namespace quantmla {

namespace fs = std::filesystem;
using detail::jinja::Dict;
using detail::jinja::RenderError;
using detail::jinja::Value;

struct ChatTemplate::Program {
  std::string original;
  std::string source;  // normalized as jinja2 reads it; positions and tokens refer to it
  std::unique_ptr<detail::jinja::SourcePositions> positions;
  detail::jinja::Body body;
  detail::jinja::FrameInfo frame;
};

ChatTemplate::ChatTemplate(const std::string& source) {
  if (const auto bad = detail::find_invalid_utf8(source)) {
    throw FormatError("chat template is not valid UTF-8 at byte " + std::to_string(*bad));
  }
  auto program = std::make_shared<Program>();
  program->original = source;
  program->source = detail::jinja::normalize_template_source(source);
  program->positions = std::make_unique<detail::jinja::SourcePositions>(program->source);
  const auto tokens = detail::jinja::tokenize_template(program->source, *program->positions);
  program->body = detail::jinja::parse_template(tokens, *program->positions);
  program->frame = detail::jinja::analyze_frames(program->body);
  program_ = std::move(program);
}

const std::string& ChatTemplate::source() const { return program_->original; }

namespace {

template <typename Json>
std::string render_json(const detail::jinja::Body& body, const detail::jinja::FrameInfo& frame,
                        const detail::jinja::SourcePositions& positions, const Json& context) {
  if (!context.is_object()) {
    throw InvalidArgument(std::string("chat template context must be a JSON object, got ") +
                          context.type_name());
  }
  Value variables;
  try {
    variables = detail::jinja::from_json(context);
  } catch (const RenderError& error) {
    throw InvalidArgument(std::string("chat template context: ") + error.what());
  }
  return detail::jinja::render_template(body, frame, positions, variables.as_dict());
}

nlohmann::json read_json_file(const fs::path& path) {
  const std::string text = read_text_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    throw FormatError(path.string() + ": " + error.what());
  }
}

// A template read from `path`, its parse errors naming the file.
ChatTemplate parse_from(const fs::path& path, const std::string& source) {
  try {
    return ChatTemplate(source);
  } catch (const FormatError& error) {
    throw FormatError(path.string() + ": " + error.what());
  }
}

// tokenizer_config.json's chat_template: a string, or named templates of which "default" is the
// one transformers applies when none is asked for.
std::optional<std::string> config_template(const fs::path& path, const nlohmann::json& config) {
  const auto field = config.find("chat_template");
  if (field == config.end() || field->is_null()) return std::nullopt;
  if (field->is_string()) return field->get<std::string>();
  if (!field->is_array()) {
    throw FormatError(path.string() + ": chat_template must be a string or a list of {name, " +
                      "template} objects, got " + field->type_name());
  }
  std::string names;
  for (const nlohmann::json& entry : *field) {
    const auto name = entry.is_object() ? entry.find("name") : entry.end();
    const auto text = entry.is_object() ? entry.find("template") : entry.end();
    if (!entry.is_object() || name == entry.end() || !name->is_string() || text == entry.end() ||
        !text->is_string()) {
      throw FormatError(path.string() + ": chat_template list entry " + entry.dump() +
                        " is not a {\"name\": string, \"template\": string} object");
    }
    if (*name == "default") return text->get<std::string>();
    names += (names.empty() ? "'" : ", '") + name->get<std::string>() + "'";
  }
  throw FormatError(path.string() + ": chat_template has named templates (" + names +
                    ") but none named 'default'");
}

std::string special_token(const fs::path& path, const nlohmann::json& config, const char* key) {
  const auto field = config.find(key);
  if (field == config.end() || field->is_null()) return "";
  if (field->is_string()) return field->get<std::string>();
  if (field->is_object()) {
    const auto content = field->find("content");
    if (content != field->end() && content->is_string()) return content->get<std::string>();
  }
  throw FormatError(path.string() + ": " + key + " must be a string or an object with a string " +
                    "\"content\", got " + field->dump());
}

template <typename Json>
std::string apply(const ChatTemplate& chat_template, const Json& messages,
                  bool add_generation_prompt, const std::string& bos_token,
                  const std::string& eos_token, const Json& tools) {
  if (!messages.is_array()) {
    throw InvalidArgument(std::string("chat messages must be a JSON array, got ") +
                          messages.type_name());
  }
  if (!tools.is_null() && !tools.is_array()) {
    throw InvalidArgument(std::string("chat tools must be a JSON array or null, got ") +
                          tools.type_name());
  }
  // Checked before the copies below, which recurse once a level (quantmla/json_depth.h).
  constexpr int kMaxNesting = detail::jinja::Value::kMaxNesting - 2;
  for (const Json* part : {&messages, &tools}) {
    if (json_nesting_depth(*part, kMaxNesting) > kMaxNesting) {
      throw InvalidArgument("chat " + std::string(part == &messages ? "messages" : "tools") +
                            " nest deeper than " + std::to_string(kMaxNesting) + " levels");
    }
  }
  Json context = Json::object();
  context["messages"] = messages;
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = bos_token;
  context["eos_token"] = eos_token;
  // transformers always passes these, None when the caller gives none.
  context["tools"] = tools;
  context["documents"] = nullptr;
  return chat_template.render(context);
}

}  // namespace

std::string ChatTemplate::render(const nlohmann::json& context) const {
  return render_json(program_->body, program_->frame, *program_->positions, context);
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  return render_json(program_->body, program_->frame, *program_->positions, context);
}

std::optional<ChatTemplate> ChatTemplate::from_model_dir(const fs::path& dir) {
  const fs::path jinja_file = dir / "chat_template.jinja";
  if (fs::exists(jinja_file)) return parse_from(jinja_file, read_text_file(jinja_file));
  const fs::path config_file = dir / "tokenizer_config.json";
  if (!fs::exists(config_file)) return std::nullopt;
  const nlohmann::json config = read_json_file(config_file);
  if (!config.is_object()) {
    throw FormatError(config_file.string() + ": expected a JSON object, got " + config.type_name());
  }
  const std::optional<std::string> source = config_template(config_file, config);
  if (!source) return std::nullopt;
  return parse_from(config_file, *source);
}

ChatTemplate ChatTemplate::from_file(const fs::path& path) {
  if (path.extension() != ".json") return parse_from(path, read_text_file(path));
  const nlohmann::json config = read_json_file(path);
  if (!config.is_object()) {
    throw FormatError(path.string() + ": expected a JSON object with a chat_template, got " +
                      config.type_name());
  }
  const std::optional<std::string> source = config_template(path, config);
  if (!source) throw FormatError(path.string() + " has no chat_template");
  return parse_from(path, *source);
}

ChatSpecialTokens read_chat_special_tokens(const fs::path& dir) {
  const fs::path config_file = dir / "tokenizer_config.json";
  if (!fs::exists(config_file)) return {};
  const nlohmann::json config = read_json_file(config_file);
  if (!config.is_object()) {
    throw FormatError(config_file.string() + ": expected a JSON object, got " + config.type_name());
  }
  return ChatSpecialTokens{special_token(config_file, config, "bos_token"),
                           special_token(config_file, config, "eos_token")};
}

std::string apply_chat_template(const ChatTemplate& chat_template, const nlohmann::json& messages,
                                bool add_generation_prompt, const std::string& bos_token,
                                const std::string& eos_token, const nlohmann::json& tools) {
  return apply(chat_template, messages, add_generation_prompt, bos_token, eos_token, tools);
}

std::string apply_chat_template(const ChatTemplate& chat_template,
                                const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                const std::string& bos_token, const std::string& eos_token,
                                const nlohmann::ordered_json& tools) {
  return apply(chat_template, messages, add_generation_prompt, bos_token, eos_token, tools);
}

}  // namespace quantmla
