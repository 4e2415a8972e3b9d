// Where the tests find their fixtures.
#pragma once

#include <filesystem>

namespace quantmla::testing {

inline std::filesystem::path shared_dir() { return QUANTMLA_SHARED_DIR; }
inline std::filesystem::path source_dir() { return QUANTMLA_SOURCE_DIR; }
inline std::filesystem::path cli_path() { return QUANTMLA_CLI_PATH; }
inline std::filesystem::path bundled_model() { return source_dir() / "models" / "mla-tiny"; }

}  // namespace quantmla::testing
