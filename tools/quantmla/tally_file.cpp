#include "tally_file.h"

#include <bit>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "quantmla/error.h"

namespace quantmla::cli {
namespace {

constexpr char kMagic[8] = {'Q', 'M', 'L', 'A', 'T', 'L', 'Y', '1'};

static_assert(std::endian::native == std::endian::little, "tally files are little-endian");

}  // namespace

void write_tally_file(const std::string& path, const TallyFile& file) {
  nlohmann::json rows = nlohmann::json::array();
  for (const TallyRow& row : file.rows) {
    const KldTally& t = row.tally;
    rows.push_back({{"name", row.name},
                    {"format", row.format.to_string()},
                    {"first_window", t.first_window},
                    {"windows", t.windows},
                    {"tokens", t.tokens},
                    {"nll", t.nll},
                    {"baseline_nll", t.baseline_nll},
                    {"top1_agree", t.top1_agree}});
  }
  const nlohmann::json header = {{"model", file.model},
                                 {"ctx", file.ctx},
                                 {"baseline", file.baseline},
                                 {"num_layers", file.shape.num_layers},
                                 {"kv_lora_rank", file.shape.kv_lora_rank},
                                 {"rope_dim", file.shape.rope_dim},
                                 {"rows", rows}};
  const std::string text = header.dump();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw IoError("cannot write " + path);
  const uint64_t length = text.size();
  out.write(kMagic, sizeof(kMagic));
  out.write(reinterpret_cast<const char*>(&length), sizeof(length));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const TallyRow& row : file.rows) {
    out.write(reinterpret_cast<const char*>(row.tally.klds.data()),
              static_cast<std::streamsize>(row.tally.klds.size() * sizeof(float)));
  }
  if (!out) throw IoError("write failed: " + path);
}

TallyFile read_tally_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError("cannot open " + path);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto corrupt = [&](const std::string& why) {
    return FormatError("tally file " + path + ": " + why);
  };
  if (bytes.size() < 16 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    throw corrupt("not a QuantMLA tally file (no QMLATLY1 header)");
  }
  uint64_t length = 0;
  std::memcpy(&length, bytes.data() + 8, sizeof(length));
  if (length > bytes.size() - 16) {
    throw corrupt("header of " + std::to_string(length) + " bytes, file has " +
                  std::to_string(bytes.size()));
  }
  TallyFile file;
  size_t offset = 16 + length;
  try {
    const nlohmann::json header = nlohmann::json::parse(bytes.substr(16, length));
    file.model = header.at("model").get<std::string>();
    file.ctx = header.at("ctx").get<int64_t>();
    file.baseline = header.at("baseline").get<std::string>();
    file.shape = {header.at("num_layers").get<int64_t>(), header.at("kv_lora_rank").get<int64_t>(),
                  header.at("rope_dim").get<int64_t>()};
    for (const nlohmann::json& r : header.at("rows")) {
      TallyRow row{r.at("name").get<std::string>(),
                   CacheFormat::parse(r.at("format").get<std::string>()),
                   {}};
      KldTally& t = row.tally;
      t.first_window = r.at("first_window").get<int64_t>();
      t.windows = r.at("windows").get<int64_t>();
      t.tokens = r.at("tokens").get<int64_t>();
      t.nll = r.at("nll").get<double>();
      t.baseline_nll = r.at("baseline_nll").get<double>();
      t.top1_agree = r.at("top1_agree").get<int64_t>();
      if (t.tokens < 0 || static_cast<uint64_t>(t.tokens) > (bytes.size() - offset) / 4) {
        throw corrupt("row " + row.name + " claims " + std::to_string(t.tokens) + " KLD values, " +
                      std::to_string(bytes.size() - offset) + " bytes remain");
      }
      t.klds.resize(static_cast<size_t>(t.tokens));
      std::memcpy(t.klds.data(), bytes.data() + offset, t.klds.size() * sizeof(float));
      offset += t.klds.size() * sizeof(float);
      file.rows.push_back(std::move(row));
    }
  } catch (const nlohmann::json::exception& e) {
    throw corrupt(std::string("bad header: ") + e.what());
  }
  if (offset != bytes.size()) {
    throw corrupt(std::to_string(bytes.size() - offset) + " bytes after the last row");
  }
  return file;
}

}  // namespace quantmla::cli
