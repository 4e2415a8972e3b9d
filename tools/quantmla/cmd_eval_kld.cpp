#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "progress.h"
#include "quantmla/eval.h"
#include "quantmla/io.h"

namespace quantmla::cli {
namespace {

struct EvalKldOptions {
  std::string model = kDefaultModel;
  std::string ids;
  int64_t ctx = 1024;
  int64_t max_windows = 0;
  std::string cache;
  std::string baseline = "bf16";
  bool json = false;
  TransformOption transform;
};

void run_eval_kld(const EvalKldOptions& options) {
  const Model model = load_transformed(options.model, options.transform);
  // KLD is measured against the untransformed model with the baseline cache.
  const Model original = Model::load(options.model);
  const std::vector<int32_t> ids = read_ids_file(options.ids);
  ProgressBar progress("eval-kld");
  KldOptions kld_options;
  kld_options.ctx = options.ctx;
  kld_options.max_windows = options.max_windows;
  kld_options.baseline = CacheFormat::parse(options.baseline);
  kld_options.baseline_model = &original;
  kld_options.progress = [&](int64_t done, int64_t total) { progress.update(done, total); };
  const KldResult r =
      evaluate_kld(model, ids, {CacheFormat::parse(options.cache)}, kld_options).front();
  if (options.json) {
    const nlohmann::json out = {
        {"cache", r.format.to_string()}, {"baseline", kld_options.baseline.to_string()},
        {"kld_mean", r.kld_mean},        {"kld_p99", r.kld_p99},
        {"top1_agree", r.top1_agree},    {"ppl", r.ppl},
        {"ppl_bf16", r.ppl_baseline},    {"tokens", r.tokens},
        {"windows", r.windows},          {"ctx", options.ctx}};
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf(
        "cache %s vs %s: KLD mean %.5f p99 %.4f, top-1 %.4f, ppl %.4f (baseline %.4f), "
        "%lld tokens in %lld windows\n",
        r.format.to_string().c_str(), kld_options.baseline.to_string().c_str(), r.kld_mean,
        r.kld_p99, r.top1_agree, r.ppl, r.ppl_baseline, static_cast<long long>(r.tokens),
        static_cast<long long>(r.windows));
  }
}

}  // namespace

void add_eval_kld(CLI::App& app) {
  auto options = std::make_shared<EvalKldOptions>();
  CLI::App* cmd = app.add_subcommand(
      "eval-kld", "KL divergence of next-token distributions: a cache format vs the BF16 cache");
  cmd->add_option("--model", options->model, "Model directory")->capture_default_str();
  add_ids_option(*cmd, options->ids);
  add_window_options(*cmd, options->ctx, options->max_windows);
  cmd->add_option("--cache", options->cache, "Cache format under test")->required();
  cmd->add_option("--baseline", options->baseline, "Cache format of the reference distribution")
      ->capture_default_str();
  add_transform_options(*cmd, options->transform);
  cmd->add_flag("--json", options->json,
                "One JSON object: kld_mean, kld_p99, top1_agree, ppl, ppl_bf16, tokens");
  cmd->callback([options] { run_eval_kld(*options); });
}

}  // namespace quantmla::cli
