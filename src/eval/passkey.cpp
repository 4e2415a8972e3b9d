#include "quantmla/passkey.h"

#include <algorithm>
#include <exception>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>

#include "quantmla/error.h"
#include "quantmla/generate.h"
#include "quantmla/io.h"

namespace quantmla {
namespace {

using nlohmann::json;

std::vector<int32_t> token_list(const json& entry, const char* field, const std::string& where) {
  if (!entry.contains(field) || !entry[field].is_array() || entry[field].empty()) {
    throw FormatError(where + ": \"" + field + "\" must be a non-empty array of token ids");
  }
  std::vector<int32_t> ids;
  for (const json& id : entry[field]) {
    if (!id.is_number_integer()) {
      throw FormatError(where + ": \"" + field + "\" holds " + id.dump() + ", not a token id");
    }
    ids.push_back(id.get<int32_t>());
  }
  return ids;
}

}  // namespace

std::vector<PasskeyPrompt> load_passkey_prompts(const std::string& path) {
  const std::string text = read_text_file(path);
  json document;
  try {
    document = json::parse(text);
  } catch (const json::parse_error& e) {
    throw FormatError(path + ": not valid JSON: " + e.what());
  }
  if (!document.is_array()) throw FormatError(path + ": expected a JSON array of prompts");
  std::vector<PasskeyPrompt> prompts;
  for (size_t i = 0; i < document.size(); ++i) {
    const json& entry = document[i];
    const std::string where = path + ": prompt " + std::to_string(i);
    if (!entry.is_object()) throw FormatError(where + ": expected an object");
    if (!entry.contains("ctx") || !entry["ctx"].is_number_integer()) {
      throw FormatError(where + ": \"ctx\" must be an integer");
    }
    if (!entry.contains("depth") || !entry["depth"].is_number()) {
      throw FormatError(where + ": \"depth\" must be a number");
    }
    PasskeyPrompt prompt;
    prompt.index = static_cast<int64_t>(i);
    prompt.ctx = entry["ctx"].get<int64_t>();
    prompt.depth = entry["depth"].get<double>();
    prompt.prompt = token_list(entry, "prompt", where);
    prompt.answer = token_list(entry, "answer", where);
    prompts.push_back(std::move(prompt));
  }
  return prompts;
}

PasskeyResult evaluate_passkey(const Model& model, const std::vector<PasskeyPrompt>& prompts,
                               const PasskeyOptions& options) {
  const int64_t vocab = model.config().vocab_size;
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (const int32_t id : prompts[i].prompt) {
      if (id < 0 || id >= vocab) {
        throw InvalidArgument("pass-key prompt " + std::to_string(i) + ": token id " +
                              std::to_string(id) + " outside the vocabulary [0, " +
                              std::to_string(vocab) + ")");
      }
    }
    const size_t total = prompts[i].prompt.size() + prompts[i].answer.size();
    if (static_cast<int64_t>(total) > model.max_positions()) {
      throw InvalidArgument("pass-key prompt " + std::to_string(i) + ": " +
                            std::to_string(prompts[i].prompt.size()) + " tokens + " +
                            std::to_string(prompts[i].answer.size()) +
                            " answer tokens exceed the model's " +
                            std::to_string(model.max_positions()) + " positions");
    }
  }
  GenerateOptions generate_options;
  generate_options.sampling.temperature = 0.0f;  // greedy
  generate_options.stop_at_eos = false;          // an early EOS is a wrong answer, not a stop
  generate_options.cache = options.cache;

  // Prompts are independent: they run side by side, one per thread (the model is read-only, each
  // has its own cache), longest first so the threads finish together. Inside the parallel loop
  // the forward's own parallel loops and BLAS run single-threaded.
  const int64_t count = static_cast<int64_t>(prompts.size());
  std::vector<int64_t> order(prompts.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return prompts[a].prompt.size() > prompts[b].prompt.size();
  });
  std::vector<std::vector<int32_t>> outputs(prompts.size());
  std::exception_ptr failure;
  int64_t done = 0;
#pragma omp parallel for schedule(dynamic, 1) if (count > 1)
  for (int64_t k = 0; k < count; ++k) {
    const PasskeyPrompt& prompt = prompts[order[k]];
    try {
      GenerateOptions prompt_options = generate_options;
      prompt_options.max_tokens = static_cast<int64_t>(prompt.answer.size());
      outputs[order[k]] = generate(model, prompt.prompt, prompt_options);
    } catch (...) {
#pragma omp critical(passkey_failure)
      if (!failure) failure = std::current_exception();
    }
#pragma omp critical(passkey_progress)
    {
      ++done;
      if (options.progress) options.progress(done, count);
    }
  }
  if (failure) std::rethrow_exception(failure);

  PasskeyResult result;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const PasskeyPrompt& prompt = prompts[i];
    const bool correct = outputs[i] == prompt.answer;
    for (PasskeyCount* tally :
         {&result.total, &result.by_ctx[prompt.ctx], &result.by_depth[prompt.depth]}) {
      ++tally->n;
      tally->correct += correct ? 1 : 0;
    }
    result.correct.push_back(correct);
  }
  result.outputs = std::move(outputs);
  return result;
}

}  // namespace quantmla
