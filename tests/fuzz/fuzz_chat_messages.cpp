// The server's untrusted part of a chat prompt: the messages a client sends, rendered through the
// real DeepSeek-V3 template. Malformed messages may be refused (InvalidArgument), never crash.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "fuzz_common.h"
#include "quantmla/chat_template.h"
#include "quantmla/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const quantmla::ChatTemplate chat = *quantmla::ChatTemplate::from_model_dir(
      quantmla::fuzz::shared_dir() / "tokenizers/deepseek-v3");
  const auto messages = nlohmann::ordered_json::parse(data, data + size, nullptr, false);
  if (messages.is_discarded()) return 0;
  try {
    // The server's path: apply_chat_template checks the nesting before it copies anything.
    (void)quantmla::apply_chat_template(chat, messages, true, "<｜begin▁of▁sentence｜>",
                                        "<｜end▁of▁sentence｜>");
  } catch (const quantmla::InvalidArgument&) {
  }
  return 0;
}
