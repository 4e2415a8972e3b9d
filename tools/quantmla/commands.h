// Subcommands of the `quantmla` program. Each registers its options on the app and runs when
// chosen.
#pragma once

#include <CLI/CLI.hpp>

namespace quantmla::cli {

// Default model directory: the bundled model, relative to the working directory.
inline constexpr const char* kDefaultModel = "models/mla-tiny";

void add_info(CLI::App& app);
void add_generate(CLI::App& app);
void add_eval_ppl(CLI::App& app);
void add_tokenize(CLI::App& app);

}  // namespace quantmla::cli
