// A chat template's source (from a model's files) parsed and rendered with a real conversation:
// a template may be refused (FormatError) or fail while rendering (InvalidArgument), never crash.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "fuzz_common.h"
#include "quantmla/chat_template.h"
#include "quantmla/error.h"

namespace {

const nlohmann::ordered_json& context() {
  static const nlohmann::ordered_json value = [] {
    std::ifstream in(quantmla::fuzz::shared_dir() / "reference/chat-template-reference.json");
    const auto reference = nlohmann::ordered_json::parse(in);
    const auto& tool_case = reference["cases"][7];  // tool call, tool output, final answer
    return nlohmann::ordered_json{{"messages", tool_case["messages"]},
                                  {"add_generation_prompt", true},
                                  {"bos_token", reference["bos_token"]},
                                  {"eos_token", reference["eos_token"]}};
  }();
  return value;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  try {
    const quantmla::ChatTemplate chat(source);
    (void)chat.render(context());
  } catch (const quantmla::FormatError&) {
  } catch (const quantmla::InvalidArgument&) {
  }
  return 0;
}
