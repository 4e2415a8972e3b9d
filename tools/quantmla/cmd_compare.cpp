#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "quantmla/cache.h"
#include "quantmla/error.h"
#include "quantmla/eval.h"
#include "svg_plot.h"
#include "tally_file.h"

namespace quantmla::cli {
namespace {

struct ReportOptions {
  std::string csv, json, plot;
};

struct CompareOptions {
  KldRun run;
  std::vector<std::string> caches;
  std::string save_tally;
  ReportOptions report;
};

struct MergeOptions {
  std::vector<std::string> tallies;
  ReportOptions report;
};

// Rows are named by their format, prefixed with the transform when there is one.
std::string format_name(const CacheFormat& format, const TransformOption& transform) {
  if (transform.name == "none") return format.to_string();
  return transform.name + "(seed " + std::to_string(transform.seed) + ") " + format.to_string();
}

// A row's name shortened for the plot, where the long names would crowd the panels:
// "hadamard(seed 0) content=int2:g64,rope=int4:g64" becomes "hadamard int2:g64 / int4:g64"
// (content / rope). A name not built by format_name is kept as it is.
std::string plot_label(const std::string& name, const CacheFormat& format) {
  const std::string spelled = format.to_string();
  const std::string label = format.content.to_string() + " / " + format.rope.to_string();
  if (name == spelled) return label;
  if (!name.ends_with(" " + spelled)) return name;
  const std::string transform = name.substr(0, name.size() - spelled.size() - 1);
  return transform.substr(0, transform.find('(')) + " " + label;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw IoError("cannot write " + path);
  out << text;
}

// Prints the table and writes the CSV, JSON and plot the options ask for. Every row was measured
// on the same windows against the same baseline.
void report(const TallyFile& measured, const ReportOptions& options) {
  const CacheFormat baseline = CacheFormat::parse(measured.baseline);
  const double baseline_bytes =
      static_cast<double>(cache_physical_bytes(measured.shape, baseline, kLongSequence));
  struct Row {
    std::string name;
    KldResult result;
    int64_t bytes_per_token;  // one layer
    double compression;       // physical bytes of the baseline / this format, 128K tokens
    double delta_ppl_percent;
  };
  std::vector<Row> rows;
  for (const TallyRow& tallied : measured.rows) {
    KldResult r = summarize_kld(tallied.format, tallied.tally);
    const int64_t bytes =
        r.format.record_bytes(measured.shape.kv_lora_rank, measured.shape.rope_dim);
    const double compression = baseline_bytes / static_cast<double>(cache_physical_bytes(
                                                    measured.shape, r.format, kLongSequence));
    const double delta = 100.0 * (r.ppl / r.ppl_baseline - 1.0);
    rows.push_back({tallied.name, std::move(r), bytes, compression, delta});
  }
  const KldResult& first = rows.front().result;

  std::printf("baseline %s: ppl %.4f over %lld tokens (%lld windows of %lld)\n",
              baseline.to_string().c_str(), first.ppl_baseline,
              static_cast<long long>(first.tokens), static_cast<long long>(first.windows),
              static_cast<long long>(measured.ctx));
  std::printf("%-40s %8s %8s %10s %8s %10s %9s %7s\n", "format", "B/token", "x@128K", "PPL",
              "dPPL%", "KLD mean", "KLD p99", "top-1");
  nlohmann::json json_rows = nlohmann::json::array();
  std::string csv =
      "format,bytes_per_token,compression_128k,ppl,delta_ppl_percent,kld_mean,"
      "kld_p99,top1_agree\n";
  for (const Row& row : rows) {
    const KldResult& r = row.result;
    std::printf("%-40s %8lld %8.2f %10.4f %+8.2f %10.5f %9.4f %7.4f\n", row.name.c_str(),
                static_cast<long long>(row.bytes_per_token), row.compression, r.ppl,
                row.delta_ppl_percent, r.kld_mean, r.kld_p99, r.top1_agree);
    char line[512];
    std::snprintf(line, sizeof(line), "\"%s\",%lld,%.4f,%.6f,%.4f,%.6f,%.6f,%.6f\n",
                  row.name.c_str(), static_cast<long long>(row.bytes_per_token), row.compression,
                  r.ppl, row.delta_ppl_percent, r.kld_mean, r.kld_p99, r.top1_agree);
    csv += line;
    json_rows.push_back({{"format", row.name},
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
    const nlohmann::json out = {{"model", measured.model},
                                {"ctx", measured.ctx},
                                {"baseline", baseline.to_string()},
                                {"ppl_baseline", first.ppl_baseline},
                                {"tokens", first.tokens},
                                {"windows", first.windows},
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
    // Dropping the seed can make two rows' labels equal; those keep their full names.
    std::map<std::string, int> uses;
    for (const Row& row : rows) ++uses[plot_label(row.name, row.result.format)];
    for (const Row& row : rows) {
      const auto bytes = static_cast<double>(row.bytes_per_token);
      std::string label = plot_label(row.name, row.result.format);
      if (uses[label] > 1) label = row.name;
      ppl_panel.points.push_back({bytes, row.delta_ppl_percent, label});
      kld_panel.points.push_back({bytes, row.result.kld_mean, std::move(label)});
    }
    write_file(options.plot,
               render_svg("Cache formats on " + measured.model + ", ctx " +
                              std::to_string(measured.ctx) + ", vs " + baseline.to_string(),
                          {ppl_panel, kld_panel}));
  }
}

void run_compare(const CompareOptions& options) {
  std::vector<std::string> specs = options.caches;
  if (specs.empty()) {
    const std::string recorded = cache_spec_or_recorded(options.run.model, "", "");
    if (recorded.empty()) {
      throw InvalidArgument("compare needs --cache SPEC (repeat for several): " +
                            options.run.model + "/config.json records no cache spec");
    }
    specs.push_back(recorded);
  }
  std::vector<CacheFormat> formats;
  for (const std::string& spec : specs) formats.push_back(CacheFormat::parse(spec));
  std::vector<KldResult> results = run_kld(options.run, formats, "compare");
  const ModelConfig config =
      ModelConfig::from_file(std::filesystem::path(options.run.model) / "config.json");
  TallyFile measured{options.run.model,
                     options.run.ctx,
                     CacheFormat::parse(options.run.baseline).to_string(),
                     {config.num_layers, config.kv_lora_rank, config.qk_rope_head_dim},
                     {}};
  for (KldResult& r : results) {
    measured.rows.push_back(
        {format_name(r.format, options.run.transform), r.format, std::move(r.tally)});
  }
  if (!options.save_tally.empty()) write_tally_file(options.save_tally, measured);
  report(measured, options.report);
}

// Rows of the same name from several files are one row measured on different windows: their
// tallies merge. Rows keep the order in which their names first appear.
void run_compare_merge(const MergeOptions& options) {
  TallyFile merged;
  std::vector<std::vector<KldTally>> parts;
  std::map<std::string, size_t> index;
  for (const std::string& path : options.tallies) {
    TallyFile file = read_tally_file(path);
    if (merged.rows.empty() && parts.empty()) {
      merged.model = file.model;
      merged.ctx = file.ctx;
      merged.baseline = file.baseline;
      merged.shape = file.shape;
    } else if (file.ctx != merged.ctx || file.baseline != merged.baseline ||
               file.shape != merged.shape) {
      throw InvalidArgument("tally file " + path + " (ctx " + std::to_string(file.ctx) +
                            ", baseline " + file.baseline + ") was not measured like " +
                            options.tallies.front() + " (ctx " + std::to_string(merged.ctx) +
                            ", baseline " + merged.baseline + ")");
    }
    for (TallyRow& row : file.rows) {
      auto [it, inserted] = index.try_emplace(row.name, merged.rows.size());
      if (inserted) {
        merged.rows.push_back({row.name, row.format, {}});
        parts.emplace_back();
      }
      parts[it->second].push_back(std::move(row.tally));
    }
  }
  for (size_t r = 0; r < merged.rows.size(); ++r) {
    try {
      merged.rows[r].tally = merge_kld_tallies(std::move(parts[r]));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument("row " + merged.rows[r].name + ": " + e.what());
    }
  }
  // Every row must cover the same windows, or the table would compare different texts.
  for (const TallyRow& row : merged.rows) {
    const KldTally& a = row.tally;
    const KldTally& b = merged.rows.front().tally;
    if (a.first_window != b.first_window || a.windows != b.windows) {
      throw InvalidArgument(
          "row " + row.name + " covers windows [" + std::to_string(a.first_window) + ", " +
          std::to_string(a.first_window + a.windows) + "), row " + merged.rows.front().name +
          " covers [" + std::to_string(b.first_window) + ", " +
          std::to_string(b.first_window + b.windows) + ")");
    }
  }
  report(merged, options.report);
}

void add_report_options(CLI::App& cmd, ReportOptions& options) {
  cmd.add_option("--csv", options.csv, "Write the table as CSV");
  cmd.add_option("--json", options.json, "Write the table as JSON");
  cmd.add_option("--plot", options.plot, "Write an SVG plot of dPPL and KLD vs bytes/token");
}

}  // namespace

void add_compare(CLI::App& app) {
  auto options = std::make_shared<CompareOptions>();
  CLI::App* cmd = app.add_subcommand(
      "compare", "Several cache formats on the same windows: bytes, PPL, KLD, top-1 table");
  add_kld_run_options(*cmd, options->run);
  cmd->add_option("--cache", options->caches,
                  "A cache format (repeat for several; default: the spec quantmla calibrate "
                  "recorded in the model's config.json)")
      ->take_all()
      ->expected(1, -1);
  add_report_options(*cmd, options->report);
  cmd->add_option("--save-tally", options->save_tally,
                  "Also write the raw per-token results, for compare-merge");
  cmd->callback([options] { run_compare(*options); });
}

void add_compare_merge(CLI::App& app) {
  auto options = std::make_shared<MergeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "compare-merge",
      "One compare table from tally files of runs over consecutive window ranges (--save-tally)");
  cmd->add_option("tallies", options->tallies, "Tally files")->required()->check(CLI::ExistingFile);
  add_report_options(*cmd, options->report);
  cmd->callback([options] { run_compare_merge(*options); });
}

}  // namespace quantmla::cli
