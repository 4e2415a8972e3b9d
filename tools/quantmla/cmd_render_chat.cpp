#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "quantmla/chat_template.h"
#include "quantmla/error.h"
#include "quantmla/io.h"

namespace quantmla::cli {
namespace {

struct RenderChatOptions {
  std::string model = kDefaultModel;
  std::string messages;
  std::string chat_template;
  bool add_generation_prompt = false;
};

// The messages file: a JSON array of messages, or an object with one under "messages" (a chat
// completion request). Ordered, so tojson in a template sees the keys as written.
nlohmann::ordered_json read_messages(const std::string& path) {
  nlohmann::ordered_json json;
  try {
    json = nlohmann::ordered_json::parse(read_text_file(path));
  } catch (const nlohmann::json::exception& error) {
    throw FormatError(path + ": " + error.what());
  }
  if (json.is_object() && json.contains("messages")) json = json["messages"];
  if (!json.is_array()) {
    throw FormatError(path +
                      ": expected a JSON array of messages (or an object with \"messages\")" +
                      ", got " + json.type_name());
  }
  return json;
}

void run_render_chat(const RenderChatOptions& options) {
  const nlohmann::ordered_json messages = read_messages(options.messages);
  // Only tokenizer_config.json (or the given template) is read: no config.json, no weights.
  std::optional<ChatTemplate> chat_template;
  if (!options.chat_template.empty()) {
    chat_template = ChatTemplate::from_file(options.chat_template);
  } else {
    chat_template = ChatTemplate::from_model_dir(options.model);
    if (!chat_template) {
      throw InvalidArgument(options.model +
                            " has no chat_template in tokenizer_config.json; pass --chat-template "
                            "FILE");
    }
  }
  const ChatSpecialTokens tokens = read_chat_special_tokens(options.model);
  const std::string prompt = apply_chat_template(
      *chat_template, messages, options.add_generation_prompt, tokens.bos_token, tokens.eos_token);
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
}

}  // namespace

void add_render_chat(CLI::App& app) {
  auto options = std::make_shared<RenderChatOptions>();
  CLI::App* cmd =
      app.add_subcommand("render-chat",
                         "Print the prompt a chat model gets for a conversation, as transformers' "
                         "apply_chat_template renders it (no trailing newline added)");
  cmd->add_option("--model", options->model,
                  "Model directory: its chat template and bos/eos tokens (tokenizer_config.json)")
      ->capture_default_str()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--messages", options->messages,
                  "JSON file: an array of {\"role\", \"content\", ...} messages, or an object "
                  "with them under \"messages\"")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--chat-template", options->chat_template,
                  "Template to use instead of the model's: a .json file's chat_template key "
                  "(e.g. a tokenizer_config.json), any other file as raw Jinja")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--add-generation-prompt", options->add_generation_prompt,
                "End with the assistant's turn header, ready for generation");
  cmd->callback([options] { run_render_chat(*options); });
}

}  // namespace quantmla::cli
