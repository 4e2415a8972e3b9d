// quantmla make-random-model: a random-weight checkpoint with the shapes of a real model (V2-Lite,
// Moonlight, V3) that Model::load and transformers read, for benchmarks at scale.
#include <omp.h>

#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "progress.h"
#include "quantmla/random_model.h"

namespace quantmla::cli {
namespace {

struct MakeRandomModelArgs {
  RandomModelOptions library;
  std::string tokenizer = std::string(kDefaultModel) + "/tokenizer.json";
  int64_t layers = 0;
  int threads = 0;
  bool config_only = false;
  // Shrinking, for tests; applied only when given.
  int64_t hidden_size = 0, intermediate_size = 0, moe_intermediate_size = 0, num_heads = 0,
          q_lora_rank = 0, num_experts = 0, experts_per_token = 0, vocab_size = 0;
  int64_t max_shard_mb = 4096;
};

void run_make_random_model(MakeRandomModelArgs& args, const CLI::App& cmd) {
  RandomModelOptions& options = args.library;
  options.tokenizer = args.tokenizer;
  options.max_shard_bytes = args.max_shard_mb << 20;
  const auto given = [&](const char* flag) { return cmd.count(flag) > 0; };
  if (given("--layers")) options.layers = args.layers;
  RandomModelOverrides& o = options.overrides;
  if (given("--hidden-size")) o.hidden_size = args.hidden_size;
  if (given("--intermediate-size")) o.intermediate_size = args.intermediate_size;
  if (given("--moe-intermediate-size")) o.moe_intermediate_size = args.moe_intermediate_size;
  if (given("--num-heads")) o.num_heads = args.num_heads;
  if (given("--q-lora-rank")) o.q_lora_rank = args.q_lora_rank;
  if (given("--num-experts")) o.n_routed_experts = args.num_experts;
  if (given("--experts-per-token")) o.num_experts_per_tok = args.experts_per_token;
  if (given("--vocab-size")) o.vocab_size = args.vocab_size;
  if (args.config_only) {
    std::fputs(random_model_config_json(options).c_str(), stdout);
    return;
  }
  if (options.out_dir.empty()) throw CLI::RequiredError("--out");
  if (args.threads > 0) omp_set_num_threads(args.threads);

  ProgressBar bar("writing MiB");
  options.progress = [&](int64_t bytes, int64_t total, int64_t, int64_t) {
    bar.update(bytes >> 20, total >> 20);
  };
  const RandomModelSummary summary = make_random_model(options);
  std::printf(
      "wrote %s: %lld tensors, %.3f B parameters, %.2f GB in %lld shard(s), %.1f s (%.2f GB/s)\n",
      options.out_dir.string().c_str(), static_cast<long long>(summary.tensors),
      static_cast<double>(summary.parameters) * 1e-9, static_cast<double>(summary.bytes) * 1e-9,
      static_cast<long long>(summary.shards), summary.seconds,
      summary.seconds > 0 ? static_cast<double>(summary.bytes) * 1e-9 / summary.seconds : 0.0);
}

}  // namespace

void add_make_random_model(CLI::App& app) {
  auto args = std::make_shared<MakeRandomModelArgs>();
  std::string presets;
  for (const std::string& name : random_model_presets()) {
    presets += (presets.empty() ? "" : " | ") + name;
  }
  CLI::App* cmd = app.add_subcommand(
      "make-random-model",
      "Write a random-weight BF16 checkpoint with a real model's config (sharded safetensors, "
      "index, tokenizer) that Model::load and transformers read");
  cmd->add_option("--preset", args->library.preset, "Model shape: " + presets)->required();
  cmd->add_option("--out", args->library.out_dir,
                  "Output model directory (required but with --config-only)");
  cmd->add_option("--layers", args->layers, "num_hidden_layers (default: the preset's)");
  cmd->add_option("--seed", args->library.seed, "Seed; the same seed gives identical files")
      ->capture_default_str();
  cmd->add_option("--tokenizer", args->tokenizer, "tokenizer.json to copy into the directory")
      ->capture_default_str();
  cmd->add_flag("--force", args->library.force, "Replace an existing output directory");
  cmd->add_option("--threads", args->threads, "Generation threads (0 = all cores)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--config-only", args->config_only,
                "Print the config.json to stdout and write nothing");
  const char* shrink = "Shrinking (for tests)";
  cmd->add_option("--hidden-size", args->hidden_size, "Override hidden_size")->group(shrink);
  cmd->add_option("--intermediate-size", args->intermediate_size, "Override intermediate_size")
      ->group(shrink);
  cmd->add_option("--moe-intermediate-size", args->moe_intermediate_size,
                  "Override moe_intermediate_size")
      ->group(shrink);
  cmd->add_option("--num-heads", args->num_heads, "Override num_attention_heads")->group(shrink);
  cmd->add_option("--q-lora-rank", args->q_lora_rank, "Override q_lora_rank (0 = q_proj)")
      ->group(shrink);
  cmd->add_option("--num-experts", args->num_experts, "Override n_routed_experts")->group(shrink);
  cmd->add_option("--experts-per-token", args->experts_per_token, "Override num_experts_per_tok")
      ->group(shrink);
  cmd->add_option("--vocab-size", args->vocab_size,
                  "Override vocab_size (bos/eos become 0/1 when the preset's do not fit)")
      ->group(shrink);
  cmd->add_option("--max-shard-mb", args->max_shard_mb, "Shard size limit in MiB")
      ->capture_default_str()
      ->check(CLI::PositiveNumber)
      ->group(shrink);
  cmd->callback([args, cmd] { run_make_random_model(*args, *cmd); });
}

}  // namespace quantmla::cli
