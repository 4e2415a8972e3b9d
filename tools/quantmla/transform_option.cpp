#include "commands.h"
#include "quantmla/transform.h"

namespace quantmla::cli {

void add_transform_options(CLI::App& cmd, TransformOption& option) {
  cmd.add_option("--transform", option.name,
                 "Content-path transform folded into the weights: none | hadamard "
                 "(random-sign Walsh-Hadamard rotation per layer)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "hadamard"}));
  cmd.add_option("--seed", option.seed, "Seed of the transform's random signs")
      ->capture_default_str();
}

Model load_transformed(const std::string& dir, const TransformOption& option) {
  Model model = Model::load(dir);
  if (option.name == "hadamard") fold_random_hadamard(model, option.seed);
  return model;
}

}  // namespace quantmla::cli
