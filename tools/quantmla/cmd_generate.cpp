#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "quantmla/error.h"
#include "quantmla/generate.h"
#include "quantmla/tokenizer.h"
#include "tokenizer/utf8.h"

namespace quantmla::cli {
namespace {

struct GenerateCliOptions {
  std::string model = kDefaultModel;
  std::string prompt;
  int64_t max_tokens = 64;
  float temperature = 0.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
  LogitsControls controls;
  std::string cache;  // "" = recorded in the model's config.json, else f32 (bf16 on cuda)
  std::string device = "cpu";
};

void run_generate(const GenerateCliOptions& options) {
  if (options.prompt.empty()) throw InvalidArgument("empty prompt: --prompt needs some text");
  const Tokenizer tokenizer = Tokenizer::from_model_dir(options.model);
  std::unique_ptr<Model> model;
  const std::unique_ptr<Runner> runner = make_runner(options.device, options.model, {}, model);
  std::vector<int32_t> prompt{static_cast<int32_t>(runner->config().bos_token_id)};
  const std::vector<int32_t> encoded = tokenizer.encode(options.prompt);
  prompt.insert(prompt.end(), encoded.begin(), encoded.end());

  GenerateOptions generate_options;
  generate_options.max_tokens = options.max_tokens;
  generate_options.sampling = {options.temperature, options.top_p, options.seed};
  generate_options.controls = options.controls;
  generate_options.cache = device_cache(options.device, options.model, options.cache, "f32");

  // Checked before the prompt is echoed, so that a bad option prints only its error.
  check_sampler_options(generate_options.sampling);
  check_logits_controls(generate_options.controls, runner->config().vocab_size);
  std::printf("%s", options.prompt.c_str());
  std::string pending;
  generate(*runner, prompt, generate_options, [&](int32_t token) {
    if (tokenizer.knows(token)) pending += tokenizer.token_bytes(token);
    const size_t ready = detail::complete_utf8_prefix(pending);
    std::fwrite(pending.data(), 1, ready, stdout);
    std::fflush(stdout);
    pending.erase(0, ready);
    return true;
  });
  std::fwrite(pending.data(), 1, pending.size(), stdout);
  std::printf("\n");
}

}  // namespace

void add_generate(CLI::App& app) {
  auto options = std::make_shared<GenerateCliOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Stream a continuation of a prompt to stdout");
  cmd->add_option("--model", options->model, "Model directory")->capture_default_str();
  cmd->add_option("--prompt", options->prompt, "Prompt text (BOS is prepended)")->required();
  cmd->add_option("--max-tokens", options->max_tokens, "Tokens to generate")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--temperature", options->temperature, "0 = greedy")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", options->top_p, "Nucleus sampling mass, in (0, 1]")
      ->capture_default_str();
  cmd->add_option("--seed", options->seed, "Random seed for sampling")->capture_default_str();
  LogitsControls& controls = options->controls;
  cmd->add_option("--top-k", controls.top_k, "Keep the k most likely tokens (0: all)")
      ->capture_default_str();
  cmd->add_option("--min-p", controls.min_p,
                  "Drop tokens less likely than this fraction of the most likely one (0: none)")
      ->capture_default_str();
  cmd->add_option("--repetition-penalty", controls.repetition_penalty,
                  "Penalty on the tokens of the prompt and the output (1: none)")
      ->capture_default_str();
  cmd->add_option("--presence-penalty", controls.presence_penalty,
                  "Subtracted from the logit of every token generated so far, in [-2, 2]")
      ->capture_default_str();
  cmd->add_option("--frequency-penalty", controls.frequency_penalty,
                  "Subtracted per time a token was generated so far, in [-2, 2]")
      ->capture_default_str();
  cmd->add_option("--cache", options->cache,
                  "Cache format, e.g. content=int4:g64,rope=int4:g64; default: the spec quantmla "
                  "calibrate recorded in the model's config.json, else f32");
  add_device_option(*cmd, options->device);
  cmd->callback([options] { run_generate(*options); });
}

}  // namespace quantmla::cli
