// The online benchmark client: one thread per request in flight, each streaming its completion
// and timing the first token (TTFT), the gaps between chunks (ITL) and the whole request.
#include "bench_online.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <thread>

#include "quantmla/error.h"
#include "quantmla/serve_bench.h"

namespace quantmla::cli {
namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

struct Measured {
  bool ok = false;
  std::string error;
  double ttft_ms = 0, e2e_ms = 0;
  std::vector<double> itl_ms;
  int64_t output_tokens = 0;
};

Measured send_one(const std::string& host, int port, const Request& r, const OnlineOptions& o) {
  Measured m;
  nlohmann::json body = {{"prompt", r.prompt}, {"max_tokens", r.max_tokens},
                         {"temperature", 0},   {"ignore_eos", r.ignore_eos},
                         {"stream", true},     {"stream_options", {{"include_usage", true}}}};
  if (!o.model_name.empty()) body["model"] = o.model_name;
  httplib::Client client(host, port);
  client.set_read_timeout(600, 0);
  client.set_tcp_nodelay(true);  // the request's header and body writes go out at once
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}};
  if (!o.api_key.empty()) req.headers.emplace("Authorization", "Bearer " + o.api_key);
  req.body = body.dump();
  std::string pending;
  const Clock::time_point start = Clock::now();
  Clock::time_point last = start;
  bool first = true;
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    pending.append(data, size);
    size_t end;
    while ((end = pending.find("\n\n")) != std::string::npos) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
      const nlohmann::json chunk = nlohmann::json::parse(event.substr(6), nullptr, false);
      if (chunk.is_discarded()) continue;
      if (chunk.contains("usage") && chunk["usage"].is_object()) {
        m.output_tokens = chunk["usage"].value("completion_tokens", int64_t{0});
      }
      if (!chunk.contains("choices") || chunk["choices"].empty()) continue;
      const Clock::time_point now = Clock::now();
      if (first) {
        m.ttft_ms = ms_between(start, now);
        first = false;
      } else {
        m.itl_ms.push_back(ms_between(last, now));
      }
      last = now;
    }
    return true;
  };
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  const bool sent = client.send(req, res, error);
  m.e2e_ms = ms_between(start, Clock::now());
  if (!sent) {
    m.error = "connection failed (" + httplib::to_string(error) + ")";
  } else if (res.status != 200) {
    m.error = "HTTP " + std::to_string(res.status) + ": " + res.body.substr(0, 200);
  } else {
    m.ok = !first;
    if (!m.ok) m.error = "no tokens in the stream";
  }
  return m;
}

}  // namespace

OnlineResult run_bench_online(const std::vector<Request>& requests, const OnlineOptions& o) {
  std::smatch parts;
  if (!std::regex_match(o.url, parts, std::regex("http://([^:/]+):([0-9]+)/?"))) {
    throw InvalidArgument("--url " + o.url + ": expected http://HOST:PORT");
  }
  const std::string host = parts[1];
  const int port = std::stoi(parts[2]);
  // Arrival times: all at once, or a Poisson process of the given rate.
  std::vector<double> arrival_s(requests.size(), 0.0);
  if (o.request_rate > 0) {
    std::mt19937_64 rng(o.seed);
    std::exponential_distribution<double> gap(o.request_rate);
    double t = 0;
    for (double& a : arrival_s) a = (t += gap(rng));
  }
  const size_t limit = o.concurrency > 0 ? static_cast<size_t>(o.concurrency) : requests.size();
  std::vector<Measured> measured(requests.size());
  std::atomic<size_t> next{0};
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> workers;
  for (size_t w = 0; w < std::min(limit, requests.size()); ++w) {
    workers.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < requests.size();) {
        std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(arrival_s[i])));
        measured[i] = send_one(host, port, requests[i], o);
      }
    });
  }
  for (std::thread& t : workers) t.join();
  OnlineResult r;
  r.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<double> ttft, tpot, itl;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Measured& m = measured[i];
    if (!m.ok) {
      ++r.failed;
      if (r.first_error.empty()) r.first_error = m.error;
      continue;
    }
    ++r.completed;
    r.output_tokens += m.output_tokens;
    r.prompt_tokens += static_cast<int64_t>(requests[i].prompt.size());
    ttft.push_back(m.ttft_ms);
    if (m.output_tokens > 1) {
      tpot.push_back((m.e2e_ms - m.ttft_ms) / static_cast<double>(m.output_tokens - 1));
    }
    itl.insert(itl.end(), m.itl_ms.begin(), m.itl_ms.end());
  }
  r.output_tok_s = static_cast<double>(r.output_tokens) / r.wall_s;
  r.total_tok_s = static_cast<double>(r.output_tokens + r.prompt_tokens) / r.wall_s;
  r.requests_s = static_cast<double>(r.completed) / r.wall_s;
  r.ttft_p50_ms = percentile(ttft, 0.5);
  r.ttft_p99_ms = percentile(ttft, 0.99);
  r.tpot_p50_ms = percentile(tpot, 0.5);
  r.tpot_p99_ms = percentile(tpot, 0.99);
  r.itl_p50_ms = percentile(itl, 0.5);
  r.itl_p99_ms = percentile(itl, 0.99);
  return r;
}

}  // namespace quantmla::cli
