// Prompt text (untrusted) through the DeepSeek-V3 tokenizer: any bytes encode without crashing, and
// text that is valid UTF-8 decodes back to itself (byte-level BPE loses nothing).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "quantmla/error.h"
#include "quantmla/tokenizer.h"

namespace {

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7f >> n);
    for (int k = 1; k < n; ++k) {
      const auto t = static_cast<unsigned char>(s[i + k]);
      if ((t >> 6) != 2) return false;
      cp = cp << 6 | (t & 0x3f);
    }
    const uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const quantmla::Tokenizer tokenizer = quantmla::Tokenizer::from_file(
      quantmla::fuzz::shared_dir() / "tokenizers/deepseek-v3/tokenizer.json");
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<int32_t> ids;
  try {
    ids = tokenizer.encode(text);
  } catch (const quantmla::InvalidArgument&) {
    return 0;  // text that is not UTF-8 may be refused
  }
  if (valid_utf8(text) && tokenizer.decode(ids) != text) {
    std::fprintf(stderr, "decode(encode(text)) != text for %zu bytes\n", size);
    std::abort();
  }
  return 0;
}
