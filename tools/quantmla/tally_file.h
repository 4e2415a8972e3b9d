// KLD tallies on disk, so that one `compare` can be split by windows across processes or machines
// and merged afterwards (`compare-merge`). Layout: the 8 bytes "QMLATLY1", a little-endian uint64
// header length, a JSON header (run settings, and per row its name, format, window range and sums),
// then each row's per-token KLDs as little-endian float32 in row order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "quantmla/cache.h"
#include "quantmla/eval.h"

namespace quantmla::cli {

struct TallyRow {
  std::string name;  // the row's label: the format, prefixed by its transform if any
  CacheFormat format;
  KldTally tally;
};

struct TallyFile {
  std::string model;
  int64_t ctx = 0;
  std::string baseline;
  CacheShape shape;  // for bytes per token and compression
  std::vector<TallyRow> rows;
};

void write_tally_file(const std::string& path, const TallyFile& file);
// Throws IoError when unreadable and FormatError naming the file when it is truncated or corrupt.
TallyFile read_tally_file(const std::string& path);

}  // namespace quantmla::cli
