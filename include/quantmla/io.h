// Small file helpers shared by the tools, tests and benchmarks.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace quantmla {

// Whole file as bytes. Throws IoError naming the path.
std::string read_text_file(const std::filesystem::path& path);
// A text file as Python's text mode reads it: "\r\n" and lone "\r" become "\n". The reference
// token ids (and perplexities) of the shared fixtures were made from such reads.
std::string read_text_file_universal_newlines(const std::filesystem::path& path);
// Little-endian int32 token ids. Throws FormatError when the size is not a multiple of 4.
std::vector<int32_t> read_ids_file(const std::filesystem::path& path);
void write_ids_file(const std::filesystem::path& path, const std::vector<int32_t>& ids);

}  // namespace quantmla
