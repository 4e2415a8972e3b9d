// The model refuses bad calls with typed errors and leaves its cache as it was.
#include <gtest/gtest.h>

#include <vector>

#include "model_fixtures.h"
#include "quantmla/error.h"
#include "quantmla/eval.h"
#include "quantmla/generate.h"
#include "quantmla/runner.h"

namespace quantmla {
namespace {

using testing::mla_tiny_moe;

TEST(ModelErrors, FullCacheIsACapacityErrorAndKeepsTheCache) {
  const Model& model = mla_tiny_moe();
  const int64_t vocab = model.config().vocab_size;
  auto cache = model.make_cache(8);
  std::vector<int32_t> ids = {0, 5, 6, 7, 8, 9};
  std::vector<float> logits(ids.size() * vocab);
  model.forward(ids, *cache, logits);
  std::vector<float> more(3 * vocab);
  const std::vector<int32_t> three = {10, 11, 12};
  EXPECT_THROW(model.forward(three, *cache, more), CapacityError);
  EXPECT_EQ(cache->length(), 6);
  // The cache still works for what fits.
  std::vector<float> two(2 * vocab);
  model.forward(std::vector<int32_t>{10, 11}, *cache, two);
  EXPECT_EQ(cache->length(), 8);
}

TEST(ModelErrors, BadTokensAndBuffersAreRejectedBeforeAnyWrite) {
  const Model& model = mla_tiny_moe();
  const int64_t vocab = model.config().vocab_size;
  auto cache = model.make_cache(16);
  std::vector<float> logits(2 * vocab);
  EXPECT_THROW(model.forward(std::vector<int32_t>{1, static_cast<int32_t>(vocab)}, *cache, logits),
               InvalidArgument);
  EXPECT_THROW(model.forward(std::vector<int32_t>{1, -1}, *cache, logits), InvalidArgument);
  EXPECT_THROW(model.forward(std::vector<int32_t>{}, *cache, logits), InvalidArgument);
  std::vector<float> too_small(vocab);
  EXPECT_THROW(model.forward(std::vector<int32_t>{1, 2}, *cache, too_small), ShapeError);
  EXPECT_EQ(cache->length(), 0);
  // A cache of another model's shape.
  auto wrong = make_f32_cache(CacheShape{3, 32, 32}, 16);
  EXPECT_THROW(model.forward(std::vector<int32_t>{1, 2}, *wrong, logits), ShapeError);
}

TEST(ModelErrors, EvaluationAndGenerationLimits) {
  const Model& model = mla_tiny_moe();
  const std::vector<int32_t> ids(600, 7);
  PerplexityOptions options;
  options.ctx = model.max_positions() + 1;
  EXPECT_THROW(evaluate_perplexity(model, ids, options), InvalidArgument);
  options.ctx = 1;
  EXPECT_THROW(evaluate_perplexity(model, ids, options), InvalidArgument);
  options.ctx = 1000;  // more than the 600 ids can fill
  EXPECT_THROW(evaluate_perplexity(model, ids, options), InvalidArgument);

  const auto runner = make_cpu_runner(model);
  GenerateOptions generate_options;
  generate_options.max_tokens = model.max_positions();
  EXPECT_THROW(generate(*runner, std::vector<int32_t>{0, 5}, generate_options), InvalidArgument);
  EXPECT_THROW(generate(*runner, std::vector<int32_t>{}, GenerateOptions{}), InvalidArgument);
  generate_options.max_tokens = 4;
  generate_options.sampling.temperature = -1.0f;
  EXPECT_THROW(generate(*runner, std::vector<int32_t>{0, 5}, generate_options), InvalidArgument);
  generate_options.sampling.temperature = 1.0f;
  generate_options.controls.min_p = 2.0f;
  EXPECT_THROW(generate(*runner, std::vector<int32_t>{0, 5}, generate_options), InvalidArgument);
}

// A seeded run repeats itself; controls that keep every token draw the runner's tokens (the host
// draw uses the runner's counter), and top_k 1 is greedy at any temperature.
TEST(ModelErrors, SeededSamplingIsReproducible) {
  const Model& model = mla_tiny_moe();
  const auto runner = make_cpu_runner(model);
  GenerateOptions options;
  options.max_tokens = 12;
  options.stop_at_eos = false;
  options.sampling = {0.9f, 0.95f, 42};
  const std::vector<int32_t> prompt = {0, 5, 6};
  const auto first = generate(*runner, prompt, options);
  EXPECT_EQ(first.size(), 12u);
  EXPECT_EQ(first, generate(*runner, prompt, options));
  options.controls.top_k = static_cast<int32_t>(model.config().vocab_size);
  EXPECT_EQ(generate(*runner, prompt, options), first);
  options.controls.top_k = 1;
  options.sampling.temperature = 1.5f;
  GenerateOptions greedy = options;
  greedy.controls = {};
  greedy.sampling.temperature = 0.0f;
  EXPECT_EQ(generate(*runner, prompt, options), generate(*runner, prompt, greedy));
}

}  // namespace
}  // namespace quantmla
