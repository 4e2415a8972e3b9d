#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "progress.h"
#include "quantmla/cache.h"
#include "quantmla/error.h"
#include "quantmla/eval.h"
#include "quantmla/io.h"
#include "svg_plot.h"

namespace quantmla::cli {
namespace {

struct CompareOptions {
  KldRun run;
  std::vector<std::string> caches;
  std::string csv, json, plot;
};

struct Row {
  KldResult result;
  int64_t bytes_per_token = 0;  // one layer
  double compression = 0.0;     // physical bytes of the baseline / this format, 128K tokens
  double delta_ppl_percent = 0.0;
};

// Rows are named by their format, prefixed with the transform when there is one.
std::string format_name(const CacheFormat& format, const TransformOption& transform) {
  if (transform.name == "none") return format.to_string();
  return transform.name + "(seed " + std::to_string(transform.seed) + ") " + format.to_string();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw IoError("cannot write " + path);
  out << text;
}

void run_compare(const CompareOptions& options) {
  std::vector<CacheFormat> formats;
  for (const std::string& spec : options.caches) formats.push_back(CacheFormat::parse(spec));
  const std::vector<KldResult> results = run_kld(options.run, formats, "compare");
  const ModelConfig config =
      ModelConfig::from_file(std::filesystem::path(options.run.model) / "config.json");
  const CacheShape shape{config.num_layers, config.kv_lora_rank, config.qk_rope_head_dim};
  const CacheFormat baseline = CacheFormat::parse(options.run.baseline);

  const double baseline_bytes =
      static_cast<double>(cache_physical_bytes(shape, baseline, kLongSequence));
  std::vector<Row> rows;
  for (const KldResult& r : results) {
    Row row{
        r, r.format.record_bytes(shape.kv_lora_rank, shape.rope_dim),
        baseline_bytes / static_cast<double>(cache_physical_bytes(shape, r.format, kLongSequence)),
        100.0 * (r.ppl / r.ppl_baseline - 1.0)};
    rows.push_back(row);
  }

  std::printf("baseline %s: ppl %.4f over %lld tokens (%lld windows of %lld)\n",
              baseline.to_string().c_str(), results.front().ppl_baseline,
              static_cast<long long>(results.front().tokens),
              static_cast<long long>(results.front().windows),
              static_cast<long long>(options.run.ctx));
  std::printf("%-40s %8s %8s %10s %8s %10s %9s %7s\n", "format", "B/token", "x@128K", "PPL",
              "dPPL%", "KLD mean", "KLD p99", "top-1");
  nlohmann::json json_rows = nlohmann::json::array();
  std::string csv =
      "format,bytes_per_token,compression_128k,ppl,delta_ppl_percent,kld_mean,"
      "kld_p99,top1_agree\n";
  for (const Row& row : rows) {
    const KldResult& r = row.result;
    const std::string name = format_name(r.format, options.run.transform);
    std::printf("%-40s %8lld %8.2f %10.4f %+8.2f %10.5f %9.4f %7.4f\n", name.c_str(),
                static_cast<long long>(row.bytes_per_token), row.compression, r.ppl,
                row.delta_ppl_percent, r.kld_mean, r.kld_p99, r.top1_agree);
    char line[512];
    std::snprintf(line, sizeof(line), "\"%s\",%lld,%.4f,%.6f,%.4f,%.6f,%.6f,%.6f\n", name.c_str(),
                  static_cast<long long>(row.bytes_per_token), row.compression, r.ppl,
                  row.delta_ppl_percent, r.kld_mean, r.kld_p99, r.top1_agree);
    csv += line;
    json_rows.push_back({{"format", name},
                         {"bytes_per_token", row.bytes_per_token},
                         {"compression_128k", row.compression},
                         {"ppl", r.ppl},
                         {"delta_ppl_percent", row.delta_ppl_percent},
                         {"kld_mean", r.kld_mean},
                         {"kld_p99", r.kld_p99},
                         {"top1_agree", r.top1_agree}});
  }
  if (!options.csv.empty()) write_file(options.csv, csv);
  if (!options.json.empty()) {
    const nlohmann::json out = {{"model", options.run.model},
                                {"ctx", options.run.ctx},
                                {"baseline", baseline.to_string()},
                                {"ppl_baseline", results.front().ppl_baseline},
                                {"tokens", results.front().tokens},
                                {"windows", results.front().windows},
                                {"rows", json_rows}};
    write_file(options.json, out.dump(2) + "\n");
  }
  if (!options.plot.empty()) {
    PlotPanel ppl_panel{"PPL change vs cache size", "bytes per token per layer", "dPPL %", {}};
    PlotPanel kld_panel{"KL divergence vs cache size",
                        "bytes per token per layer",
                        "KLD mean (nats, log scale)",
                        {},
                        /*log_y=*/true};
    for (const Row& row : rows) {
      const std::string name = format_name(row.result.format, options.run.transform);
      ppl_panel.points.push_back(
          {static_cast<double>(row.bytes_per_token), row.delta_ppl_percent, name});
      kld_panel.points.push_back(
          {static_cast<double>(row.bytes_per_token), row.result.kld_mean, name});
    }
    write_file(options.plot,
               render_svg("Cache formats on " + options.run.model + ", ctx " +
                              std::to_string(options.run.ctx) + ", vs " + baseline.to_string(),
                          {ppl_panel, kld_panel}));
  }
}

}  // namespace

void add_compare(CLI::App& app) {
  auto options = std::make_shared<CompareOptions>();
  CLI::App* cmd = app.add_subcommand(
      "compare", "Several cache formats on the same windows: bytes, PPL, KLD, top-1 table");
  add_kld_run_options(*cmd, options->run);
  cmd->add_option("--cache", options->caches, "A cache format (repeat for several)")
      ->required()
      ->take_all()
      ->expected(1, -1);
  cmd->add_option("--csv", options->csv, "Write the table as CSV");
  cmd->add_option("--json", options->json, "Write the table as JSON");
  cmd->add_option("--plot", options->plot, "Write an SVG plot of dPPL and KLD vs bytes/token");
  cmd->callback([options] { run_compare(*options); });
}

}  // namespace quantmla::cli
