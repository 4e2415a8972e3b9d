// A model's config.json (from its files, untrusted bytes): parsed and checked, it is refused with
// a typed error (FormatError, InvalidArgument) or gives a config whose derived values can be
// computed (UBSan checks the arithmetic).
#include <cstddef>
#include <cstdint>
#include <string>

#include "quantmla/config.h"
#include "quantmla/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const quantmla::ModelConfig config = quantmla::ModelConfig::from_json(text, "config.json");
    (void)config.softmax_scale();
    (void)config.cache_row_width();
    for (int64_t layer = 0; layer < config.num_layers && layer < 64; ++layer) {
      (void)config.is_moe_layer(layer);
    }
  } catch (const quantmla::FormatError&) {
  } catch (const quantmla::InvalidArgument&) {
  }
  return 0;
}
