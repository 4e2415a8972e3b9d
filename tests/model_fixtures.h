// Loads each fixture model once per test binary (loading converts every weight to FP32).
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "quantmla/model.h"
#include "test_paths.h"

namespace quantmla::testing {

inline const Model& cached_model(const std::filesystem::path& dir) {
  static std::map<std::string, std::unique_ptr<Model>> models;
  auto& slot = models[dir.string()];
  if (!slot) slot = std::make_unique<Model>(Model::load(dir));
  return *slot;
}

inline const Model& mla_tiny() { return cached_model(bundled_model()); }
inline const Model& mla_tiny_moe() { return cached_model(shared_dir() / "models/mla-tiny-moe"); }
inline const Model& mla_tiny_v2() { return cached_model(shared_dir() / "models/mla-tiny-v2-4k"); }

}  // namespace quantmla::testing
