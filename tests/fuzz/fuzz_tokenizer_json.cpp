// A model's tokenizer.json (from its files, untrusted bytes): loaded, it is refused with a typed
// error or encodes and decodes text (its pre-tokenizer patterns are PCRE2 regexes, its merges and
// added tokens arbitrary) without a crash, a sanitizer report or a hang.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "quantmla/error.h"
#include "quantmla/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path path = quantmla::fuzz::write_input(data, size, "-tokenizer.json");
  try {
    const quantmla::Tokenizer tokenizer = quantmla::Tokenizer::from_file(path);
    const std::vector<int32_t> ids =
        tokenizer.encode("Hello, wörld! 1234 <|begin_of_text|> \t\n  ünïcødé 日本語 🙂");
    std::vector<int32_t> known;
    for (const int32_t id : ids) {
      if (tokenizer.knows(id)) known.push_back(id);
    }
    (void)tokenizer.decode(known);
  } catch (const quantmla::FormatError&) {
  } catch (const quantmla::InvalidArgument&) {
  }
  return 0;
}
