// Pass-key retrieval: the prompts file's validation, and the evaluation on the trained V2 fixture
// (decoded token by token through the cache) against transformers' greedy answers.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "error_matchers.h"
#include "model_fixtures.h"
#include "quantmla/error.h"
#include "quantmla/passkey.h"

namespace quantmla {
namespace {

namespace fs = std::filesystem;
using testing::error_message;
using testing::expect_contains;
using testing::mla_tiny_v2;
using testing::shared_dir;

const fs::path kPublicPrompts = shared_dir() / "reference/passkey-public.json";

fs::path write_temp(const std::string& text) {
  const fs::path path =
      fs::temp_directory_path() / ("passkey-" + std::to_string(std::random_device{}()) + ".json");
  std::ofstream(path) << text;
  return path;
}

TEST(Passkey, LoadsThePublicPrompts) {
  const std::vector<PasskeyPrompt> prompts = load_passkey_prompts(kPublicPrompts);
  ASSERT_EQ(prompts.size(), 120u);
  std::map<int64_t, int> per_ctx;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const PasskeyPrompt& p = prompts[i];
    EXPECT_EQ(p.index, static_cast<int64_t>(i));
    ++per_ctx[p.ctx];
    EXPECT_EQ(p.prompt.front(), 0);  // BOS
    EXPECT_FALSE(p.answer.empty());
    EXPECT_LE(static_cast<int64_t>(p.prompt.size()), p.ctx);
    EXPECT_GE(p.depth, 0.0);
    EXPECT_LE(p.depth, 1.0);
  }
  EXPECT_EQ(per_ctx, (std::map<int64_t, int>{{1024, 40}, {2048, 40}, {4096, 40}}));
}

TEST(Passkey, MalformedFilesAreRefusedWithTheirPlace) {
  struct Case {
    std::string text;
    std::string fragment;
  };
  for (const Case& c : std::vector<Case>{
           {"[{\"ctx\": 1024", "not valid JSON"},
           {"[{\"ctx\": 1e999}]", "number overflow"},
           {"{\"ctx\": 1}", "expected a JSON array"},
           {"[3]", "prompt 0: expected an object"},
           {"[{\"depth\": 0.5, \"prompt\": [0], \"answer\": [1]}]", "\"ctx\" must be an integer"},
           {"[{\"ctx\": 8, \"prompt\": [0], \"answer\": [1]}]", "\"depth\" must be a number"},
           {"[{\"ctx\": 8, \"depth\": 0.5, \"answer\": [1]}]", "\"prompt\" must be a non-empty"},
           {"[{\"ctx\": 8, \"depth\": 0.5, \"prompt\": [0], \"answer\": []}]", "\"answer\" must"},
           {"[{\"ctx\": 8, \"depth\": 0.5, \"prompt\": [0, \"x\"], \"answer\": [1]}]",
            "holds \"x\", not a token id"},
       }) {
    const fs::path path = write_temp(c.text);
    expect_contains(error_message<FormatError>([&] { load_passkey_prompts(path); }),
                    {path.string(), c.fragment});
    fs::remove(path);
  }
  error_message<IoError>([] { load_passkey_prompts("/nonexistent/prompts.json"); });
}

TEST(Passkey, BadPromptsAreRefusedBeforeAnyWork) {
  PasskeyPrompt outside{0, 1024, 0.5, {0, 5, 999999}, {1}};
  expect_contains(
      error_message<InvalidArgument>([&] { evaluate_passkey(mla_tiny_v2(), {outside}, {}); }),
      {"prompt 0", "token id 999999", "outside the vocabulary"});
  PasskeyPrompt too_long{0, 4096, 0.5, std::vector<int32_t>(4096, 5), {1, 2}};
  expect_contains(
      error_message<InvalidArgument>([&] { evaluate_passkey(mla_tiny_v2(), {too_long}, {}); }),
      {"prompt 0", "4096 tokens + 2 answer tokens", "4096 positions"});
}

// Transformers answers every public prompt correctly (shared/README.md); the engine must too,
// decoding through the exact cache, and its output must be transformers' greedy output.
TEST(Passkey, TrainedModelRetrievesTheKeyThroughTheCache) {
  // The needle near the start and near the end of a 1K prompt.
  std::vector<PasskeyPrompt> prompts;
  for (const PasskeyPrompt& p : load_passkey_prompts(kPublicPrompts)) {
    const bool wanted = p.ctx == 1024 && (p.depth == 0.05 || p.depth == 0.95);
    if (wanted && (prompts.empty() || prompts.back().depth != p.depth)) prompts.push_back(p);
  }
  ASSERT_EQ(prompts.size(), 2u);
  int64_t last_done = 0;
  PasskeyOptions options;
  options.progress = [&](int64_t done, int64_t total) {
    EXPECT_EQ(total, 2);
    EXPECT_GT(done, last_done);  // after each round of prompts run side by side
    last_done = done;
  };
  const PasskeyResult result = evaluate_passkey(mla_tiny_v2(), prompts, options);
  EXPECT_EQ(last_done, 2);
  EXPECT_EQ(result.total.n, 2);
  EXPECT_EQ(result.total.correct, 2);
  ASSERT_EQ(result.by_ctx.size(), 1u);
  EXPECT_EQ(result.by_ctx.at(1024).correct, 2);
  EXPECT_EQ(result.by_depth.size(), 2u);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(result.outputs[i], prompts[i].answer) << "prompt " << i;
    EXPECT_TRUE(result.correct[i]);
  }
  // Prompts one at a time (a step budget below two prompts, the longer chunked over two steps)
  // give the same outputs.
  options.max_batch_tokens = 700;
  last_done = 0;
  const PasskeyResult one_by_one = evaluate_passkey(mla_tiny_v2(), prompts, options);
  EXPECT_EQ(one_by_one.outputs, result.outputs);
  // A wrong answer is counted as one.
  prompts[0].answer[0] = (prompts[0].answer[0] + 1) % 1000;
  const PasskeyResult wrong = evaluate_passkey(mla_tiny_v2(), {prompts[0]}, {});
  EXPECT_EQ(wrong.total.correct, 0);
  EXPECT_FALSE(wrong.correct[0]);
}

}  // namespace
}  // namespace quantmla
