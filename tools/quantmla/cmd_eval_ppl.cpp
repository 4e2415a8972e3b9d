#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "progress.h"
#include "quantmla/eval.h"
#include "quantmla/io.h"
#include "quantmla/tokenizer.h"

namespace quantmla::cli {
namespace {

struct EvalPplOptions {
  std::string model = kDefaultModel;
  std::string text;
  std::string ids;
  int64_t ctx = 1024;
  int64_t max_windows = 0;
  int64_t chunk = 0;  // tokens of each window a step; 0: the whole window
  std::string cache;  // "" = recorded in the model's config.json, else f32
  bool json = false;
  TransformOption transform;
  std::string device = "cpu";
};

void run_eval_ppl(const EvalPplOptions& options) {
  std::unique_ptr<Model> model;
  const std::unique_ptr<Runner> runner =
      make_runner(options.device, options.model, options.transform, model);
  std::vector<int32_t> ids;
  if (!options.ids.empty()) {
    ids = read_ids_file(options.ids);
  } else {
    ids = Tokenizer::from_model_dir(options.model)
              .encode(read_text_file_universal_newlines(options.text));
  }
  ProgressBar progress("eval-ppl");
  PerplexityOptions ppl_options;
  ppl_options.ctx = options.ctx;
  ppl_options.max_windows = options.max_windows;
  ppl_options.cache = device_cache(options.device, options.model, options.cache, "f32");
  ppl_options.chunk_tokens = options.chunk;
  ppl_options.progress = [&](int64_t done, int64_t total) { progress.update(done, total); };
  // The CPU runs one window at a time (each fills the cores); the GPU runs many side by side.
  if (options.device == "cpu") ppl_options.windows_per_step = 1;
  const PerplexityResult result = evaluate_perplexity(*runner, ids, ppl_options);
  if (options.json) {
    const nlohmann::json out = {{"ppl", result.ppl},
                                {"tokens", result.tokens},
                                {"windows", result.windows},
                                {"ctx", options.ctx},
                                {"chunk", options.chunk},
                                {"cache", ppl_options.cache.to_string()},
                                {"transform", options.transform.name},
                                {"device", runner->device()}};
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("ppl %.4f  tokens %lld  windows %lld  (ctx %lld, cache %s)\n", result.ppl,
                static_cast<long long>(result.tokens), static_cast<long long>(result.windows),
                static_cast<long long>(options.ctx), ppl_options.cache.to_string().c_str());
  }
}

}  // namespace

void add_eval_ppl(CLI::App& app) {
  auto options = std::make_shared<EvalPplOptions>();
  CLI::App* cmd = app.add_subcommand(
      "eval-ppl", "Perplexity with the window protocol: [BOS] + (ctx-1)-token segments");
  cmd->add_option("--model", options->model, "Model directory")->capture_default_str();
  auto* text = cmd->add_option("--text", options->text, "Raw text file (tokenized here)")
                   ->check(CLI::ExistingFile);
  auto* ids = cmd->add_option("--ids", options->ids, "Token ids, little-endian int32, no BOS")
                  ->check(CLI::ExistingFile);
  text->excludes(ids);
  ids->excludes(text);
  add_window_options(*cmd, options->ctx, options->max_windows);
  cmd->add_option("--cache", options->cache,
                  "Cache format, e.g. content=int4:g64,rope=int4:g64 (f32 = exact); default: the "
                  "spec quantmla calibrate recorded in the model's config.json, else f32");
  cmd->add_option("--chunk", options->chunk,
                  "Feed each window N tokens a step (1: every position as a teacher-forced decode "
                  "step, through the decode attention; 0: the whole window as one prefill)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  add_transform_options(*cmd, options->transform);
  add_device_option(*cmd, options->device);
  cmd->add_flag("--json", options->json, "Print one JSON object {ppl, tokens, windows}");
  cmd->callback([options, cmd] {
    if (options->text.empty() && options->ids.empty()) {
      throw CLI::RequiredError("eval-ppl needs --text FILE or --ids FILE.i32");
    }
    run_eval_ppl(*options);
  });
}

}  // namespace quantmla::cli
