#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "quantmla/io.h"
#include "quantmla/tokenizer.h"

namespace quantmla::cli {
namespace {

struct TokenizeOptions {
  std::string model = kDefaultModel;
  std::string text;
  std::string out;
};

void run_tokenize(const TokenizeOptions& options) {
  const Tokenizer tokenizer = Tokenizer::from_model_dir(options.model);
  const std::vector<int32_t> ids =
      tokenizer.encode(read_text_file_universal_newlines(options.text));
  write_ids_file(options.out, ids);
  std::fprintf(stderr, "%zu tokens written to %s\n", ids.size(), options.out.c_str());
}

}  // namespace

void add_tokenize(CLI::App& app) {
  auto options = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize", "Encode a whole text file into little-endian int32 ids (no BOS)");
  cmd->add_option("--model", options->model, "Model directory (its tokenizer.json)")
      ->capture_default_str();
  cmd->add_option("--text", options->text, "Text file")->required()->check(CLI::ExistingFile);
  cmd->add_option("--out", options->out, "Output .i32 file")->required();
  cmd->callback([options] { run_tokenize(*options); });
}

}  // namespace quantmla::cli
