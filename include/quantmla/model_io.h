// Saving a model, with whatever transforms were folded into its weights, as a Hugging Face model
// directory that Model::load, transformers and other engines read like the original.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "quantmla/dtype.h"

namespace quantmla {

class Model;

struct SaveModelOptions {
  int64_t max_shard_bytes = int64_t{2} << 30;  // shards split at tensor boundaries
  // A serialized JSON object stored under config.json's "quantmla" key ("" = leave the key out,
  // dropping one the source config had: it described the source's weights).
  std::string quantmla_json;
  bool force = false;  // replace an existing out_dir
  // The dtype of the tensors the model changed: kF32 keeps the folds exact; kBF16 rounds them once
  // (to nearest even), so a BF16 checkpoint keeps its size. Any other dtype: InvalidArgument.
  DType changed_dtype = DType::kF32;
};

// Writes `model`, loaded from `source_dir` and possibly changed in memory since (e.g. by
// fold_content_transform / fold_rope_transform), as a hub-layout directory:
// - every tensor of the source, the ones the engine does not use included, in shards
//   model-0000i-of-0000n.safetensors (sorted by name, a new shard when the next tensor would pass
//   max_shard_bytes) and model.safetensors.index.json;
// - a tensor whose values the model changed is written as options.changed_dtype (F32 by default,
//   so the folded weights stay exact); every other tensor keeps its source dtype and bytes;
// - config.json as in the source, with the "quantmla" key of `options`;
// - every other regular file of source_dir (tokenizer, generation config, README, ...) copied;
//   subdirectories are not.
// Everything is written to `out_dir` + ".partial" first and renamed into place when complete, so
// a failure leaves no half-written out_dir (and, with force, the old one intact).
// Throws InvalidArgument when out_dir exists and !force, when out_dir is or contains source_dir,
// for max_shard_bytes <= 0 or a changed_dtype other than F32 and BF16; FormatError when
// quantmla_json is not a JSON object; ShapeError when the model does not match source_dir's
// tensors; IoError when a file cannot be written.
void save_model_dir(const Model& model, const std::filesystem::path& source_dir,
                    const std::filesystem::path& out_dir, const SaveModelOptions& options = {});

}  // namespace quantmla
