// quantmla serve: the OpenAI-compatible HTTP server. SIGINT / SIGTERM stop accepting, let the
// running requests finish for up to --shutdown-timeout seconds, cancel the rest, and exit 0.
#include <pthread.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>

#include "commands.h"
#include "openai_server.h"
#include "quantmla/error.h"
#include "quantmla/io.h"
#include "quantmla/serve_bench.h"

namespace quantmla::cli {
namespace {

struct ServeCliOptions {
  std::string model = kDefaultModel;
  std::string device = "cpu";
  bool batch_invariant = false;
  std::string cache;
  std::string cache_memory = "256MiB";
  std::optional<double> gpu_memory_utilization;
  SchedulerOptions scheduler;
  int64_t max_waiting = 1024;
  int64_t http_threads = 0;  // 0: max_seqs + 64
  double shutdown_timeout_s = 10.0;
  std::string chat_template;
  ServerOptions server;
};

// tokenizer_config.json's add_bos_token (default true, as the DeepSeek tokenizers have it).
bool reads_add_bos(const std::filesystem::path& dir) {
  const auto path = dir / "tokenizer_config.json";
  if (!std::filesystem::exists(path)) return true;
  const nlohmann::json config = nlohmann::json::parse(read_text_file(path), nullptr, false);
  if (!config.is_object()) throw FormatError(path.string() + " is not a JSON object");
  const auto it = config.find("add_bos_token");
  return it == config.end() || !it->is_boolean() || it->get<bool>();
}

void run_serve(ServeCliOptions options) {
  // Block the stop signals in every thread (the engine's and httplib's inherit the mask); one
  // thread waits for them and stops the server.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  const std::filesystem::path dir = options.model;
  const Tokenizer tokenizer = Tokenizer::from_model_dir(dir);
  const ChatSpecialTokens tokens = read_chat_special_tokens(dir);
  std::optional<ChatTemplate> chat_template =
      options.chat_template.empty()
          ? ChatTemplate::from_model_dir(dir)
          : std::optional<ChatTemplate>(ChatTemplate::from_file(options.chat_template));
  std::unique_ptr<Model> model;
  const std::unique_ptr<Runner> runner = make_runner(options.device, options.model, {}, model,
                                                     &options.scheduler, options.batch_invariant);
  const CacheFormat format = device_cache(options.device, options.model, options.cache, "bf16");
  const ModelConfig& c = runner->config();
  const CacheShape shape{c.num_layers, c.kv_lora_rank, c.qk_rope_head_dim};
  const int64_t bytes =
      cache_budget_bytes(options.cache_memory, options.gpu_memory_utilization, *runner);
  const int64_t pages = PagePool::pages_for_bytes(shape, format, bytes);
  if (pages < 1) throw InvalidArgument("--cache-memory " + options.cache_memory + " holds no page");
  auto pool = runner->make_pool(format, pages);
  std::fprintf(stderr, "serve: %s on %s, cache %s: %lld pages (%lld tokens)%s\n",
               options.model.c_str(), runner->device().c_str(), format.to_string().c_str(),
               static_cast<long long>(pages), static_cast<long long>(pages * kPageTokens),
               chat_template ? "" : ", no chat template (chat requests refused)");
  ServingEngine engine(
      *runner, *pool, options.scheduler,
      [&tokenizer](std::span<const int32_t> ids) {
        std::vector<int32_t> known;  // ids the tokenizer lacks have no text (Tokenizer::knows)
        for (const int32_t id : ids) {
          if (tokenizer.knows(id)) known.push_back(id);
        }
        return tokenizer.decode(known);
      },
      options.max_waiting);
  if (options.server.served_model_name.empty()) {
    options.server.served_model_name = std::filesystem::absolute(dir).filename().string();
  }
  options.server.add_bos = reads_add_bos(dir);
  options.server.max_model_len = effective_max_model_len(options.scheduler, runner->config());
  options.server.http_threads = static_cast<size_t>(
      options.http_threads > 0 ? options.http_threads : options.scheduler.max_seqs + 64);
  OpenAiServer server(engine, tokenizer, std::move(chat_template), tokens.bos_token,
                      tokens.eos_token, options.server);
  // On a signal: stop taking requests, give the running ones the deadline, then stop the HTTP
  // server (whose handler threads are waiting for exactly those requests) once their responses
  // have gone out (within the deadline again).
  const auto deadline =
      std::chrono::milliseconds(static_cast<int64_t>(options.shutdown_timeout_s * 1e3));
  std::thread waiter([&] {
    int signal = 0;
    sigwait(&signals, &signal);
    std::fprintf(stderr, "serve: signal %d, stopping\n", signal);
    engine.shutdown(deadline);
    server.stop(deadline);
  });
  const bool listened = server.listen();
  if (!listened) {
    pthread_kill(waiter.native_handle(), SIGTERM);
    waiter.join();
    throw IoError("cannot listen on " + options.server.host + ":" +
                  std::to_string(options.server.port));
  }
  waiter.join();
  std::fprintf(stderr, "serve: stopped\n");
}

}  // namespace

void add_serve(CLI::App& app) {
  auto o = std::make_shared<ServeCliOptions>();
  CLI::App* cmd = app.add_subcommand("serve",
                                     "OpenAI-compatible HTTP server (/v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /metrics)");
  cmd->add_option("--model", o->model, "Model directory")->capture_default_str();
  add_device_option(*cmd, o->device);
  add_batch_invariant_option(*cmd, o->batch_invariant);
  cmd->add_option("--cache", o->cache,
                  "Cache format (default: the spec calibrate recorded, else bf16)");
  CLI::Option* cache_memory =
      cmd->add_option("--cache-memory", o->cache_memory,
                      "Cache budget: a size (512MiB, 8GiB) or a fraction of free GPU memory (0.9)")
          ->capture_default_str();
  add_gpu_memory_utilization(*cmd, cache_memory, o->gpu_memory_utilization);
  cmd->add_option("--host", o->server.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", o->server.port, "Port (0: any free one, printed)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--max-seqs,--max-num-seqs", o->scheduler.max_seqs,
                  "Sequences one step runs (vLLM's name as an alias)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-batched-tokens,--max-num-batched-tokens", o->scheduler.max_batched_tokens,
                  "Tokens one step runs (vLLM's name as an alias)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  add_swap_space(*cmd, o->scheduler.swap_space_bytes);
  cmd->add_option("--max-model-len", o->scheduler.max_model_len,
                  "Positions a request may reach, prompt + max_tokens (vLLM's flag; 0: the "
                  "model's max_position_embeddings, at most that)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-waiting", o->max_waiting,
                  "Requests allowed to wait; more are answered 503")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--http-threads", o->http_threads,
                  "HTTP handler threads, each serving one request at a time (0: max-seqs + 64, so "
                  "that every running request and a few more are served at once)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--api-key", o->server.api_key, "Require Authorization: Bearer KEY");
  cmd->add_option("--served-model-name", o->server.served_model_name,
                  "Model id in the API (default: the model directory's name)");
  cmd->add_option("--chat-template", o->chat_template,
                  "Jinja chat template file (or a JSON file with chat_template), replacing the "
                  "model's");
  cmd->add_option("--shutdown-timeout", o->shutdown_timeout_s,
                  "Seconds running requests get to finish after SIGINT/SIGTERM")
      ->capture_default_str();
  cmd->callback([o] { run_serve(*o); });
}

}  // namespace quantmla::cli
