// What the fuzz targets share: where the fixtures are, and the rule that bad input may only end in
// one of the engine's typed errors (anything else escaping, or a sanitizer report, is a finding).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace quantmla::fuzz {

// ../shared beside the checkout, or $QUANTMLA_SHARED_DIR.
inline std::filesystem::path shared_dir() {
  if (const char* dir = std::getenv("QUANTMLA_SHARED_DIR")) return dir;
  return QUANTMLA_SHARED_DIR;
}

}  // namespace quantmla::fuzz
