// quantmla calibrate: learns both cache paths' transforms for a cache format, folds them into the
// weights and writes the result as a model directory that records the format it was made for.
#include <omp.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "progress.h"
#include "quantmla/calibrate.h"
#include "quantmla/error.h"
#include "quantmla/io.h"
#include "quantmla/model_io.h"
#include "quantmla/tokenizer.h"

namespace quantmla::cli {
namespace {

struct CalibrateOptions {
  std::string model = kDefaultModel;
  std::string cache = "content=int4:g64,rope=int4:g64";
  std::string out;
  std::string data = "data/calib.txt";
  std::string paths = "content,rope";
  std::string folded_dtype = "f32";
  int threads = 0;
  bool force = false;
  bool json = false;
  CalibrationOptions calibration;
};

void parse_paths(const std::string& text, CalibrationOptions& options) {
  options.content = options.rope = false;
  std::stringstream stream(text);
  std::string path;
  while (std::getline(stream, path, ',')) {
    if (path == "content") {
      options.content = true;
    } else if (path == "rope") {
      options.rope = true;
    } else {
      throw InvalidArgument("--paths: unknown path '" + path + "' (content, rope)");
    }
  }
}

double reduction(double before, double after) {
  return before > 0.0 ? 100.0 * (before - after) / before : 0.0;
}

void print_report(const CalibrationReport& report) {
  std::printf("%-5s | %-9s %-21s %-21s | %-32s | %s\n", "layer", "rope obj", "QK loss",
              "output err", "content loss: RTN / start -> learned", "seconds");
  for (const LayerCalibrationReport& layer : report.layers) {
    char rope[96] = "-", content[96] = "-";
    if (layer.rope.calibrated) {
      std::snprintf(rope, sizeof(rope), "%-9.9s %.4f->%.4f (-%2.0f%%) %.4f->%.4f (-%2.0f%%)",
                    layer.rope.objective.c_str(), layer.rope.qk_before, layer.rope.qk_after,
                    reduction(layer.rope.qk_before, layer.rope.qk_after), layer.rope.output_before,
                    layer.rope.output_after,
                    reduction(layer.rope.output_before, layer.rope.output_after));
    }
    if (layer.content.calibrated) {
      std::snprintf(content, sizeof(content), "%.5f / %.5f -> %.5f (-%2.0f%%)",
                    layer.content.loss_identity, layer.content.loss_start, layer.content.loss_final,
                    reduction(layer.content.loss_start, layer.content.loss_final));
    }
    std::printf("%5lld | %-53s | %-32s | %.1f\n", static_cast<long long>(layer.layer), rope,
                content, layer.seconds);
  }
  std::printf("%lld windows, capture %.1f s, total %.1f s\n",
              static_cast<long long>(report.windows), report.capture_seconds, report.seconds);
}

nlohmann::json report_json(const CalibrateOptions& options, const CalibrationReport& report) {
  const CalibrationOptions& c = options.calibration;
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerCalibrationReport& layer : report.layers) {
    nlohmann::json entry = {{"layer", layer.layer}, {"seconds", layer.seconds}};
    if (layer.rope.calibrated) {
      entry["rope"] = {{"objective", layer.rope.objective},
                       {"qk_loss_before", layer.rope.qk_before},
                       {"qk_loss_after", layer.rope.qk_after},
                       {"output_error_before", layer.rope.output_before},
                       {"output_error_after", layer.rope.output_after},
                       {"output_error_by_objective", nlohmann::json(std::map<std::string, double>(
                                                         layer.rope.output_by_objective.begin(),
                                                         layer.rope.output_by_objective.end()))},
                       {"scales", layer.rope.scales},
                       {"angles", layer.rope.angles}};
    }
    if (layer.content.calibrated) {
      entry["content"] = {{"loss_identity", layer.content.loss_identity},
                          {"loss_start", layer.content.loss_start},
                          {"loss_final", layer.content.loss_final},
                          {"delta_exponent_query", layer.content.delta_exponent_query},
                          {"delta_exponent_value", layer.content.delta_exponent_value}};
    }
    layers.push_back(entry);
  }
  return {{"cache", report.cache.to_string()},
          {"calibration",
           {{"source_model", options.model},
            {"data", std::filesystem::path(options.data).filename().string()},
            {"samples", c.samples},
            {"held_out", c.held_out},
            {"seq", c.seq},
            {"seed", c.seed},
            {"paths", options.paths},
            {"folded_dtype", options.folded_dtype},
            {"threads", options.threads},
            {"rope_objective", c.rope_objective},
            {"content_objective", c.content_objective},
            {"rope_keys_per_window", c.rope_keys_per_window},
            {"content_queries_per_window", c.content_queries_per_window},
            {"content_steps", c.content_steps},
            {"content_batch", c.content_batch},
            {"content_learning_rate", c.content_learning_rate},
            {"requested_cache", c.cache.to_string()},
            {"clip_search", c.search_clip},
            {"rope_bf16_pairs", c.rope_bf16_pairs},
            {"seconds", report.seconds}}},
          {"layers", layers}};
}

void run_calibrate(CalibrateOptions& options) {
  // Fail before minutes of work, not after.
  if (std::filesystem::exists(options.out) && !options.force) {
    throw InvalidArgument("output directory " + options.out +
                          " exists; pass --force to replace it");
  }
  CalibrationOptions& calibration = options.calibration;
  calibration.cache = CacheFormat::parse(options.cache);
  parse_paths(options.paths, calibration);
  if (options.threads > 0) omp_set_num_threads(options.threads);
  Model model = Model::load(options.model);
  calibration.validate(model.config());
  const std::vector<int32_t> tokens = Tokenizer::from_model_dir(options.model)
                                          .encode(read_text_file_universal_newlines(options.data));

  std::unique_ptr<ProgressBar> bar;
  std::string current;
  const CalibrationReport report = calibrate(
      model, tokens, calibration, [&](const std::string& stage, int64_t done, int64_t total) {
        if (stage != current) {
          bar = std::make_unique<ProgressBar>(stage);
          current = stage;
        }
        bar->update(done, total);
      });
  const nlohmann::json recorded = report_json(options, report);
  SaveModelOptions save;
  save.quantmla_json = recorded.dump();
  save.force = options.force;
  save.changed_dtype = options.folded_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  save_model_dir(model, options.model, options.out, save);
  if (options.json) {
    std::printf("%s\n", recorded.dump(2).c_str());
  } else {
    print_report(report);
    std::printf("wrote %s (cache %s)\n", options.out.c_str(), report.cache.to_string().c_str());
  }
}

}  // namespace

void add_calibrate(CLI::App& app) {
  auto options = std::make_shared<CalibrateOptions>();
  CalibrationOptions& c = options->calibration;
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "Learn the content and RoPE transforms for a cache format, fold them into the weights and "
      "write the model directory (a plain DeepSeek checkpoint recording the format)");
  cmd->add_option("--model", options->model, "Model directory")->capture_default_str();
  cmd->add_option("--cache", options->cache, "Cache format to calibrate for")
      ->capture_default_str();
  cmd->add_option("--out", options->out, "Output model directory")->required();
  cmd->add_option("--data", options->data, "Calibration text (never the evaluation text)")
      ->capture_default_str()
      ->check(CLI::ExistingFile);
  cmd->add_option("--samples", c.samples, "Training windows")->capture_default_str();
  cmd->add_option("--held-out", c.held_out, "Held-back windows (selection and the report)")
      ->capture_default_str();
  cmd->add_option("--seq", c.seq, "Tokens per window, BOS included")->capture_default_str();
  cmd->add_option("--seed", c.seed, "Window choice and the Hadamard start")->capture_default_str();
  cmd->add_option("--paths", options->paths, "Paths to calibrate: content,rope | content | rope")
      ->capture_default_str();
  cmd->add_option("--threads", options->threads,
                  "Threads (0 = all cores); results are reproducible for a seed and thread count")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--rope-objective", c.rope_objective,
                  "auto (attention-weighted and uniform, the better on held-back output kept) | "
                  "attention | uniform | mse (ablation)")
      ->capture_default_str();
  cmd->add_option("--content-objective", c.content_objective,
                  "output (attention-output reconstruction) | mse (ablation: MSE of c)")
      ->capture_default_str();
  cmd->add_option("--steps", c.content_steps, "Riemannian SGD steps per layer (content)")
      ->capture_default_str();
  cmd->add_option("--batch", c.content_batch, "Windows per step (content)")->capture_default_str();
  cmd->add_option("--lr", c.content_learning_rate, "Rotation step size (content)")
      ->capture_default_str();
  cmd->add_option("--rope-keys", c.rope_keys_per_window, "Sampled RoPE keys per window")
      ->capture_default_str();
  cmd->add_option("--content-queries", c.content_queries_per_window,
                  "Query positions per window in the content objective, evenly spaced, each "
                  "attending to all its keys (0 = all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--rope-bf16-pairs", c.rope_bf16_pairs,
                  "Keep this many RoPE frequency pairs in BF16 (+4 bytes per pair per token per "
                  "layer), chosen by calibration")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--layers", c.layers, "Calibrate only these layers (default: all)");
  cmd->add_flag("--no-clip-search{false}", c.search_clip,
                "Keep the spec's content clipping ratio instead of searching one");
  cmd->add_option("--folded-dtype", options->folded_dtype,
                  "Dtype of the weights the transforms are folded into: f32 (the fold exact) or "
                  "bf16 (rounded once: the size of a BF16 checkpoint)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_flag("--force", options->force, "Replace an existing output directory");
  cmd->add_flag("--json", options->json, "Print the recorded settings and report as JSON");
  cmd->callback([options] { run_calibrate(*options); });
}

}  // namespace quantmla::cli
