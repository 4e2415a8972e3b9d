// A .safetensors file (a model's, untrusted bytes): opened and validated, it is refused with a
// FormatError or every tensor it lists lies inside the file with dtype x shape = its byte length.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "quantmla/error.h"
#include "quantmla/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("quantmla-fuzz-" + std::to_string(::getpid()) + ".safetensors");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
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
