// A .safetensors file (a model's, untrusted bytes): opened and validated, it is refused with a
// FormatError or every tensor it lists lies inside the file with dtype x shape = its byte length.
#include <cstddef>
#include <cstdint>
#include <filesystem>

#include "fuzz_common.h"
#include "quantmla/error.h"
#include "quantmla/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path path = quantmla::fuzz::write_input(data, size, ".safetensors");
  try {
    const auto file = quantmla::SafetensorsFile::open(path);
    for (const quantmla::TensorView& t : file->tensors()) {
      volatile std::byte sink{};
      for (size_t i = 0; i < t.nbytes; i += 4096) sink = t.data[i];  // every page is readable
      if (t.nbytes > 0) sink = t.data[t.nbytes - 1];
      (void)sink;
    }
  } catch (const quantmla::FormatError&) {
  } catch (const quantmla::IoError&) {
  }
  return 0;
}
