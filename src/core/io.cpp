#include "quantmla/io.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include "quantmla/error.h"

namespace quantmla {

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("cannot open " + path.string() + ": " + std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw IoError("error reading " + path.string());
  return text;
}

std::string read_text_file_universal_newlines(const std::filesystem::path& path) {
  const std::string raw = read_text_file(path);
  std::string text;
  text.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] != '\r') {
      text.push_back(raw[i]);
    } else {
      text.push_back('\n');
      if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
    }
  }
  return text;
}

std::vector<int32_t> read_ids_file(const std::filesystem::path& path) {
  const std::string bytes = read_text_file(path);
  if (bytes.size() % sizeof(int32_t) != 0) {
    throw FormatError(path.string() + ": " + std::to_string(bytes.size()) +
                      " bytes is not a whole number of int32 token ids");
  }
  std::vector<int32_t> ids(bytes.size() / sizeof(int32_t));
  std::memcpy(ids.data(), bytes.data(), bytes.size());  // the host is little-endian (x86-64)
  return ids;
}

void write_ids_file(const std::filesystem::path& path, const std::vector<int32_t>& ids) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw IoError("cannot write " + path.string() + ": " + std::strerror(errno));
  out.write(reinterpret_cast<const char*>(ids.data()),
            static_cast<std::streamsize>(ids.size() * sizeof(int32_t)));
  if (!out) throw IoError("error writing " + path.string());
}

}  // namespace quantmla
