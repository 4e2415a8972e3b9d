// The command-line program end to end: happy paths on the bundled model, and every kind of bad
// input a user can give it, each answered by a clear message on stderr and a non-zero exit.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "cli_runner.h"
#include "quantmla/io.h"
#include "quantmla/model.h"
#include "quantmla/model_io.h"
#include "quantmla/safetensors.h"

namespace quantmla {
namespace {

namespace fs = std::filesystem;
using testing::CliResult;
using testing::run_cli;
using testing::shared_dir;

// A fresh scratch directory per test.
class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    scratch_ =
        fs::temp_directory_path() / ("quantmla-cli-test-" + std::to_string(std::random_device{}()));
    fs::create_directories(scratch_);
  }
  void TearDown() override { fs::remove_all(scratch_); }

  // A copy of the MoE fixture (one FP32 safetensors file) with tensors and config edited.
  fs::path copy_moe_model(const std::function<void(std::vector<TensorData>&)>& edit_tensors,
                          const std::function<void(nlohmann::json&)>& edit_config = {}) {
    const fs::path source = shared_dir() / "models/mla-tiny-moe";
    const fs::path dest = scratch_ / "model";
    fs::create_directories(dest);
    nlohmann::json config = nlohmann::json::parse(read_text_file(source / "config.json"));
    if (edit_config) edit_config(config);
    std::ofstream(dest / "config.json") << config.dump(2);
    const auto file = SafetensorsFile::open(source / "model.safetensors");
    std::vector<TensorData> tensors;
    for (const TensorView& view : file->tensors()) {
      TensorData data{view.name, view.dtype, view.shape, {}};
      data.bytes.assign(view.data, view.data + view.nbytes);
      tensors.push_back(std::move(data));
    }
    if (edit_tensors) edit_tensors(tensors);
    write_safetensors(dest / "model.safetensors", tensors);
    return dest;
  }

  fs::path scratch_;
};

void expect_failure(const CliResult& result, std::initializer_list<std::string> fragments) {
  EXPECT_NE(result.exit_code, 0);
  for (const std::string& fragment : fragments) {
    EXPECT_NE(result.err.find(fragment), std::string::npos)
        << "stderr lacks \"" << fragment << "\":\n"
        << result.err;
  }
}

TEST_F(CliTest, HelpEverywhere) {
  for (const char* command : {"", "info ", "generate ", "eval-ppl ", "tokenize ", "eval-kld ",
                              "compare ", "eval-passkey "}) {
    const CliResult result = run_cli(std::string(command) + "--help");
    EXPECT_EQ(result.exit_code, 0) << command;
    EXPECT_NE(result.out.find("--"), std::string::npos) << command;
  }
}

TEST_F(CliTest, InfoJsonDescribesBundledModel) {
  const CliResult result = run_cli("info --json");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const auto info = nlohmann::json::parse(result.out);
  EXPECT_EQ(info["model_type"], "deepseek_v3");
  EXPECT_EQ(info["num_layers"], 6);
  EXPECT_EQ(info["kv_lora_rank"], 512);
  EXPECT_EQ(info["cache_bytes_per_token_per_layer"]["bf16"], 1152);
  EXPECT_GT(info["parameters"].get<int64_t>(), 25'000'000);
}

TEST_F(CliTest, GreedyGenerateIsDeterministic) {
  const std::string args = "generate --prompt 'The package' --max-tokens 8 --temperature 0";
  const CliResult first = run_cli(args);
  const CliResult second = run_cli(args);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_EQ(first.out.rfind("The package", 0), 0u);
  EXPECT_GT(first.out.size(), std::string("The package\n").size());
  EXPECT_EQ(first.out, second.out);
}

// top-k 1 is greedy at any temperature; a control out of its range fails before any output.
TEST_F(CliTest, GenerateTakesSamplingControls) {
  const std::string args = "generate --prompt 'The package' --max-tokens 8";
  const CliResult greedy = run_cli(args + " --temperature 0");
  const CliResult top1 = run_cli(args + " --temperature 1.5 --seed 9 --top-k 1");
  ASSERT_EQ(top1.exit_code, 0) << top1.err;
  EXPECT_EQ(top1.out, greedy.out);
  const CliResult penalized =
      run_cli(args + " --temperature 0 --repetition-penalty 1.5 --presence-penalty 1");
  ASSERT_EQ(penalized.exit_code, 0) << penalized.err;
  EXPECT_NE(penalized.out, greedy.out);
  const CliResult bad = run_cli(args + " --min-p 3");
  expect_failure(bad, {"min_p is 3", "[0, 1]"});
  EXPECT_EQ(bad.out, "");
}

TEST_F(CliTest, EvalPplJsonFromIdsAndTextAgree) {
  const std::string ids = (shared_dir() / "reference/wikitext2-test.ids.i32").string();
  const CliResult from_ids =
      run_cli("eval-ppl --ids '" + ids + "' --ctx 128 --max-windows 2 --json");
  const CliResult from_text =
      run_cli("eval-ppl --text data/wikitext2-test.raw --ctx 128 --max-windows 2 --json");
  ASSERT_EQ(from_ids.exit_code, 0) << from_ids.err;
  ASSERT_EQ(from_text.exit_code, 0) << from_text.err;
  const auto a = nlohmann::json::parse(from_ids.out);
  const auto b = nlohmann::json::parse(from_text.out);
  EXPECT_EQ(a["tokens"], 254);
  EXPECT_EQ(a["windows"], 2);
  EXPECT_DOUBLE_EQ(a["ppl"].get<double>(), b["ppl"].get<double>());
  EXPECT_GT(a["ppl"].get<double>(), 1.0);
  // The same windows fed 16 tokens a step (the runner's chunked path; test_runner.cpp bounds it).
  const CliResult chunked =
      run_cli("eval-ppl --ids '" + ids + "' --ctx 128 --max-windows 2 --chunk 16 --json");
  ASSERT_EQ(chunked.exit_code, 0) << chunked.err;
  const auto c = nlohmann::json::parse(chunked.out);
  EXPECT_EQ(c["chunk"], 16);
  EXPECT_EQ(c["tokens"], 254);
  EXPECT_NEAR(c["ppl"].get<double>() / a["ppl"].get<double>(), 1.0, 1e-6);
  expect_failure(run_cli("eval-ppl --ids '" + ids + "' --ctx 128 --chunk -1"), {"--chunk"});
}

TEST_F(CliTest, TokenizeWritesReferenceIds) {
  const fs::path out = scratch_ / "valid.i32";
  const CliResult result =
      run_cli("tokenize --text '" + (shared_dir() / "reference/valid.txt").string() + "' --out '" +
              out.string() + "'");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(read_ids_file(out), read_ids_file(shared_dir() / "reference/valid.ids.i32"));
}

TEST_F(CliTest, InfoSizesCacheFormats) {
  const CliResult result = run_cli("info --json --cache 'content=int2:g64,rope=int4:g64'");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const auto cache = nlohmann::json::parse(result.out)["cache"];
  EXPECT_EQ(cache["bytes_per_token_per_layer"], 196);
  EXPECT_EQ(cache["tokens"], 131072);
  // 2048 pages per layer of 64 x 196 bytes, 6 layers, plus one 4-byte block-table entry per page.
  EXPECT_EQ(cache["physical_bytes"], 6 * 2048 * 64 * 196 + 2048 * 4);
  EXPECT_GT(cache["compression_vs_bf16"].get<double>(), 5.8);
}

TEST_F(CliTest, EvalKldAndCompareAgree) {
  const std::string ids = (shared_dir() / "reference/wikitext2-test.ids.i32").string();
  const std::string common = "--ids '" + ids + "' --ctx 96 --max-windows 2 ";
  const CliResult kld =
      run_cli("eval-kld " + common + "--cache content=int4:g64,rope=int4:g64 --json");
  ASSERT_EQ(kld.exit_code, 0) << kld.err;
  const auto k = nlohmann::json::parse(kld.out);
  for (const char* key : {"kld_mean", "kld_p99", "top1_agree", "ppl", "ppl_bf16", "tokens"}) {
    EXPECT_TRUE(k.contains(key)) << key;
  }
  EXPECT_EQ(k["tokens"], 190);
  EXPECT_GT(k["kld_mean"].get<double>(), 0.0);
  EXPECT_LE(k["top1_agree"].get<double>(), 1.0);

  const fs::path csv = scratch_ / "t.csv", json = scratch_ / "t.json", svg = scratch_ / "t.svg";
  const CliResult compare =
      run_cli("compare " + common + "--cache content=int4:g64,rope=int4:g64 --cache bf16 --csv '" +
              csv.string() + "' --json '" + json.string() + "' --plot '" + svg.string() + "'");
  ASSERT_EQ(compare.exit_code, 0) << compare.err;
  const auto table = nlohmann::json::parse(read_text_file(json));
  ASSERT_EQ(table["rows"].size(), 2u);
  EXPECT_DOUBLE_EQ(table["rows"][0]["kld_mean"].get<double>(), k["kld_mean"].get<double>());
  EXPECT_EQ(table["rows"][1]["kld_mean"], 0.0);  // bf16 against the bf16 baseline
  EXPECT_EQ(table["rows"][0]["bytes_per_token"], 324);
  const std::string csv_text = read_text_file(csv);
  EXPECT_NE(csv_text.find("\"content=int4:g64,rope=int4:g64\",324,"), std::string::npos)
      << csv_text;
  EXPECT_NE(read_text_file(svg).find("<svg"), std::string::npos);
}

// One compare split by windows into two runs and merged gives the table of the whole run.
TEST_F(CliTest, CompareMergeOfWindowRangesEqualsOneRun) {
  const std::string ids = (shared_dir() / "reference/wikitext2-test.ids.i32").string();
  const std::string common = "compare --ids '" + ids +
                             "' --ctx 64 --cache content=int4:g64,rope=int4:g64 "
                             "--cache content=int2:g64,rope=bf16 ";
  const fs::path whole = scratch_ / "whole.json", merged = scratch_ / "merged.json";
  const fs::path first = scratch_ / "a.tly", second = scratch_ / "b.tly";
  ASSERT_EQ(run_cli(common + "--max-windows 3 --json '" + whole.string() + "'").exit_code, 0);
  ASSERT_EQ(run_cli(common + "--max-windows 2 --save-tally '" + first.string() + "'").exit_code, 0);
  ASSERT_EQ(
      run_cli(common + "--first-window 2 --max-windows 1 --save-tally '" + second.string() + "'")
          .exit_code,
      0);
  // Given in either order.
  const CliResult merge = run_cli("compare-merge '" + second.string() + "' '" + first.string() +
                                  "' --json '" + merged.string() + "'");
  ASSERT_EQ(merge.exit_code, 0) << merge.err;
  const auto a = nlohmann::json::parse(read_text_file(whole));
  const auto b = nlohmann::json::parse(read_text_file(merged));
  EXPECT_EQ(b["tokens"], 3 * 63);
  EXPECT_EQ(b["windows"], 3);
  EXPECT_NEAR(a["ppl_baseline"].get<double>(), b["ppl_baseline"].get<double>(), 1e-9);
  ASSERT_EQ(b["rows"].size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(a["rows"][r]["format"], b["rows"][r]["format"]);
    // The per-token values are the same numbers: only sums in a different order differ.
    EXPECT_NEAR(a["rows"][r]["kld_mean"].get<double>(), b["rows"][r]["kld_mean"].get<double>(),
                1e-12);
    EXPECT_EQ(a["rows"][r]["kld_p99"], b["rows"][r]["kld_p99"]);
    EXPECT_EQ(a["rows"][r]["top1_agree"], b["rows"][r]["top1_agree"]);
    EXPECT_NEAR(a["rows"][r]["ppl"].get<double>(), b["rows"][r]["ppl"].get<double>(), 1e-9);
  }

  // The same range twice leaves a gap after it: refused, naming the windows.
  expect_failure(run_cli("compare-merge '" + first.string() + "' '" + first.string() + "'"),
                 {"consecutive windows", "starts at window 0, expected 2"});
  // A truncated tally file and one that is not a tally file.
  const std::string bytes = read_text_file(first);
  const fs::path truncated = scratch_ / "truncated.tly";
  std::ofstream(truncated, std::ios::binary) << bytes.substr(0, bytes.size() - 10);
  expect_failure(run_cli("compare-merge '" + truncated.string() + "'"),
                 {truncated.string(), "KLD values"});
  expect_failure(run_cli("compare-merge '" + ids + "'"), {"not a QuantMLA tally file"});
  expect_failure(run_cli(common + "--first-window 100000"), {"first window 100000", "outside"});
}

TEST_F(CliTest, ErrorModelTable) {
  const std::string ids = (shared_dir() / "reference/wikitext2-test.ids.i32").string();
  const fs::path json = scratch_ / "errors.json";
  const CliResult result =
      run_cli("error-model --ids '" + ids +
              "' --ctx 64 --max-windows 1 --format int4:g64 --json '" + json.string() + "'");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("rope / content at equal format"), std::string::npos) << result.out;
  const auto doc = nlohmann::json::parse(read_text_file(json));
  ASSERT_EQ(doc["rows"].size(), 2u * 6 + 2);
  EXPECT_EQ(doc["rows"][13]["layer"], -1);
  EXPECT_EQ(doc["rows"][13]["path"], "rope");
  expect_failure(run_cli("error-model --ids '" + ids + "' --ctx 64 --format int4:g128"),
                 {"g128", "64"});
}

// A model saved with a recorded cache spec runs with it unless --cache says otherwise, and says so.
TEST_F(CliTest, RecordedCacheSpecIsTheDefault) {
  const fs::path model = scratch_ / "calibrated";
  SaveModelOptions options;
  options.quantmla_json = R"({"cache": "content=int4:g64,rope=int4:g64"})";
  save_model_dir(Model::load(testing::bundled_model()), testing::bundled_model(), model, options);
  const std::string ids = (shared_dir() / "reference/wikitext2-test.ids.i32").string();
  const std::string common =
      "--model '" + model.string() + "' --ids '" + ids + "' --ctx 64 --max-windows 1 ";
  const std::string announced = "cache content=int4:g64,rope=int4:g64 (recorded in " +
                                (model / "config.json").string() + " by quantmla calibrate)";

  const CliResult recorded = run_cli("eval-ppl " + common + "--json");
  ASSERT_EQ(recorded.exit_code, 0) << recorded.err;
  EXPECT_NE(recorded.err.find(announced), std::string::npos) << recorded.err;
  EXPECT_EQ(nlohmann::json::parse(recorded.out)["cache"], "content=int4:g64,rope=int4:g64");

  const CliResult exact = run_cli("eval-ppl " + common + "--cache f32 --json");
  ASSERT_EQ(exact.exit_code, 0) << exact.err;
  EXPECT_EQ(exact.err.find("recorded in"), std::string::npos) << exact.err;
  EXPECT_EQ(nlohmann::json::parse(exact.out)["cache"], CacheFormat::f32().to_string());

  const CliResult kld = run_cli("eval-kld " + common + "--baseline-model models/mla-tiny --json");
  ASSERT_EQ(kld.exit_code, 0) << kld.err;
  EXPECT_NE(kld.err.find(announced), std::string::npos) << kld.err;
  const auto k = nlohmann::json::parse(kld.out);
  EXPECT_EQ(k["cache"], "content=int4:g64,rope=int4:g64");
  EXPECT_EQ(k["baseline_model"], "models/mla-tiny");
  EXPECT_GT(k["kld_mean"].get<double>(), 0.0);

  const fs::path table = scratch_ / "t.json";
  const CliResult compare = run_cli("compare " + common + "--json '" + table.string() + "'");
  ASSERT_EQ(compare.exit_code, 0) << compare.err;
  const auto rows = nlohmann::json::parse(read_text_file(table))["rows"];
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0]["format"], "content=int4:g64,rope=int4:g64");
  // Its own baseline (the default) and the bundled model it was saved from have the same weights.
  EXPECT_DOUBLE_EQ(rows[0]["kld_mean"].get<double>(), k["kld_mean"].get<double>());

  // Without a recorded spec, the commands that have no default format still ask for one.
  const std::string bundled = "--ids '" + ids + "' --ctx 64 --max-windows 1";
  expect_failure(run_cli("eval-kld " + bundled), {"eval-kld needs --cache", "config.json"});
  expect_failure(run_cli("compare " + bundled), {"compare needs --cache", "config.json"});
}

TEST_F(CliTest, BadCacheSpec) {
  expect_failure(run_cli("eval-ppl --text data/wikitext2-test.raw --ctx 64 --cache content=int3"),
                 {"int3"});
}

TEST_F(CliTest, MissingModelDirectory) {
  expect_failure(run_cli("info --model /nonexistent/model"),
                 {"/nonexistent/model", "does not exist"});
}

TEST_F(CliTest, UnknownModelType) {
  const fs::path model =
      copy_moe_model({}, [](nlohmann::json& config) { config["model_type"] = "llama"; });
  expect_failure(run_cli("info --model '" + model.string() + "'"), {"model_type", "llama"});
}

TEST_F(CliTest, MissingTensor) {
  const fs::path model = copy_moe_model([](std::vector<TensorData>& tensors) {
    std::erase_if(tensors, [](const TensorData& t) {
      return t.name == "model.layers.1.self_attn.kv_b_proj.weight";
    });
  });
  expect_failure(run_cli("info --model '" + model.string() + "'"),
                 {"model.layers.1.self_attn.kv_b_proj.weight"});
}

TEST_F(CliTest, WrongShape) {
  const fs::path model = copy_moe_model([](std::vector<TensorData>& tensors) {
    for (TensorData& t : tensors) {
      if (t.name == "model.layers.2.self_attn.kv_b_proj.weight") {
        t.shape = {128, 128};  // same bytes as [256, 64], wrong shape
      }
    }
  });
  expect_failure(run_cli("info --model '" + model.string() + "'"),
                 {"model.layers.2.self_attn.kv_b_proj.weight", "[128,128]", "[256,64]"});
}

TEST_F(CliTest, TruncatedSafetensors) {
  const fs::path model = copy_moe_model({});
  const fs::path file = model / "model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 1000);
  expect_failure(run_cli("info --model '" + model.string() + "'"), {"model.safetensors"});
}

TEST_F(CliTest, HeaderOffsetsLie) {
  const fs::path model = copy_moe_model({});
  const fs::path file = model / "model.safetensors";
  std::string bytes = testing::slurp(file);
  // Point the first tensor's data past the end of the file, keeping the header length.
  const size_t at = bytes.find("\"data_offsets\":[0,");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 18, "\"data_offsets\":[9,");
  std::ofstream(file, std::ios::binary) << bytes;
  expect_failure(run_cli("info --model '" + model.string() + "'"), {"model.safetensors"});
}

TEST_F(CliTest, TokenIdBeyondVocabulary) {
  const fs::path ids = scratch_ / "bad.i32";
  std::vector<int32_t> values(300, 5);
  values[17] = 4096;
  write_ids_file(ids, values);
  expect_failure(run_cli("eval-ppl --ids '" + ids.string() + "' --ctx 128"),
                 {"token id 4096", "[0, 4096)"});
}

TEST_F(CliTest, EmptyPrompt) { expect_failure(run_cli("generate --prompt ''"), {"empty prompt"}); }

// A handful of prompts end to end: one per needle depth at context 1024, prefilled into an INT4
// cache and decoded through it.
TEST_F(CliTest, EvalPasskeyJson) {
  const std::string prompts = (shared_dir() / "reference/passkey-public.json").string();
  const CliResult result = run_cli(
      "eval-passkey --model " + (shared_dir() / "models/mla-tiny-v2-4k").string() + " --prompts " +
      prompts + " --ctx 1024 --per-cell 1 --cache content=int4:g64,rope=int4:g64 --json");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const nlohmann::json out = nlohmann::json::parse(result.out);
  EXPECT_EQ(out["n"], 5);
  EXPECT_EQ(out["cache"], "content=int4:g64,rope=int4:g64");
  EXPECT_EQ(out["transform"], "none");
  EXPECT_EQ(out["acc_by_ctx"].size(), 1u);
  EXPECT_TRUE(out["acc_by_ctx"].contains("1024"));
  EXPECT_EQ(out["acc_by_depth"].size(), 5u);
  EXPECT_TRUE(out["acc_by_depth"].contains("0.05"));
  EXPECT_DOUBLE_EQ(out["acc"].get<double>(), out["correct"].get<double>() / 5.0);
  ASSERT_EQ(out["failures"].size(), 5u - out["correct"].get<size_t>());
  for (const nlohmann::json& failure : out["failures"]) {
    EXPECT_EQ(failure["ctx"], 1024);
    EXPECT_NE(failure["answer"], failure["output"]);
  }
  // RTN INT4/INT4 keeps retrieval at 1K (DESIGN §9: 0.99).
  EXPECT_GE(out["correct"].get<int>(), 4);
  EXPECT_NE(result.err.find("eval-passkey"), std::string::npos);  // progress on stderr
}

TEST_F(CliTest, EvalPasskeyBadInput) {
  const std::string prompts = (shared_dir() / "reference/passkey-public.json").string();
  expect_failure(run_cli("eval-passkey --prompts /nonexistent.json"), {"nonexistent.json"});
  expect_failure(run_cli("eval-passkey --prompts " + prompts + " --ctx 999"),
                 {"no prompt for context 999"});
  expect_failure(run_cli("eval-passkey --prompts " + prompts + " --transform rotate"),
                 {"--transform", "rotate"});
  const fs::path broken = scratch_ / "broken.json";
  std::ofstream(broken) << "[{\"ctx\": 1024}]";
  expect_failure(run_cli("eval-passkey --prompts " + broken.string()),
                 {"broken.json", "prompt 0", "\"depth\""});
}

TEST_F(CliTest, EvalPplNeedsInput) { expect_failure(run_cli("eval-ppl --ctx 128"), {"--text"}); }

namespace quantmla {
namespace {

TEST_F(CliTest, CalibrateWritesAModelTheToolsUse) {
  // A small calibration text keeps tokenization and the run short.
  const fs::path text = scratch_ / "calib.txt";
  {
    std::ofstream out(text);
    out << read_text_file(testing::source_dir() / "data/calib.txt").substr(0, 30000);
  }
  const fs::path model = scratch_ / "calibrated";
  const std::string args = "calibrate --data '" + text.string() + "' --out '" + model.string() +
                           "' --cache content=int2:g64,rope=int4:g64 --layers 0 --samples 2 "
                           "--held-out 1 --seq 64 --steps 2 --rope-keys 16 --threads 2";
  const CliResult run = run_cli(args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("    0 | "), std::string::npos) << run.out;         // the per-layer report
  EXPECT_NE(run.err.find("layer 0 content"), std::string::npos) << run.err;  // progress
  const auto config = nlohmann::json::parse(read_text_file(model / "config.json"));
  const std::string recorded = config["quantmla"]["cache"];
  EXPECT_EQ(recorded.rfind("content=int2:g64", 0), 0u) << recorded;
  EXPECT_EQ(config["quantmla"]["calibration"]["samples"], 2);
  EXPECT_EQ(config["model_type"], "deepseek_v3");
  EXPECT_TRUE(fs::exists(model / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(model / "tokenizer.json"));

  const std::string ids = (shared_dir() / "reference/wikitext2-test.ids.i32").string();
  const CliResult ppl = run_cli("eval-ppl --model '" + model.string() + "' --ids '" + ids +
                                "' --ctx 64 --max-windows 1 --json");
  ASSERT_EQ(ppl.exit_code, 0) << ppl.err;
  EXPECT_EQ(nlohmann::json::parse(ppl.out)["cache"], recorded);

  // Nothing is overwritten without --force, and that is said before any work starts.
  expect_failure(run_cli(args), {"output directory", "exists; pass --force"});
  expect_failure(run_cli("calibrate --out '" + (scratch_ / "x").string() + "' --paths values"),
                 {"unknown path 'values'"});
  expect_failure(run_cli("calibrate --out '" + (scratch_ / "x").string() + "' --folded-dtype f16"),
                 {"--folded-dtype", "f16"});
  expect_failure(
      run_cli("calibrate --out '" + (scratch_ / "x").string() + "' --cache content=bf16,rope=bf16"),
      {"nothing to calibrate"});
  // A checkpoint in the half-split RoPE layout is refused, not silently misread.
  const fs::path half_split = scratch_ / "half-split";
  fs::create_directories(half_split);
  auto half_config =
      nlohmann::json::parse(read_text_file(testing::bundled_model() / "config.json"));
  half_config["rope_interleave"] = false;
  std::ofstream(half_split / "config.json") << half_config.dump();
  expect_failure(run_cli("calibrate --model '" + half_split.string() + "' --out '" +
                         (scratch_ / "y").string() + "'"),
                 {"rope_interleave is false"});
}

}  // namespace
}  // namespace quantmla

TEST_F(CliTest, BenchServeWritesItsTableAndJson) {
  const auto json_path = std::filesystem::temp_directory_path() /
                         ("bench-serve-" + std::to_string(::getpid()) + ".json");
  const fs::path log = scratch_ / "timed-steps.csv";
  const CliResult result = run_cli(
      "bench-serve --num-prompts 6 --input-len 40 --output-len 6 --cache bf16 --cache "
      "content=int4:g64,rope=int4:g64 --cache-memory 1MiB --check-outputs 3 --json '" +
      json_path.string() + "' --step-log '" + log.string() + "'");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const std::string steps = testing::slurp(log);
  EXPECT_EQ(steps.substr(0, steps.find('\n')),
            "cache,step,decodes,decode_context,prefill_tokens,generated,pages_used,waiting,"
            "swap_bytes,step_ms,device_ms");
  EXPECT_NE(result.out.find("out tok/s"), std::string::npos) << result.out;
  const auto out = nlohmann::json::parse(testing::slurp(json_path));
  std::filesystem::remove(json_path);
  EXPECT_EQ(out["requests"], 6);
  EXPECT_EQ(out["cache_memory_bytes"], 1 << 20);
  ASSERT_EQ(out["formats"].size(), 2u);
  for (const auto& f : out["formats"]) {
    EXPECT_EQ(f["completed"], 6);
    EXPECT_EQ(f["output_tokens"], 36);
    for (const char* key : {"bytes_per_token", "pages", "wall_s", "output_tok_s", "total_tok_s",
                            "peak_seqs", "mean_batch", "preemptions", "recomputed_tokens",
                            "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "failed"}) {
      EXPECT_TRUE(f.contains(key)) << key;
    }
    EXPECT_EQ(f["device_s"], 0.0) << "the CPU runner does not time kernels";
  }
  // The INT4 cache holds 3.6x the BF16 pages in the same bytes.
  EXPECT_GT(out["formats"][1]["pages"].get<int64_t>(),
            3 * out["formats"][0]["pages"].get<int64_t>());
  EXPECT_EQ(out["preemption_check"]["identical"], 3);
  // Identical outputs agree on every token: the 3 checked requests' 6 each.
  EXPECT_EQ(out["preemption_check"]["common_prefix_tokens"], nlohmann::json::array({6, 6, 6}));
  EXPECT_NE(result.out.find("tokens before the first difference: median 6, min 6, max 6"),
            std::string::npos)
      << result.out;
}

// --schedule-only reads only config.json: a directory holding nothing else will do, and its figures
// are the schedule's (no times); --step-log writes one line a step.
TEST_F(CliTest, BenchServeScheduleOnlyNeedsOnlyTheConfig) {
  const fs::path dir = scratch_ / "config-only";
  fs::create_directories(dir);
  fs::copy_file(testing::source_dir() / "models/mla-tiny/config.json", dir / "config.json");
  const fs::path json = scratch_ / "schedule.json", log = scratch_ / "steps.csv";
  const CliResult result = run_cli(
      "bench-serve --schedule-only --model '" + dir.string() +
      "' --num-prompts 12 --input-len 100 --output-len 100 --cache bf16 --cache "
      "content=int2:g64,rope=int4:g64 --cache-memory 2700KiB --max-batched-tokens 64 --json '" +
      json.string() + "' --step-log '" + log.string() + "'");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("prefilled"), std::string::npos) << result.out;
  const auto out = nlohmann::json::parse(testing::slurp(json));
  EXPECT_EQ(out["device"], "schedule-only");
  EXPECT_EQ(out["schedule_only"], true);
  EXPECT_EQ(out["warmup"], "none") << "no warm-up by default off the GPU";
  ASSERT_EQ(out["formats"].size(), 2u);
  int64_t steps = 0;
  for (const auto& f : out["formats"]) {
    EXPECT_EQ(f["completed"], 12);
    EXPECT_EQ(f["output_tokens"], 12 * 100);
    EXPECT_FALSE(f.contains("output_tok_s")) << "no time was measured";
    EXPECT_FALSE(f.contains("wall_s"));
    EXPECT_GT(f["queued_steps"].get<int64_t>(), 0) << "12 requests queue for the budget";
    EXPECT_LT(f["queued_steps"].get<int64_t>(), f["steps"].get<int64_t>()) << "then drain";
    EXPECT_FALSE(f.contains("queued_output_tok_s")) << "no time was measured";
    steps += f["steps"].get<int64_t>();
  }
  EXPECT_GT(out["formats"][0]["preemptions"].get<int64_t>(), 0) << "the budget is meant to bind";
  EXPECT_GT(out["formats"][1]["mean_batch"].get<double>(),
            out["formats"][0]["mean_batch"].get<double>());
  std::istringstream lines(testing::slurp(log));
  std::string line;
  std::getline(lines, line);
  EXPECT_EQ(line,
            "cache,step,decodes,decode_context,prefill_tokens,generated,pages_used,waiting,"
            "swap_bytes");
  int64_t rows = 0;
  const int64_t most_pages = std::max(out["formats"][0]["pages"].get<int64_t>(),
                                      out["formats"][1]["pages"].get<int64_t>());
  while (std::getline(lines, line)) {
    ++rows;
    // The third column from the end: the pages held after the step, within the larger pool.
    std::string head = line.substr(0, line.rfind(','));
    head = head.substr(0, head.rfind(','));
    const int64_t pages_used = std::stoll(head.substr(head.rfind(',') + 1));
    EXPECT_GE(pages_used, 0) << line;
    EXPECT_LE(pages_used, most_pages) << line;
  }
  EXPECT_EQ(rows, steps);
  // --swap-space (GiB): the same preemptions by swap, nothing recomputed.
  const fs::path swap_json = scratch_ / "swap.json";
  const CliResult swapping = run_cli(
      "bench-serve --schedule-only --model '" + dir.string() +
      "' --num-prompts 12 --input-len 100 --output-len 100 --cache bf16 --cache-memory 2700KiB "
      "--max-batched-tokens 64 --swap-space 0.5 --json '" +
      swap_json.string() + "'");
  ASSERT_EQ(swapping.exit_code, 0) << swapping.err;
  const auto swap_out = nlohmann::json::parse(testing::slurp(swap_json));
  EXPECT_EQ(swap_out["swap_space_bytes"], int64_t{1} << 29);
  const auto& swapped = swap_out["formats"][0];
  EXPECT_GT(swapped["preemptions"].get<int64_t>(), 0);
  EXPECT_EQ(swapped["swapped_out"], swapped["preemptions"]);
  EXPECT_EQ(swapped["recomputed_tokens"], 0);
  EXPECT_GT(swapped["peak_swap_bytes"].get<int64_t>(), 0);
  EXPECT_LE(swapped["peak_swap_bytes"].get<int64_t>(), int64_t{1} << 29);
  EXPECT_GE(swapped["swapped_out_bytes"].get<int64_t>(), swapped["peak_swap_bytes"].get<int64_t>());
  expect_failure(run_cli("bench-serve --schedule-only --model '" + dir.string() +
                         "' --num-prompts 2 --input-len 8 --output-len 2 --swap-space -1"),
                 {"--swap-space"});

  expect_failure(run_cli("bench-serve --schedule-only --num-prompts 2 --input-len 8 --output-len "
                         "2 --check-outputs 2"),
                 {"--schedule-only runs no model"});
  expect_failure(run_cli("bench-serve --schedule-only --model '" + scratch_.string() +
                         "' --num-prompts 2 --input-len 8 --output-len 2"),
                 {"config.json"});
}

// The shape warm-up through the real CPU runner: its steps are ones the runner accepts.
TEST_F(CliTest, BenchServeWarmsUpShapesOnTheRunner) {
  const fs::path json = scratch_ / "warm.json";
  const CliResult result = run_cli(
      "bench-serve --num-prompts 3 --input-len 8 --output-len 3 --max-seqs 3 "
      "--max-batched-tokens 600 --warmup shapes --json '" +
      json.string() + "'");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const auto out = nlohmann::json::parse(testing::slurp(json));
  EXPECT_EQ(out["warmup"], "shapes");
  EXPECT_EQ(out["formats"][0]["completed"], 3);
  expect_failure(run_cli("bench-serve --num-prompts 2 --input-len 8 --output-len 2 --warmup twice"),
                 {"--warmup"});
}

// vLLM's names of the scheduler limits and of the JSON file are aliases of ours.
TEST_F(CliTest, BenchServeTakesVllmLimitNames) {
  const fs::path json = scratch_ / "vllm-names.json";
  const CliResult result = run_cli(
      "bench-serve --num-prompts 2 --input-len 8 --output-len 2 --max-num-seqs 3 "
      "--max-num-batched-tokens 600 --output-json '" +
      json.string() + "'");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  const auto out = nlohmann::json::parse(testing::slurp(json));
  EXPECT_EQ(out["max_seqs"], 3);
  EXPECT_EQ(out["max_batched_tokens"], 600);
}

TEST_F(CliTest, BenchServeRefusesBadBudgets) {
  expect_failure(
      run_cli("bench-serve --num-prompts 2 --input-len 8 --output-len 2 --cache-memory 0.5"),
      {"fraction of free device memory needs --device cuda"});
  expect_failure(run_cli("bench-serve --num-prompts 2 --input-len 8 --output-len 2 "
                         "--gpu-memory-utilization 0.9"),
                 {"--gpu-memory-utilization", "needs --device cuda"});
  expect_failure(run_cli("serve --gpu-memory-utilization 0.9 --cache-memory 1GiB"),
                 {"--cache-memory excludes --gpu-memory-utilization"});
  expect_failure(
      run_cli("bench-serve --num-prompts 2 --input-len 8 --output-len 2 --cache-memory 8GIB"),
      {"byte size \"8GIB\""});
  expect_failure(
      run_cli("bench-serve --num-prompts 2 --input-len 8 --output-len 2 --cache-memory 1KiB"),
      {"hold no page"});
  // The batch-invariant mode is the CUDA runner's; on the CPU it is refused, not ignored.
  expect_failure(run_cli("bench-serve --num-prompts 2 --input-len 8 --output-len 2 "
                         "--batch-invariant"),
                 {"--batch-invariant is a mode of the CUDA runner"});
}

TEST_F(CliTest, RenderChatPrintsTheReferencePrompt) {
  // ../shared's DeepSeek-V3 directory has tokenizer files only: no config.json, no weights.
  const auto reference = nlohmann::ordered_json::parse(
      read_text_file(shared_dir() / "reference/chat-template-reference.json"));
  const auto& tool_case = reference["cases"][7];  // tool call, tool output, final answer
  ASSERT_TRUE(tool_case["add_generation_prompt"].get<bool>());
  const fs::path messages = scratch_ / "messages.json";
  std::ofstream(messages) << tool_case["messages"].dump();
  const std::string model = (shared_dir() / "tokenizers/deepseek-v3").string();
  const CliResult result = run_cli("render-chat --model '" + model + "' --messages '" +
                                   messages.string() + "' --add-generation-prompt");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.out, tool_case["rendered"].get<std::string>());  // exactly, no newline added

  // A raw Jinja file stands in for a model without a template; bos comes from the model's config.
  const fs::path jinja = scratch_ / "chat.jinja";
  std::ofstream(jinja) << "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{% endfor %}\n";
  const CliResult own = run_cli("render-chat --messages '" + messages.string() +
                                "' --chat-template '" + jinja.string() + "'");
  ASSERT_EQ(own.exit_code, 0) << own.err;
  EXPECT_EQ(own.out, "<|begin_of_text|>[user][assistant][tool][assistant]");
}

TEST_F(CliTest, RenderChatRefusesAModelWithoutATemplate) {
  const fs::path messages = scratch_ / "messages.json";
  std::ofstream(messages) << R"([{"role": "user", "content": "hi"}])";
  expect_failure(run_cli("render-chat --messages '" + messages.string() + "'"),
                 {"models/mla-tiny has no chat_template in tokenizer_config.json; pass "
                  "--chat-template FILE"});
  std::ofstream(scratch_ / "bad.json") << R"({"role": "user"})";
  expect_failure(
      run_cli("render-chat --model '" + (shared_dir() / "tokenizers/deepseek-v3").string() +
              "' --messages '" + (scratch_ / "bad.json").string() + "'"),
      {"bad.json", "expected a JSON array of messages"});
}

}  // namespace
}  // namespace quantmla
