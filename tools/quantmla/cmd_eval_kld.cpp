#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "quantmla/error.h"
#include "quantmla/eval.h"

namespace quantmla::cli {
namespace {

struct EvalKldOptions {
  KldRun run;
  std::string cache;  // "" = recorded in the model's config.json
  bool json = false;
};

void run_eval_kld(const EvalKldOptions& options) {
  const std::string spec = cache_spec_or_recorded(options.run.model, options.cache, "");
  if (spec.empty()) {
    throw InvalidArgument("eval-kld needs --cache SPEC: " + options.run.model +
                          "/config.json records no cache spec");
  }
  const KldResult r = run_kld(options.run, {CacheFormat::parse(spec)}, "eval-kld").front();
  const std::string baseline = CacheFormat::parse(options.run.baseline).to_string();
  const std::string& baseline_model =
      options.run.baseline_model.empty() ? options.run.model : options.run.baseline_model;
  if (options.json) {
    const nlohmann::json out = {{"cache", r.format.to_string()},
                                {"baseline", baseline},
                                {"kld_mean", r.kld_mean},
                                {"kld_p99", r.kld_p99},
                                {"top1_agree", r.top1_agree},
                                {"ppl", r.ppl},
                                {"ppl_bf16", r.ppl_baseline},
                                {"tokens", r.tokens},
                                {"windows", r.windows},
                                {"ctx", options.run.ctx},
                                {"baseline_model", baseline_model}};
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf(
        "cache %s vs %s: KLD mean %.5f p99 %.4f, top-1 %.4f, ppl %.4f (baseline %.4f), "
        "%lld tokens in %lld windows\n",
        r.format.to_string().c_str(), baseline.c_str(), r.kld_mean, r.kld_p99, r.top1_agree, r.ppl,
        r.ppl_baseline, static_cast<long long>(r.tokens), static_cast<long long>(r.windows));
  }
}

}  // namespace

void add_eval_kld(CLI::App& app) {
  auto options = std::make_shared<EvalKldOptions>();
  CLI::App* cmd = app.add_subcommand(
      "eval-kld", "KL divergence of next-token distributions: a cache format vs the BF16 cache");
  add_kld_run_options(*cmd, options->run);
  cmd->add_option("--cache", options->cache,
                  "Cache format under test (default: the spec quantmla calibrate recorded in the "
                  "model's config.json)");
  cmd->add_flag("--json", options->json,
                "One JSON object: kld_mean, kld_p99, top1_agree, ppl, ppl_bf16, tokens, "
                "baseline_model");
  cmd->callback([options] { run_eval_kld(*options); });
}

}  // namespace quantmla::cli
