#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "commands.h"
#include "progress.h"
#include "quantmla/error.h"
#include "quantmla/passkey.h"

namespace quantmla::cli {
namespace {

struct EvalPasskeyOptions {
  std::string model = kDefaultModel;
  std::string prompts;
  std::string cache;     // "" = recorded in the model's config.json, else f32
  int64_t ctx = 0;       // 0 = every context
  int64_t per_cell = 0;  // 0 = every prompt of a (ctx, depth) cell
  bool json = false;
  TransformOption transform;
  std::string device = "cpu";
};

// The prompts to run: those of --ctx, the first --per-cell of each (ctx, depth) cell.
std::vector<PasskeyPrompt> select_prompts(std::vector<PasskeyPrompt> prompts,
                                          const EvalPasskeyOptions& options) {
  std::vector<PasskeyPrompt> chosen;
  std::map<std::pair<int64_t, double>, int64_t> taken;
  for (PasskeyPrompt& prompt : prompts) {
    if (options.ctx != 0 && prompt.ctx != options.ctx) continue;
    int64_t& count = taken[{prompt.ctx, prompt.depth}];
    if (options.per_cell != 0 && count >= options.per_cell) continue;
    ++count;
    chosen.push_back(std::move(prompt));
  }
  if (chosen.empty()) {
    throw InvalidArgument(options.prompts + ": no prompt for context " +
                          std::to_string(options.ctx));
  }
  return chosen;
}

std::string depth_key(double depth) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", depth);
  return text;
}

void run_eval_passkey(const EvalPasskeyOptions& options) {
  const std::vector<PasskeyPrompt> prompts =
      select_prompts(load_passkey_prompts(options.prompts), options);
  std::unique_ptr<Model> model;
  const std::unique_ptr<Runner> runner =
      make_runner(options.device, options.model, options.transform, model);
  PasskeyOptions passkey_options;
  passkey_options.cache = device_cache(options.device, options.model, options.cache, "f32");
  ProgressBar progress("eval-passkey");
  passkey_options.progress = [&](int64_t done, int64_t total) { progress.update(done, total); };
  const PasskeyResult result = evaluate_passkey(*runner, prompts, passkey_options);

  // The prompts answered wrongly, with what came out instead: what a user looks at next.
  nlohmann::json failures = nlohmann::json::array();
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (result.correct[i]) continue;
    failures.push_back({{"index", prompts[i].index},
                        {"ctx", prompts[i].ctx},
                        {"depth", prompts[i].depth},
                        {"answer", prompts[i].answer},
                        {"output", result.outputs[i]}});
  }
  if (options.json) {
    nlohmann::json by_ctx = nlohmann::json::object();
    nlohmann::json by_depth = nlohmann::json::object();
    for (const auto& [ctx, count] : result.by_ctx) by_ctx[std::to_string(ctx)] = count.accuracy();
    for (const auto& [depth, count] : result.by_depth)
      by_depth[depth_key(depth)] = count.accuracy();
    const nlohmann::json out = {{"acc", result.total.accuracy()},
                                {"acc_by_ctx", by_ctx},
                                {"acc_by_depth", by_depth},
                                {"n", result.total.n},
                                {"correct", result.total.correct},
                                {"cache", passkey_options.cache.to_string()},
                                {"transform", options.transform.name},
                                {"failures", failures}};
    std::printf("%s\n", out.dump().c_str());
    return;
  }
  std::printf("pass-key accuracy %.3f (%lld of %lld prompts, cache %s)\n", result.total.accuracy(),
              static_cast<long long>(result.total.correct), static_cast<long long>(result.total.n),
              passkey_options.cache.to_string().c_str());
  for (const auto& [ctx, count] : result.by_ctx) {
    std::printf("  ctx %-6lld %.3f (%lld/%lld)\n", static_cast<long long>(ctx), count.accuracy(),
                static_cast<long long>(count.correct), static_cast<long long>(count.n));
  }
  for (const auto& [depth, count] : result.by_depth) {
    std::printf("  depth %s %.3f (%lld/%lld)\n", depth_key(depth).c_str(), count.accuracy(),
                static_cast<long long>(count.correct), static_cast<long long>(count.n));
  }
  for (const nlohmann::json& failure : failures) {
    std::printf("  wrong: prompt %s (ctx %s, depth %.2f): answer %s, output %s\n",
                failure["index"].dump().c_str(), failure["ctx"].dump().c_str(),
                failure["depth"].get<double>(), failure["answer"].dump().c_str(),
                failure["output"].dump().c_str());
  }
}

}  // namespace

void add_eval_passkey(CLI::App& app) {
  auto options = std::make_shared<EvalPasskeyOptions>();
  CLI::App* cmd = app.add_subcommand(
      "eval-passkey",
      "Pass-key retrieval: prefill each prompt into the cache, decode the answer greedily through "
      "it, exact match");
  cmd->add_option("--model", options->model, "Model directory")->capture_default_str();
  cmd->add_option("--prompts", options->prompts,
                  "Prompts file: JSON array of {ctx, depth, prompt, answer} (token ids)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--cache", options->cache,
                  "Cache format, e.g. content=int4:g64,rope=int4:g64 (f32 = exact); default: the "
                  "spec quantmla calibrate recorded in the model's config.json, else f32");
  cmd->add_option("--ctx", options->ctx, "Only the prompts built for this context (0 = all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--per-cell", options->per_cell,
                  "Only the first N prompts of each (context, depth) cell (0 = all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  add_transform_options(*cmd, options->transform);
  add_device_option(*cmd, options->device);
  cmd->add_flag("--json", options->json,
                "Print one JSON object {acc, acc_by_ctx, acc_by_depth, n, correct, cache, "
                "transform, failures: [{index, ctx, depth, answer, output}]}");
  cmd->callback([options] { run_eval_passkey(*options); });
}

}  // namespace quantmla::cli
