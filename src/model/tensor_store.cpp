// The weights of a Hugging Face model directory: one safetensors file or an index plus shards.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "quantmla/error.h"
#include "quantmla/safetensors.h"

namespace quantmla {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kSingleFileName = "model.safetensors";
constexpr const char* kIndexFileName = "model.safetensors.index.json";

json read_index(const fs::path& index_path) {
  const std::string file = index_path.string();
  std::ifstream in(index_path, std::ios::binary);
  if (!in) throw IoError("cannot open " + file);
  std::stringstream text;
  text << in.rdbuf();
  json index;
  try {
    index = json::parse(text.str());
  } catch (const json::exception& error) {  // parse errors, numbers beyond a double
    throw FormatError(file + ": not valid JSON: " + error.what());
  }
  if (!index.is_object()) throw FormatError(file + ": not a JSON object");
  const auto weight_map = index.find("weight_map");
  if (weight_map == index.end() || !weight_map->is_object()) {
    throw FormatError(file + ": missing object \"weight_map\"");
  }
  for (const auto& [tensor, shard] : weight_map->items()) {
    if (!shard.is_string()) {
      throw FormatError(file + ": weight_map entry for tensor " + tensor + " is " + shard.dump() +
                        ", expected a shard file name");
    }
  }
  return *weight_map;
}

}  // namespace

TensorStore TensorStore::open_dir(const fs::path& dir) {
  if (!fs::exists(dir)) throw IoError("model directory " + dir.string() + " does not exist");
  if (!fs::is_directory(dir))
    throw IoError("model directory " + dir.string() + " is not a directory");

  TensorStore store;
  store.dir_ = dir;
  const fs::path index_path = dir / kIndexFileName;
  const fs::path single_path = dir / kSingleFileName;

  if (fs::exists(index_path)) {
    const json weight_map = read_index(index_path);
    // Many tensors share a shard; each shard is mapped (and validated) once.
    std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
    for (const auto& [tensor, shard_value] : weight_map.items()) {
      const auto shard_name = shard_value.get<std::string>();
      auto shard = shards.find(shard_name);
      if (shard == shards.end()) {
        const fs::path shard_path = dir / shard_name;
        if (!fs::is_regular_file(shard_path)) {
          throw IoError(index_path.string() + ": shard " + shard_path.string() +
                        " (named for tensor " + tensor + ") does not exist");
        }
        shard = shards.emplace(shard_name, SafetensorsFile::open(shard_path)).first;
        store.files_.push_back(shard->second);
      }
      const TensorView* view = shard->second->find(tensor);
      if (view == nullptr) {
        throw FormatError(index_path.string() + ": tensor " + tensor + " is mapped to shard " +
                          shard->second->path().string() + ", which does not contain it");
      }
      store.index_.emplace(tensor, view);
    }
  } else if (fs::exists(single_path)) {
    store.files_.push_back(SafetensorsFile::open(single_path));
    for (const TensorView& view : store.files_.back()->tensors()) {
      store.index_.emplace(view.name, &view);
    }
  } else {
    throw IoError("model directory " + dir.string() + " has neither " + kSingleFileName + " nor " +
                  kIndexFileName);
  }
  return store;
}

bool TensorStore::contains(std::string_view name) const { return index_.contains(name); }

const TensorView& TensorStore::get(std::string_view name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    throw FormatError("tensor " + std::string(name) + ": missing from " + dir_.string());
  }
  return *it->second;
}

const TensorView& TensorStore::get(std::string_view name,
                                   std::span<const int64_t> expected_shape) const {
  const TensorView& view = get(name);
  if (!std::equal(view.shape.begin(), view.shape.end(), expected_shape.begin(),
                  expected_shape.end())) {
    TensorView expected;
    expected.shape.assign(expected_shape.begin(), expected_shape.end());
    throw ShapeError("tensor " + view.name + ": shape " + view.shape_string() + ", expected " +
                     expected.shape_string() + " (in " + view.file + ")");
  }
  return view;
}

std::vector<std::string> TensorStore::names() const {
  std::vector<std::string> result;
  result.reserve(index_.size());
  for (const auto& entry : index_) result.push_back(entry.first);
  return result;
}

}  // namespace quantmla
