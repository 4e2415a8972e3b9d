// Pass-key retrieval (shared/README.md): each prompt hides a number in filler text and asks for it;
// the model's greedy continuation must reproduce every answer token. The prompt is prefilled into a
// cache of the format under test and the answer decoded token by token through that cache: the real
// decode path, not a teacher-forced shortcut.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "quantmla/model.h"
#include "quantmla/runner.h"

namespace quantmla {

struct PasskeyPrompt {
  int64_t index = 0;            // entry in the prompts file
  int64_t ctx = 0;              // context the prompt was built for (1024, 2048, 4096)
  double depth = 0.0;           // needle position as a fraction of the filler, in [0, 1]
  std::vector<int32_t> prompt;  // token ids, BOS included
  std::vector<int32_t> answer;  // the tokens to produce after the prompt
};

// Reads a prompts file: a JSON array of {"ctx", "depth", "prompt", "answer"} (other keys ignored).
// Throws IoError if it cannot be read, FormatError naming the file, the entry and the field when
// the JSON is malformed or a field is missing, empty or of the wrong type.
std::vector<PasskeyPrompt> load_passkey_prompts(const std::string& path);

struct PasskeyOptions {
  CacheFormat cache = CacheFormat::f32();
  // Called after each round of prompts with (prompts done, prompts total).
  std::function<void(int64_t, int64_t)> progress;
  // Prompt tokens a step runs: prompts run side by side as many as this holds.
  int64_t max_batch_tokens = 8192;
};

struct PasskeyCount {
  int64_t n = 0;
  int64_t correct = 0;
  double accuracy() const { return n == 0 ? 0.0 : static_cast<double>(correct) / n; }
};

struct PasskeyResult {
  PasskeyCount total;
  std::map<int64_t, PasskeyCount> by_ctx;
  std::map<double, PasskeyCount> by_depth;
  std::vector<std::vector<int32_t>> outputs;  // per prompt, the decoded tokens
  std::vector<bool> correct;                  // per prompt
};

// Throws InvalidArgument for a prompt with token ids outside the vocabulary or longer, with its
// answer, than the model's positions (naming the prompt).
PasskeyResult evaluate_passkey(const Model& model, const std::vector<PasskeyPrompt>& prompts,
                               const PasskeyOptions& options);
// The same through a runner (any backend).
PasskeyResult evaluate_passkey(Runner& runner, const std::vector<PasskeyPrompt>& prompts,
                               const PasskeyOptions& options);

}  // namespace quantmla
