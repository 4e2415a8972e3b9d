#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "progress.h"
#include "quantmla/error.h"
#include "quantmla/error_model.h"
#include "quantmla/io.h"

namespace quantmla::cli {
namespace {

struct ErrorModelCommand {
  std::string model = kDefaultModel;
  std::string ids;
  int64_t ctx = 1024;
  int64_t max_windows = 4;
  std::string format = "int4:g64";
  TransformOption transform;
  std::string json;
};

std::string layer_name(int64_t layer) { return layer < 0 ? "all" : std::to_string(layer); }

void run_error_model(const ErrorModelCommand& command) {
  const Model model = load_transformed(command.model, command.transform);
  const std::vector<int32_t> ids = read_ids_file(command.ids);
  ProgressBar progress("error-model");
  ErrorModelOptions options;
  options.ctx = command.ctx;
  options.max_windows = command.max_windows;
  options.format = PathFormat::parse(command.format);
  options.progress = [&](int64_t done, int64_t total) { progress.update(done, total); };
  const std::vector<Injection> rows = measure_error_model(model, ids, options);

  std::printf("%s injected into one path of one layer, everything else FP32 (ctx %lld)\n",
              options.format.to_string().c_str(), static_cast<long long>(command.ctx));
  std::printf("%-5s %-7s %11s %11s %11s %11s %11s %11s\n", "layer", "path", "cache err",
              "score rms", "score max", "attn err", "KLD", "logit rms");
  nlohmann::json json_rows = nlohmann::json::array();
  for (const Injection& r : rows) {
    std::printf("%-5s %-7s %11.5f %11.5f %11.5f %11.5f %11.6f %11.5f\n",
                layer_name(r.layer).c_str(), to_string(r.path), r.cache_rel_error,
                r.score_rms_error, r.score_max_error, r.attention_rel_error, r.kld_mean,
                r.logit_rms_error);
    json_rows.push_back({{"layer", r.layer},
                         {"path", to_string(r.path)},
                         {"cache_rel_error", r.cache_rel_error},
                         {"score_rms_error", r.score_rms_error},
                         {"score_max_error", r.score_max_error},
                         {"attention_rel_error", r.attention_rel_error},
                         {"kld_mean", r.kld_mean},
                         {"logit_rms_error", r.logit_rms_error}});
  }
  // The every-layer rows come last: content, then rope.
  const Injection& content = rows[rows.size() - 2];
  const Injection& rope = rows[rows.size() - 1];
  std::printf(
      "rope / content at equal format: cache error x%.2f, attention-logit error x%.2f, attention "
      "output error x%.2f, output KLD x%.2f\n",
      rope.cache_rel_error / content.cache_rel_error,
      rope.score_rms_error / content.score_rms_error,
      rope.attention_rel_error / content.attention_rel_error, rope.kld_mean / content.kld_mean);
  if (!command.json.empty()) {
    std::ofstream out(command.json, std::ios::trunc);
    if (!out) throw IoError("cannot write " + command.json);
    const nlohmann::json doc = {{"model", command.model},
                                {"ctx", command.ctx},
                                {"windows", command.max_windows},
                                {"format", options.format.to_string()},
                                {"transform", command.transform.name},
                                {"rows", json_rows}};
    out << doc.dump(2) << "\n";
  }
}

}  // namespace

void add_error_model(CLI::App& app) {
  auto command = std::make_shared<ErrorModelCommand>();
  CLI::App* cmd = app.add_subcommand(
      "error-model",
      "Per layer and path: quantize that path alone and measure the attention-logit, "
      "attention-output and output errors it causes");
  cmd->add_option("--model", command->model, "Model directory")->capture_default_str();
  add_ids_option(*cmd, command->ids);
  add_window_options(*cmd, command->ctx, command->max_windows);
  cmd->add_option("--format", command->format,
                  "Path format injected, the same on either path (e.g. int4:g64, int2:g32, fp8)")
      ->capture_default_str();
  add_transform_options(*cmd, command->transform);
  cmd->add_option("--json", command->json, "Write the rows as JSON");
  cmd->callback([command] { run_error_model(*command); });
}

}  // namespace quantmla::cli
