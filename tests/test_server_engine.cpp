// The OpenAI API layer in-process, over the bundled model's CPU runner wrapped in a runner that
// fails or stalls on command: the statuses an HTTP client cannot cause by itself. An engine step
// that throws answers 500 with OpenAI's error object (a stream ends with an error event) and the
// server goes on; a full queue answers 503; /metrics answers while a step runs.
#if QUANTMLA_SERVER
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "model_fixtures.h"
#include "openai_server.h"
#include "quantmla/engine.h"
#include "quantmla/error.h"
#include "quantmla/runner.h"
#include "quantmla/tokenizer.h"
#include "test_paths.h"

namespace quantmla {
namespace {

using json = nlohmann::json;

// The CPU runner, except that a step throws while `failing` is set and waits while `stalled` is.
class ControlledRunner final : public Runner {
 public:
  explicit ControlledRunner(const Model& model) : inner_(make_cpu_runner(model)) {}
  const ModelConfig& config() const override { return inner_->config(); }
  std::string device() const override { return "controlled cpu"; }
  std::unique_ptr<PagePool> make_pool(const CacheFormat& format, int64_t num_pages) override {
    return inner_->make_pool(format, num_pages);
  }
  void step(const StepBatch& batch, PagePool& pool, const StepOutputs& outputs) override {
    {
      std::unique_lock lock(mutex_);
      ++steps_started;
      started_.notify_all();
      released_.wait(lock, [&] { return !stalled; });
    }
    if (failing) throw Error("injected step failure");
    inner_->step(batch, pool, outputs);
  }
  void stall() {
    std::lock_guard lock(mutex_);
    stalled = true;
  }
  void release() {
    std::lock_guard lock(mutex_);
    stalled = false;
    released_.notify_all();
  }
  // Waits until a step has started (and, when stalled, is waiting).
  bool wait_for_step(int64_t count) {
    std::unique_lock lock(mutex_);
    return started_.wait_for(lock, std::chrono::seconds(60),
                             [&] { return steps_started >= count; });
  }

  std::atomic<bool> failing{false};
  int64_t steps_started = 0;  // under mutex_

 private:
  std::unique_ptr<Runner> inner_;
  std::mutex mutex_;
  std::condition_variable started_, released_;
  bool stalled = false;
};

// The engine and the server on a free loopback port, as `quantmla serve` wires them.
class InProcessServer {
 public:
  explicit InProcessServer(int64_t max_waiting)
      : tokenizer_(Tokenizer::from_model_dir(testing::bundled_model())),
        runner_(testing::mla_tiny()),
        pool_(runner_.make_pool(CacheFormat::f32(), 32)),
        engine_(
            runner_, *pool_, {},
            [this](std::span<const int32_t> ids) {
              std::vector<int32_t> known;
              for (const int32_t id : ids) {
                if (tokenizer_.knows(id)) known.push_back(id);
              }
              return tokenizer_.decode(known);
            },
            max_waiting),
        server_(engine_, tokenizer_, std::nullopt, "", "", options()) {
    listener_ = std::thread([this] { server_.listen(); });
    for (int i = 0; i < 600 && server_.bound_port() <= 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ~InProcessServer() {
    runner_.release();
    engine_.shutdown(std::chrono::milliseconds(0));
    server_.stop();
    listener_.join();
  }
  ControlledRunner& runner() { return runner_; }
  int port() const { return server_.bound_port(); }
  // The pool as the engine thread last published it (the pool itself is that thread's).
  EngineSnapshot snapshot() const { return engine_.snapshot(); }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", server_.bound_port());
    c.set_read_timeout(120, 0);
    return c;
  }

 private:
  static cli::ServerOptions options() {
    cli::ServerOptions o;
    o.port = 0;
    o.served_model_name = "mla-tiny";
    o.http_threads = 8;
    return o;
  }
  Tokenizer tokenizer_;
  ControlledRunner runner_;
  std::unique_ptr<PagePool> pool_;
  ServingEngine engine_;
  cli::OpenAiServer server_;
  std::thread listener_;
};

const json kRequest = {{"prompt", {1, 400, 500, 600}}, {"max_tokens", 3}, {"ignore_eos", true}};

TEST(ServerErrors, AFailedEngineStepIsA500AndTheServerGoesOn) {
  InProcessServer server(16);
  ASSERT_GT(server.port(), 0);
  server.runner().failing = true;
  httplib::Client c = server.client();
  const auto failed = c.Post("/v1/completions", kRequest.dump(), "application/json");
  ASSERT_TRUE(failed);
  EXPECT_EQ(failed->status, 500);
  const json error = json::parse(failed->body);
  EXPECT_EQ(error["error"]["type"], "server_error") << failed->body;
  EXPECT_EQ(error["error"]["code"], 500);
  EXPECT_FALSE(error["error"]["message"].get<std::string>().empty());

  // Streamed: the status line is out before the failure, so the stream carries an error event,
  // then [DONE].
  json streamed = kRequest;
  streamed["stream"] = true;
  const auto stream = c.Post("/v1/completions", streamed.dump(), "application/json");
  ASSERT_TRUE(stream);
  EXPECT_EQ(stream->status, 200);
  EXPECT_NE(stream->body.find("data: {\"error\":"), std::string::npos) << stream->body;
  EXPECT_NE(stream->body.find("\"code\":500"), std::string::npos) << stream->body;
  EXPECT_EQ(stream->body.substr(stream->body.size() - 14), "data: [DONE]\n\n");

  // The failures freed their pages, and the next request runs.
  server.runner().failing = false;
  const auto ok = c.Post("/v1/completions", kRequest.dump(), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(json::parse(ok->body)["usage"]["completion_tokens"], 3);
  EXPECT_EQ(server.snapshot().used_pages, 0);
}

TEST(ServerErrors, AFullQueueIsA503) {
  InProcessServer server(1);  // one waiting request at most
  ASSERT_GT(server.port(), 0);
  server.runner().stall();
  // The first request is admitted and its step stalls; the engine thread cannot take more from
  // its inbox, so of the next two one waits and the other finds the queue full.
  constexpr int kRequests = 3;
  std::vector<std::atomic<int>> statuses(kRequests);
  std::vector<std::string> bodies(kRequests);
  std::vector<std::thread> clients;
  const auto send = [&](int i) {
    clients.emplace_back([&, i] {
      const auto r = server.client().Post("/v1/completions", kRequest.dump(), "application/json");
      if (r) bodies[i] = r->body;
      statuses[i] = r ? r->status : -1;
    });
  };
  send(0);
  ASSERT_TRUE(server.runner().wait_for_step(1));
  send(1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  send(2);
  int refused = -1;
  for (int i = 0; i < 1500 && refused < 0; ++i) {
    for (int k = 1; k < kRequests; ++k) {
      if (statuses[k] == 503) refused = k;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  server.runner().release();
  for (std::thread& t : clients) t.join();
  ASSERT_GT(refused, 0) << "no request was refused with 503";
  const json error = json::parse(bodies[refused]);
  EXPECT_EQ(error["error"]["type"], "server_error") << bodies[refused];
  EXPECT_EQ(error["error"]["code"], 503);
  EXPECT_NE(error["error"]["message"].get<std::string>().find("overloaded"), std::string::npos);
  EXPECT_EQ(statuses[0], 200) << bodies[0];
  EXPECT_EQ(statuses[3 - refused], 200) << "the one that waited ran once the step went on";
}

TEST(ServerErrors, MetricsAnswerWhileAStepRuns) {
  InProcessServer server(16);
  ASSERT_GT(server.port(), 0);
  server.runner().stall();
  std::thread client([&] {
    const auto r = server.client().Post("/v1/completions", kRequest.dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200);
  });
  ASSERT_TRUE(server.runner().wait_for_step(1));
  // The step is held: a scrape that waited for it would time out here (and before the engine
  // published between steps, a scrape could starve for a whole generation on a loaded machine).
  httplib::Client c = server.client();
  c.set_read_timeout(10, 0);
  const auto metrics = c.Get("/metrics");
  server.runner().release();
  client.join();
  ASSERT_TRUE(metrics) << "no /metrics reply while a step ran: "
                       << httplib::to_string(metrics.error());
  EXPECT_EQ(metrics->status, 200);
  // The stalled step's request, as of the step before it: admitted, waiting or running.
  const auto value = [&](const std::string& name) {
    const size_t at = metrics->body.find(name + "{");
    EXPECT_NE(at, std::string::npos) << name;
    return std::stod(metrics->body.substr(metrics->body.find("} ", at) + 2));
  };
  EXPECT_EQ(value("vllm:num_requests_running") + value("vllm:num_requests_waiting"), 1.0)
      << metrics->body;
}

}  // namespace
}  // namespace quantmla
#endif
