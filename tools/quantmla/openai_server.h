// The OpenAI-compatible HTTP API over a ServingEngine (`quantmla serve`): /v1/models,
// /v1/completions, /v1/chat/completions (JSON or SSE streams), /health and /metrics (Prometheus
// text with vLLM's metric names). HTTP threads parse, validate, enqueue and stream; the engine
// thread runs the model.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "quantmla/chat_template.h"
#include "quantmla/engine.h"
#include "quantmla/tokenizer.h"

namespace quantmla::cli {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                // 0: any free port (tests), printed at start
  std::string api_key;            // "": no authentication
  std::string served_model_name;  // the id /v1/models lists and requests name
  int64_t max_model_len = 0;      // the max_model_len /v1/models lists (0: the model's positions)
  size_t max_body_bytes = size_t{8} << 20;
  bool add_bos = true;  // prepend BOS to text prompts (tokenizer_config add_bos_token)
  // HTTP handler threads. Each request in flight holds one until its last byte (a stream for its
  // whole generation), so this bounds the requests served at once; more wait for a thread.
  size_t http_threads = 320;
};

class OpenAiServer {
 public:
  OpenAiServer(ServingEngine& engine, const Tokenizer& tokenizer,
               std::optional<ChatTemplate> chat_template, std::string bos_token,
               std::string eos_token, ServerOptions options);
  ~OpenAiServer();
  // Binds and serves until stop(); returns false when the address cannot be bound.
  bool listen();
  // Stops serving once every streamed response has sent its last event, or after `grace`.
  void stop(std::chrono::milliseconds grace = std::chrono::milliseconds(0));
  // The port being served once listen() has bound it (0 before); any thread may ask.
  int bound_port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace quantmla::cli
