// bench-serve --url: the online client (vllm bench serve's measurements) against a running
// OpenAI-compatible server, streaming every request.
#pragma once

#include <string>
#include <vector>

#include "quantmla/scheduler.h"

namespace quantmla::cli {

struct OnlineOptions {
  std::string url;            // http://HOST:PORT
  std::string api_key;        // sent as Authorization: Bearer
  std::string model_name;     // the request's "model" ("" = left out)
  int64_t concurrency = 0;    // requests in flight at most (0 = no limit)
  double request_rate = 0.0;  // Poisson arrivals per second (0 = all at t = 0)
  uint64_t seed = 0;
};

struct OnlineResult {
  double wall_s = 0, output_tok_s = 0, total_tok_s = 0, requests_s = 0;
  double ttft_p50_ms = 0, ttft_p99_ms = 0, tpot_p50_ms = 0, tpot_p99_ms = 0;
  double itl_p50_ms = 0, itl_p99_ms = 0;
  int64_t completed = 0, failed = 0, output_tokens = 0, prompt_tokens = 0;
  std::string first_error;
};

// Sends every request (its prompt as token ids, greedy, ignore_eos, streamed with usage) and
// measures. Throws InvalidArgument for a URL it cannot use; per-request failures are counted.
OnlineResult run_bench_online(const std::vector<Request>& requests, const OnlineOptions& options);

}  // namespace quantmla::cli
