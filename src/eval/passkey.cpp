#include "quantmla/passkey.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>

#include "quantmla/error.h"
#include "quantmla/io.h"
#include "quantmla/model.h"

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
  } catch (const json::exception& e) {  // parse errors, numbers beyond a double
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
  const auto runner = make_cpu_runner(model);
  return evaluate_passkey(*runner, prompts, options);
}

PasskeyResult evaluate_passkey(Runner& runner, const std::vector<PasskeyPrompt>& prompts,
                               const PasskeyOptions& options) {
  const ModelConfig& config = runner.config();
  const int64_t vocab = config.vocab_size;
  int64_t max_total = 1, min_length = std::numeric_limits<int64_t>::max();
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (const int32_t id : prompts[i].prompt) {
      if (id < 0 || id >= vocab) {
        throw InvalidArgument("pass-key prompt " + std::to_string(i) + ": token id " +
                              std::to_string(id) + " outside the vocabulary [0, " +
                              std::to_string(vocab) + ")");
      }
    }
    const auto total = static_cast<int64_t>(prompts[i].prompt.size() + prompts[i].answer.size());
    if (total > config.max_position_embeddings) {
      throw InvalidArgument("pass-key prompt " + std::to_string(i) + ": " +
                            std::to_string(prompts[i].prompt.size()) + " tokens + " +
                            std::to_string(prompts[i].answer.size()) +
                            " answer tokens exceed the model's " +
                            std::to_string(config.max_position_embeddings) + " positions");
    }
    max_total = std::max(max_total, total);
    min_length = std::min(min_length, static_cast<int64_t>(prompts[i].prompt.size()));
  }
  if (options.max_batch_tokens < 1) {
    throw InvalidArgument("pass-key: max_batch_tokens must be positive, got " +
                          std::to_string(options.max_batch_tokens));
  }

  // Prompts run side by side, longest first, as many a round as the step's token budget holds;
  // a prompt longer than the budget is prefilled in chunks over several steps. Then the answers
  // are decoded greedily, one token of every prompt of the round a step (an early EOS is a wrong
  // answer, not a stop).
  const int64_t count = static_cast<int64_t>(prompts.size());
  std::vector<int64_t> order(prompts.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return prompts[a].prompt.size() > prompts[b].prompt.size();
  });
  const int64_t budget = options.max_batch_tokens;
  // A round's prompts hold at most max(budget, longest) tokens, and each of them at most two
  // pages more (its last partial page, its answer).
  const int64_t round_prompts =
      std::min<int64_t>(count, budget / std::max<int64_t>(min_length, 1) + 1);
  auto pool = runner.make_pool(
      options.cache, PagePool::pages_for_tokens(std::max(budget, max_total)) + 2 * round_prompts);
  std::vector<std::vector<int32_t>> outputs(prompts.size());
  int64_t done = 0;
  for (int64_t next = 0; next < count;) {
    std::vector<int64_t> round;
    std::vector<SequenceId> seqs;
    int64_t tokens = 0;
    while (next < count) {
      const PasskeyPrompt& prompt = prompts[order[next]];
      const auto length = static_cast<int64_t>(prompt.prompt.size());
      const int64_t pages = PagePool::pages_for_tokens(length + prompt.answer.size());
      if (!round.empty() && (tokens + length > budget || pages > pool->free_pages())) break;
      round.push_back(order[next++]);
      tokens += length;
      seqs.push_back(pool->add_sequence());
      pool->reserve(seqs.back(), length + static_cast<int64_t>(prompt.answer.size()));
    }
    // Prefill, in chunks of at most the budget (only a prompt alone in its round is chunked).
    std::vector<int32_t> sampled(round.size());
    for (int64_t offset = 0;; offset += budget) {
      StepBatch batch;
      for (size_t r = 0; r < round.size(); ++r) {
        const std::vector<int32_t>& ids = prompts[round[r]].prompt;
        const auto length = static_cast<int64_t>(ids.size());
        if (offset >= length) continue;
        const int64_t n = std::min(budget, length - offset);
        batch.chunks.push_back({seqs[r],
                                std::span(ids).subspan(offset, n),
                                offset + n == length ? LogitRows::kLast : LogitRows::kNone,
                                {}});
      }
      if (batch.chunks.empty()) break;
      std::vector<int32_t> tokens_out(static_cast<size_t>(batch.num_logit_rows()));
      runner.step(batch, *pool, {{}, tokens_out});
      size_t row = 0;
      for (const SequenceChunk& chunk : batch.chunks) {
        if (chunk.logits == LogitRows::kNone) continue;
        const size_t r = std::find(seqs.begin(), seqs.end(), chunk.sequence) - seqs.begin();
        outputs[round[r]].push_back(tokens_out[row++]);
      }
    }
    for (size_t step = 1;; ++step) {
      StepBatch batch;
      for (size_t r = 0; r < round.size(); ++r) {
        std::vector<int32_t>& out = outputs[round[r]];
        if (out.size() < prompts[round[r]].answer.size() && out.size() == step) {
          batch.chunks.push_back({seqs[r], std::span(&out.back(), 1), LogitRows::kLast, {}});
        }
      }
      if (batch.chunks.empty()) break;
      std::vector<int32_t> tokens_out(batch.chunks.size());
      runner.step(batch, *pool, {{}, tokens_out});
      for (size_t c = 0; c < batch.chunks.size(); ++c) {
        const size_t r =
            std::find(seqs.begin(), seqs.end(), batch.chunks[c].sequence) - seqs.begin();
        outputs[round[r]].push_back(tokens_out[c]);
      }
    }
    for (SequenceId seq : seqs) pool->remove_sequence(seq);
    done += static_cast<int64_t>(round.size());
    if (options.progress) options.progress(done, count);
  }

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
