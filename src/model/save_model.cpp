// Writes a model, transforms folded in, as a Hugging Face model directory (see model_io.h).
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "model/weights.h"
#include "quantmla/error.h"
#include "quantmla/io.h"
#include "quantmla/model.h"
#include "quantmla/model_io.h"
#include "quantmla/safetensors.h"

namespace quantmla {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

constexpr const char* kIndexFileName = "model.safetensors.index.json";
constexpr const char* kConfigFileName = "config.json";

// "out/" and "out" must name the same sibling "out.partial".
fs::path without_trailing_separator(const fs::path& path) {
  fs::path normal = path.lexically_normal();
  if (!normal.has_filename() && normal.has_parent_path()) normal = normal.parent_path();
  return normal;
}

fs::path with_suffix(const fs::path& path, const char* suffix) {
  fs::path out = path;
  out += suffix;
  return out;
}

// True when `inner` is `outer` or lies below it (both canonical).
bool is_within(const fs::path& inner, const fs::path& outer) {
  auto o = outer.begin();
  for (auto i = inner.begin(); o != outer.end(); ++i, ++o) {
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

fs::path canonical_or_throw(const fs::path& path) {
  std::error_code error;
  fs::path canonical = fs::weakly_canonical(path, error);
  if (error) throw IoError("cannot resolve " + path.string() + ": " + error.message());
  return canonical;
}

void check_io(const std::error_code& error, const std::string& what) {
  if (error) throw IoError(what + ": " + error.message());
}

void write_text_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw IoError("cannot create " + path.string());
  out << text;
  out.close();
  if (!out) throw IoError("cannot write " + path.string());
}

ordered_json parse_json(const std::string& text, const std::string& source) {
  try {
    return ordered_json::parse(text);
  } catch (const ordered_json::exception& error) {  // parse errors, numbers beyond a double
    throw FormatError(source + ": not valid JSON: " + error.what());
  }
}

// The tensors the folds in src/calib rewrite, by checkpoint name, with the model's current values.
std::map<std::string, std::span<const float>> transformable_tensors(const Model& model) {
  const ModelConfig& config = model.config();
  const ModelWeights& weights = model.weights();
  std::map<std::string, std::span<const float>> tensors;
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string prefix = "model.layers." + std::to_string(l) + ".self_attn.";
    const AttentionWeights& attention = weights.layers[static_cast<size_t>(l)].attention;
    tensors[prefix + "kv_a_proj_with_mqa.weight"] = attention.kv_a.weight;
    tensors[prefix + "kv_a_layernorm.weight"] = attention.kv_a_norm;
    tensors[prefix + "kv_b_proj.weight"] = attention.kv_b.weight;
    if (config.q_lora_rank > 0) {
      tensors[prefix + "q_b_proj.weight"] = attention.q_b.weight;
    } else {
      tensors[prefix + "q_proj.weight"] = attention.q.weight;
    }
  }
  return tensors;
}

// One tensor of the output: the source view, and the model's values when they differ from it.
struct OutputTensor {
  const TensorView* source = nullptr;
  std::span<const float> changed;  // empty: copy the source bytes
  DType changed_dtype = DType::kF32;
  size_t bytes() const {
    return changed.empty() ? source->nbytes : changed.size() * dtype_size(changed_dtype);
  }
};

std::vector<OutputTensor> plan_tensors(const Model& model, const TensorStore& store,
                                       DType changed_dtype) {
  const auto transformable = transformable_tensors(model);
  std::vector<OutputTensor> tensors;
  for (const std::string& name : store.names()) {
    const TensorView& view = store.get(name);
    OutputTensor tensor{&view, {}, changed_dtype};
    if (const auto it = transformable.find(name); it != transformable.end()) {
      const std::span<const float> values = it->second;
      const std::vector<float> original = to_f32(view);
      if (original.size() != values.size()) {
        throw ShapeError("tensor " + name + ": the model holds " + std::to_string(values.size()) +
                         " values, " + view.file + " " + std::to_string(original.size()) +
                         " (was the model loaded from " + store.dir().string() + "?)");
      }
      // Bitwise, so that a value rounded differently still counts as changed.
      if (std::memcmp(original.data(), values.data(), values.size_bytes()) != 0) {
        tensor.changed = values;
      }
    }
    tensors.push_back(tensor);
  }
  return tensors;
}

// Consecutive runs of tensors (indices into the plan), each within max_bytes unless one tensor
// alone is larger.
std::vector<std::vector<size_t>> split_shards(const std::vector<OutputTensor>& tensors,
                                              int64_t max_bytes) {
  std::vector<std::vector<size_t>> shards;
  uint64_t shard_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t bytes = tensors[i].bytes();
    if (shards.empty() || shard_bytes + bytes > static_cast<uint64_t>(max_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += bytes;
  }
  return shards;
}

std::string shard_name(size_t index, size_t count) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

TensorData tensor_data(const OutputTensor& tensor) {
  const TensorView& view = *tensor.source;
  if (!tensor.changed.empty()) {
    return tensor.changed_dtype == DType::kBF16
               ? make_bf16_tensor(view.name, view.shape, tensor.changed)
               : make_f32_tensor(view.name, view.shape, tensor.changed);
  }
  TensorData data{view.name, view.dtype, view.shape, {}};
  data.bytes.assign(view.data, view.data + view.nbytes);
  return data;
}

void write_weights(const Model& model, const TensorStore& store, const fs::path& dir,
                   const SaveModelOptions& options) {
  const std::vector<OutputTensor> tensors = plan_tensors(model, store, options.changed_dtype);
  const std::vector<std::vector<size_t>> shards = split_shards(tensors, options.max_shard_bytes);
  ordered_json weight_map = ordered_json::object();
  uint64_t total_size = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = shard_name(s, shards.size());
    std::vector<TensorData> data;
    for (size_t i : shards[s]) {
      data.push_back(tensor_data(tensors[i]));
      weight_map[tensors[i].source->name] = name;
      total_size += data.back().bytes.size();
    }
    write_safetensors(dir / name, data);
  }
  const ordered_json index = {{"metadata", {{"total_size", total_size}}},
                              {"weight_map", std::move(weight_map)}};
  write_text_file(dir / kIndexFileName, index.dump(2) + "\n");
}

void write_config(const fs::path& source_dir, const fs::path& dir,
                  const std::optional<ordered_json>& quantmla) {
  const fs::path source = source_dir / kConfigFileName;
  ordered_json config = parse_json(read_text_file(source), source.string());
  if (!config.is_object()) throw FormatError(source.string() + ": not a JSON object");
  if (quantmla) {
    config["quantmla"] = *quantmla;
  } else {
    config.erase("quantmla");
  }
  write_text_file(dir / kConfigFileName, config.dump(2) + "\n");
}

// Tokenizer, generation config, README, ...: everything but the weights and the config, which are
// written anew.
void copy_other_files(const fs::path& source_dir, const fs::path& dir) {
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(source_dir, error)) {
    const fs::path name = entry.path().filename();
    // is_regular_file follows links: hub cache snapshots link every file to a blob.
    if (!entry.is_regular_file() || name == kConfigFileName || name == kIndexFileName ||
        name.extension() == ".safetensors") {
      continue;
    }
    fs::copy_file(entry.path(), dir / name, error);
    check_io(error, "cannot copy " + entry.path().string() + " to " + (dir / name).string());
  }
  check_io(error, "cannot list " + source_dir.string());
}

}  // namespace

void save_model_dir(const Model& model, const fs::path& source_dir, const fs::path& out_dir,
                    const SaveModelOptions& options) {
  const fs::path out = without_trailing_separator(out_dir);
  const fs::path partial = with_suffix(out, ".partial");
  if (!fs::is_directory(source_dir)) {
    throw IoError("model directory " + source_dir.string() + " does not exist");
  }
  const fs::path source = canonical_or_throw(without_trailing_separator(source_dir));
  // Replacing out_dir (or clearing a stale out_dir.partial) would delete the source.
  for (const fs::path& target : {out, partial}) {
    if (is_within(source, canonical_or_throw(target))) {
      throw InvalidArgument("output directory " + target.string() + " is or contains the source " +
                            "model directory " + source_dir.string());
    }
  }
  if (fs::exists(out) && !options.force) {
    throw InvalidArgument("output directory " + out.string() +
                          " exists; pass --force to replace it");
  }
  if (options.max_shard_bytes <= 0) {
    throw InvalidArgument("max_shard_bytes must be positive, got " +
                          std::to_string(options.max_shard_bytes));
  }
  if (options.changed_dtype != DType::kF32 && options.changed_dtype != DType::kBF16) {
    throw InvalidArgument("changed tensors can be written as F32 or BF16, not " +
                          std::string(dtype_name(options.changed_dtype)));
  }
  std::optional<ordered_json> quantmla;
  if (!options.quantmla_json.empty()) {
    quantmla = parse_json(options.quantmla_json, "quantmla config");
    if (!quantmla->is_object()) {
      throw FormatError("quantmla config " + options.quantmla_json + " is a JSON " +
                        quantmla->type_name() + ", expected an object");
    }
  }

  std::error_code error;
  // A leftover of an interrupted save: the name is ours.
  fs::remove_all(partial, error);
  check_io(error, "cannot remove " + partial.string());
  fs::create_directories(partial, error);
  check_io(error, "cannot create " + partial.string());
  try {
    const TensorStore store = TensorStore::open_dir(source_dir);
    write_weights(model, store, partial, options);
    write_config(source_dir, partial, quantmla);
    copy_other_files(source_dir, partial);
    if (fs::exists(out)) {
      fs::remove_all(out, error);
      check_io(error, "cannot remove " + out.string());
    }
    fs::rename(partial, out, error);
    check_io(error, "cannot rename " + partial.string() + " to " + out.string());
  } catch (...) {
    fs::remove_all(partial, error);
    throw;
  }
}

}  // namespace quantmla
