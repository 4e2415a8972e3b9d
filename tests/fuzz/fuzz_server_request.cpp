// A client's request body (untrusted) to /v1/completions and /v1/chat/completions of the real
// OpenAI server, in-process, over the schedule-only runner (the scheduler and the engine run; no
// model computes). Every body must get an answer that is not a 500: a 500 is an exception the
// request handling did not expect, and a crash or sanitizer report a worse one.
#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fuzz_common.h"
#include "openai_server.h"
#include "quantmla/chat_template.h"
#include "quantmla/config.h"
#include "quantmla/engine.h"
#include "quantmla/runner.h"
#include "quantmla/tokenizer.h"

namespace {

struct Fixture {
  Fixture()
      : tokenizer(quantmla::Tokenizer::from_model_dir(QUANTMLA_SOURCE_DIR "/models/mla-tiny")),
        runner(quantmla::make_schedule_only_runner(
            quantmla::ModelConfig::from_file(QUANTMLA_SOURCE_DIR "/models/mla-tiny/config.json"))),
        pool(runner->make_pool(quantmla::CacheFormat::parse("bf16"), 64)),
        engine(
            *runner, *pool, {},
            [this](std::span<const int32_t> ids) {
              std::vector<int32_t> known;
              for (const int32_t id : ids) {
                if (tokenizer.knows(id)) known.push_back(id);
              }
              return tokenizer.decode(known);
            },
            64),
        server(engine, tokenizer,
               quantmla::ChatTemplate::from_model_dir(quantmla::fuzz::shared_dir() /
                                                      "tokenizers/deepseek-v3"),
               "<s>", "</s>", options()) {
    listener = std::thread([this] { server.listen(); });
    for (int i = 0; i < 600 && server.bound_port() <= 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    client = std::make_unique<httplib::Client>("127.0.0.1", server.bound_port());
    client->set_keep_alive(true);
    client->set_tcp_nodelay(true);
    client->set_read_timeout(30, 0);
  }
  static quantmla::cli::ServerOptions options() {
    quantmla::cli::ServerOptions o;
    o.port = 0;
    o.served_model_name = "mla-tiny";
    o.http_threads = 4;
    return o;
  }
  quantmla::Tokenizer tokenizer;
  std::unique_ptr<quantmla::Runner> runner;
  std::unique_ptr<quantmla::PagePool> pool;
  quantmla::ServingEngine engine;
  quantmla::cli::OpenAiServer server;
  std::thread listener;
  std::unique_ptr<httplib::Client> client;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* fixture = new Fixture();  // lives until the process ends
  if (size == 0) return 0;
  // The first byte picks the route; the rest is the body.
  const char* path = data[0] % 2 == 0 ? "/v1/completions" : "/v1/chat/completions";
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  const auto res = fixture->client->Post(path, body, "application/json");
  if (!res) return 0;  // the connection failed (e.g. the server closed it): not a finding
  if (res->status >= 500) {
    std::fprintf(stderr, "status %d for %s: %s\n", res->status, path, res->body.c_str());
    std::abort();
  }
  return 0;
}
