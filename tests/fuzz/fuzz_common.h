// What the fuzz targets share: where the fixtures are, how an input becomes a file, and the rule
// that bad input may only end in one of the engine's typed errors (anything else escaping, or a
// sanitizer report, is a finding).
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace quantmla::fuzz {

// ../shared beside the checkout, or $QUANTMLA_SHARED_DIR.
inline std::filesystem::path shared_dir() {
  if (const char* dir = std::getenv("QUANTMLA_SHARED_DIR")) return dir;
  return QUANTMLA_SHARED_DIR;
}

// The input as a file, for the parsers that read one: a file of this process's own, named
// `suffix`, rewritten for every input.
inline std::filesystem::path write_input(const uint8_t* data, size_t size, const char* suffix) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() /
                                     ("quantmla-fuzz-" + std::to_string(::getpid()) + suffix);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

}  // namespace quantmla::fuzz
