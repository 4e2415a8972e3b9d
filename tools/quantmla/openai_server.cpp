// OpenAiServer: request parsing and validation, the engine hand-off, JSON and SSE responses,
// OpenAI error objects, Prometheus metrics.
#include "openai_server.h"

#include <httplib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>
#include <vector>

#include "quantmla/error.h"
#include "quantmla/json_depth.h"
#include "quantmla/stream_text.h"

namespace quantmla::cli {
namespace {

// Insertion-ordered, as Python's dicts are: a chat template iterating a message or dumping a tool
// with tojson sees the client's key order, as transformers does.
using json = nlohmann::ordered_json;

// cpp-httplib's thread pool with its threads at niceness kHttpNiceness, below the engine thread:
// with hundreds of streams on a few cores, every GPU step wakes every handler at once,
// and at equal priority they would delay the engine's host work for the next step (the GPU then
// waits). Best effort: where the priority cannot be changed the threads run as they are.
constexpr int kHttpNiceness = 10;
class HandlerPool final : public httplib::TaskQueue {
 public:
  explicit HandlerPool(size_t threads) : pool_(threads) {}
  void enqueue(std::function<void()> fn) override {
    pool_.enqueue([fn = std::move(fn)] {
      thread_local const bool lowered = [] {
#ifdef __linux__
        // A thread id names one thread here (not the process): Linux's setpriority semantics.
        return setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), kHttpNiceness) ==
               0;
#else
        return false;
#endif
      }();
      (void)lowered;
      fn();
    });
  }
  void shutdown() override { pool_.shutdown(); }

 private:
  httplib::ThreadPool pool_;
};

// An error with the HTTP status and the OpenAI error object's fields.
struct ApiError {
  int status;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
};

[[noreturn]] void bad_field(const std::string& param, const std::string& message) {
  throw ApiError{400, message, "invalid_request_error", param};
}

std::string error_json(const ApiError& e) {
  json error = {{"message", e.message}, {"type", e.type}, {"code", e.status}};
  error["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  // Replacing invalid UTF-8: a parse error's message quotes the client's bytes as they came.
  return json{{"error", error}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

// The message of the error this thread last answered with, for the request's log line: httplib
// logs a response after compressing its body for a client that accepts gzip or brotli, so the
// logger cannot read it back from there. Each request is answered and logged on one thread.
thread_local std::string answered_error;

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_json(e), "application/json");
  answered_error = e.message;
}

// What a request's HTTP thread waits on: the engine thread appends tokens and the end.
struct Channel {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;  // when the request asked, one per token
  std::optional<FinishedRequest> done;
  RequestId id = 0;
};

struct Sampling {
  Request request;  // everything but the prompt
  int n = 1;        // choices per prompt
  bool stream = false;
  bool include_usage = false;
  bool echo = false;         // completions: the prompt before the completion (and in its logprobs)
  bool prompt_only = false;  // echo with max_tokens 0: the prompt without a completion
  // vLLM's prompt_logprobs: -1 none, else each prompt token's logprob and rank with this many
  // alternatives (completions: in each choice; chat: beside the choices)
  int prompt_logprobs = -1;
};

double number_field(const json& body, const char* name, double fallback, double low, double high) {
  if (!body.contains(name) || body[name].is_null()) return fallback;
  if (!body[name].is_number()) bad_field(name, std::string(name) + " must be a number");
  const double v = body[name].get<double>();
  if (!(v >= low && v <= high)) {
    bad_field(name, std::string(name) + " is " + std::to_string(v) + ", expected a value in [" +
                        std::to_string(low) + ", " + std::to_string(high) + "]");
  }
  return v;
}

// Deeper bodies are refused before anything copies or walks them (quantmla/json_depth.h says why).
constexpr int kMaxBodyNesting = 256;

// Serialized with invalid UTF-8 (a token's bytes may be part of a character) replaced.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Parameters of the OpenAI API (and vLLM's extensions) that this server does not implement are
// refused unless they hold their neutral value, never ignored: a client that asks for a penalty
// or a JSON answer must not get an ordinary one without being told.
void refuse_unsupported(const json& body, bool chat) {
  const auto present = [&](const char* name) {
    return body.contains(name) && !body[name].is_null();
  };
  const auto unsupported = [](const char* name, const std::string& neutral) {
    bad_field(name, std::string(name) + " is not supported by this server (leave it out, or send " +
                        neutral + ")");
  };
  // Beam search's (vLLM's), whose neutral value leaves the search alone.
  if (present("length_penalty") &&
      !(body["length_penalty"].is_number() && body["length_penalty"].get<double>() == 1.0)) {
    unsupported("length_penalty", "1");
  }
  if (present("use_beam_search") && body["use_beam_search"] != json(false)) {
    unsupported("use_beam_search", "false");
  }
  if (present("best_of") &&
      !(body["best_of"].is_number_integer() &&
        body["best_of"].get<int64_t>() ==
            (present("n") && body["n"].is_number_integer() ? body["n"].get<int64_t>() : 1))) {
    unsupported("best_of", "n");
  }
  if (chat) {
    if (present("echo") && body["echo"] != json(false)) unsupported("echo", "false");
    if (present("response_format") &&
        !(body["response_format"].is_object() &&
          body["response_format"].value("type", json("text")) == json("text"))) {
      unsupported("response_format", "{\"type\": \"text\"}");
    }
  } else {
    if (present("suffix") && body["suffix"] != json("")) unsupported("suffix", "\"\"");
  }
}

// An integer field; `fallback` when absent or null.
int64_t integer_field(const json& body, const char* name, int64_t fallback) {
  if (!body.contains(name) || body[name].is_null()) return fallback;
  if (!body[name].is_number_integer()) bad_field(name, std::string(name) + " must be an integer");
  return body[name].get<int64_t>();
}

// vLLM's and OpenAI's sampling parameters beyond temperature and top-p
// (quantmla/logits_controls.h): their types and ranges here, the token ids against the vocabulary
// by the scheduler's checks.
// Lists of token ids a request may give (each token of the request is checked against them).
constexpr size_t kMaxControlTokens = 1024;

void parse_controls(const json& body, Request& r) {
  LogitsControls& c = r.controls;
  const int64_t top_k = integer_field(body, "top_k", 0);
  if (top_k < -1 || top_k > std::numeric_limits<int32_t>::max()) {
    bad_field("top_k", "top_k is " + std::to_string(top_k) + ", expected -1 or 0 (all) or >= 1");
  }
  c.top_k = static_cast<int32_t>(std::max<int64_t>(top_k, 0));
  c.min_p = static_cast<float>(number_field(body, "min_p", 0.0, 0.0, 1.0));
  c.presence_penalty = static_cast<float>(number_field(body, "presence_penalty", 0.0, -2.0, 2.0));
  c.frequency_penalty = static_cast<float>(number_field(body, "frequency_penalty", 0.0, -2.0, 2.0));
  c.repetition_penalty =
      static_cast<float>(number_field(body, "repetition_penalty", 1.0, 0.01, 100.0));
  if (body.contains("logit_bias") && !body["logit_bias"].is_null()) {
    const json& bias = body["logit_bias"];
    if (!bias.is_object() || bias.size() > kMaxControlTokens) {
      bad_field("logit_bias", "logit_bias must be an object of at most " +
                                  std::to_string(kMaxControlTokens) + " tokens");
    }
    for (const auto& [key, value] : bias.items()) {
      // OpenAI's keys are token ids written as strings.
      const bool digits =
          !key.empty() && key.size() <= 9 &&
          std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      if (!digits) {
        bad_field("logit_bias", "logit_bias: key \"" + key + "\" is not a token id");
      }
      if (!value.is_number() || !(value.get<double>() >= -100.0 && value.get<double>() <= 100.0)) {
        bad_field("logit_bias",
                  "logit_bias: the bias of token " + key + " must be a number in [-100, 100]");
      }
      c.logit_bias.emplace_back(std::stoi(key), value.get<float>());
    }
  }
  r.min_tokens = integer_field(body, "min_tokens", 0);
  if (r.min_tokens < 0 || r.min_tokens > r.max_tokens) {
    bad_field("min_tokens", "min_tokens is " + std::to_string(r.min_tokens) +
                                ", expected 0..max_tokens (" + std::to_string(r.max_tokens) + ")");
  }
  if (body.contains("stop_token_ids") && !body["stop_token_ids"].is_null()) {
    const json& ids = body["stop_token_ids"];
    if (!ids.is_array() || ids.size() > kMaxControlTokens ||
        !std::all_of(ids.begin(), ids.end(), [](const json& v) {
          return v.is_number_integer() && v.get<int64_t>() >= 0 &&
                 v.get<int64_t>() <= std::numeric_limits<int32_t>::max();
        })) {
      bad_field("stop_token_ids", "stop_token_ids must be a list of at most " +
                                      std::to_string(kMaxControlTokens) + " token ids");
    }
    for (const json& v : ids) r.stop_token_ids.push_back(v.get<int32_t>());
  }
}

Sampling parse_sampling(const json& body, int64_t default_max_tokens, bool chat) {
  refuse_unsupported(body, chat);
  Sampling s;
  Request& r = s.request;
  if (body.contains("max_tokens") && !body["max_tokens"].is_null()) {
    // 0 only to echo a prompt with its logprobs (checked with echo below).
    if (!body["max_tokens"].is_number_integer() || body["max_tokens"].get<int64_t>() < 0) {
      bad_field("max_tokens", "max_tokens must be a positive integer");
    }
    r.max_tokens = body["max_tokens"].get<int64_t>();
  } else if (body.contains("max_completion_tokens") &&
             body["max_completion_tokens"].is_number_integer()) {
    r.max_tokens = std::max<int64_t>(1, body["max_completion_tokens"].get<int64_t>());
  } else {
    r.max_tokens = default_max_tokens;
  }
  r.sampling.temperature = static_cast<float>(number_field(body, "temperature", 1.0, 0.0, 2.0));
  r.sampling.top_p = static_cast<float>(number_field(body, "top_p", 1.0, 1e-9, 1.0));
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (!body["seed"].is_number_integer()) bad_field("seed", "seed must be an integer");
    r.sampling.seed = static_cast<uint64_t>(body["seed"].get<int64_t>());
  } else {
    static std::atomic<uint64_t> counter{0x5eed};
    r.sampling.seed = counter.fetch_add(0x9e3779b97f4a7c15ull);
  }
  if (body.contains("n") && !body["n"].is_null()) {
    if (!body["n"].is_number_integer() || body["n"].get<int64_t>() < 1 ||
        body["n"].get<int64_t>() > 16) {
      bad_field("n", "n must be an integer in [1, 16]");
    }
    s.n = body["n"].get<int>();
  }
  // Completions: "logprobs": N (0..5) alternatives. Chat: "logprobs": true, "top_logprobs": N.
  if (body.contains("logprobs") && !body["logprobs"].is_null()) {
    const json& lp = body["logprobs"];
    if (chat) {
      if (!lp.is_boolean()) bad_field("logprobs", "logprobs must be a boolean");
      if (lp.get<bool>()) {
        r.top_logprobs = 0;
        if (body.contains("top_logprobs") && !body["top_logprobs"].is_null()) {
          const json& top = body["top_logprobs"];
          // Compared as 64-bit integers: get<int>() would wrap 2^32 + 5 to 5.
          if (!top.is_number_integer() || top.get<int64_t>() < 0 ||
              top.get<int64_t>() > kMaxTopLogprobs) {
            bad_field("top_logprobs", "top_logprobs must be an integer in [0, 20]");
          }
          r.top_logprobs = top.get<int>();
        }
      }
    } else {
      if (!lp.is_number_integer() || lp.get<int64_t>() < 0 || lp.get<int64_t>() > 5) {
        bad_field("logprobs", "logprobs must be an integer in [0, 5]");
      }
      r.top_logprobs = lp.get<int>();
    }
  } else if (chat && body.contains("top_logprobs") && !body["top_logprobs"].is_null()) {
    bad_field("top_logprobs", "top_logprobs needs logprobs: true");
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& stop = body["stop"];
    if (stop.is_string()) {
      r.stop.push_back(stop.get<std::string>());
    } else if (stop.is_array() && stop.size() <= 4 &&
               std::all_of(stop.begin(), stop.end(), [](const json& v) { return v.is_string(); })) {
      for (const json& v : stop) r.stop.push_back(v.get<std::string>());
    } else {
      bad_field("stop", "stop must be a string or a list of up to 4 strings");
    }
    r.stop.erase(std::remove(r.stop.begin(), r.stop.end(), std::string()), r.stop.end());
  }
  parse_controls(body, r);
  if (r.min_tokens > 0 && !r.stop.empty()) {
    // The visible text is cut at a stop string wherever it stands, while min_tokens would have
    // the request go on past one in its first tokens: the two do not mix here.
    bad_field("min_tokens", "min_tokens is not supported together with stop strings");
  }
  if (body.contains("ignore_eos")) {
    if (!body["ignore_eos"].is_boolean()) bad_field("ignore_eos", "ignore_eos must be a boolean");
    r.ignore_eos = body["ignore_eos"].get<bool>();
  }
  if (body.contains("stream")) {
    if (!body["stream"].is_boolean()) bad_field("stream", "stream must be a boolean");
    s.stream = body["stream"].get<bool>();
  }
  if (!chat && body.contains("echo") && !body["echo"].is_null()) {
    if (!body["echo"].is_boolean()) bad_field("echo", "echo must be a boolean");
    s.echo = body["echo"].get<bool>();
    if (s.echo && s.stream) bad_field("echo", "echo is not supported with stream: true");
    // OpenAI's way of scoring a text: echo with logprobs gives the prompt's tokens theirs.
    if (s.echo) r.prompt_logprobs = r.top_logprobs;
  }
  if (r.max_tokens == 0) {
    // The prompt alone, echoed: the request runs one token, which the answer leaves out.
    if (!s.echo) bad_field("max_tokens", "max_tokens must be a positive integer (0 needs echo)");
    s.prompt_only = true;
    r.max_tokens = 1;
  }
  if (body.contains("prompt_logprobs") && !body["prompt_logprobs"].is_null()) {
    // Compared as 64-bit integers: a cast to int first would wrap 2^32 + 5 to 5.
    const int64_t count = integer_field(body, "prompt_logprobs", -1);
    if (count < 0 || count > kMaxTopLogprobs) {
      bad_field("prompt_logprobs", "prompt_logprobs must be an integer in [0, 20]");
    }
    if (s.stream) {
      bad_field("prompt_logprobs", "prompt_logprobs is not supported with stream: true");
    }
    s.prompt_logprobs = static_cast<int>(count);
    r.prompt_logprobs = std::max(r.prompt_logprobs, s.prompt_logprobs);
  }
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& options = body["stream_options"];
    if (!options.is_object()) bad_field("stream_options", "stream_options must be an object");
    if (options.contains("include_usage") && !options["include_usage"].is_null()) {
      if (!options["include_usage"].is_boolean()) {
        bad_field("stream_options", "stream_options.include_usage must be a boolean");
      }
      s.include_usage = options["include_usage"].get<bool>();
    }
  }
  return s;
}

// The bytes of one token; none for an id the tokenizer does not know (Tokenizer::knows).
std::string token_text(const Tokenizer& tokenizer, int32_t id) {
  return tokenizer.knows(id) ? tokenizer.token_bytes(id) : std::string();
}

const char* finish_reason(const FinishedRequest& f, bool stopped) {
  if (stopped) return "stop";
  switch (f.reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    default:
      return "abort";
  }
}

// Prometheus histogram with fixed buckets (seconds).
struct Histogram {
  std::vector<double> bounds;
  std::vector<int64_t> counts;
  double sum = 0;
  int64_t count = 0;
  explicit Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size(), 0) {}
  void add(double v) {
    for (size_t i = 0; i < bounds.size(); ++i) counts[i] += v <= bounds[i];
    sum += v;
    ++count;
  }
  void write(std::ostringstream& out, const std::string& name, const std::string& help,
             const std::string& labels) const {
    out << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
    for (size_t i = 0; i < bounds.size(); ++i) {
      out << name << "_bucket{" << labels << ",le=\"" << bounds[i] << "\"} " << counts[i] << "\n";
    }
    out << name << "_bucket{" << labels << ",le=\"+Inf\"} " << count << "\n";
    out << name << "_sum{" << labels << "} " << sum << "\n"
        << name << "_count{" << labels << "} " << count << "\n";
  }
};

}  // namespace

struct OpenAiServer::Impl {
  ServingEngine& engine;
  const Tokenizer& tokenizer;
  std::optional<ChatTemplate> chat_template;
  std::string bos_token, eos_token;
  ServerOptions options;
  // The port once bound (options.port, or the one the system chose for 0): read by other threads
  // while listen() runs.
  std::atomic<int> bound_port{0};
  httplib::Server http;
  std::atomic<int64_t> next_id{1};
  std::mutex metrics_mutex;
  Histogram ttft{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0}};
  Histogram tpot{{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0}};
  Histogram e2e{
      {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0}};
  int64_t success[3] = {0, 0, 0};  // stop, length, abort
  // Streamed responses not yet ended (their provider's releaser not yet run): stop() waits for
  // them, since httplib's chunked writer stops writing once the server is stopped, which would
  // cut a stream between its engine finishing and its last events ([DONE], usage) going out.
  std::mutex streams_mutex;
  std::condition_variable streams_ended;
  int open_streams = 0;

  Impl(ServingEngine& e, const Tokenizer& t, std::optional<ChatTemplate> c, std::string bos,
       std::string eos, ServerOptions o)
      : engine(e),
        tokenizer(t),
        chat_template(std::move(c)),
        bos_token(std::move(bos)),
        eos_token(std::move(eos)),
        options(std::move(o)) {
    const size_t threads = std::max<size_t>(options.http_threads, 1);
    http.new_task_queue = [threads] { return new HandlerPool(threads); };
    routes();
  }

  void check_auth(const httplib::Request& req) const {
    if (options.api_key.empty()) return;
    if (req.get_header_value("Authorization") != "Bearer " + options.api_key) {
      throw ApiError{401, "invalid or missing API key (Authorization: Bearer KEY)",
                     "authentication_error", ""};
    }
  }

  json parse_body(const httplib::Request& req) const {
    json body;
    try {
      body = json::parse(req.body);
    } catch (const json::exception& e) {
      throw ApiError{400, std::string("the body is not valid JSON: ") + e.what(),
                     "invalid_request_error", ""};
    }
    if (!body.is_object())
      throw ApiError{400, "the body must be a JSON object", "invalid_request_error", ""};
    if (json_nesting_depth(body, kMaxBodyNesting) > kMaxBodyNesting) {
      throw ApiError{400,
                     "the body nests deeper than " + std::to_string(kMaxBodyNesting) + " levels",
                     "invalid_request_error", ""};
    }
    if (body.contains("model") && body["model"] != options.served_model_name) {
      throw ApiError{404,
                     "The model `" +
                         (body["model"].is_string() ? body["model"].get<std::string>()
                                                    : body["model"].dump()) +
                         "` does not exist (this server has `" + options.served_model_name + "`)",
                     "NotFoundError", "model"};
    }
    return body;
  }

  std::vector<int32_t> text_prompt(const std::string& text) const {
    std::vector<int32_t> ids;
    if (options.add_bos) ids.push_back(static_cast<int32_t>(engine.runner().config().bos_token_id));
    const std::vector<int32_t> encoded = tokenizer.encode(text);
    ids.insert(ids.end(), encoded.begin(), encoded.end());
    return ids;
  }

  std::vector<int32_t> id_prompt(const json& ids) const {
    std::vector<int32_t> out;
    for (const json& v : ids) {
      if (!v.is_number_integer()) bad_field("prompt", "a token id prompt must hold integers");
      out.push_back(v.get<int32_t>());
    }
    return out;
  }

  // "prompt": a string, token ids, or a list of either (several prompts).
  std::vector<std::vector<int32_t>> completion_prompts(const json& body) const {
    if (!body.contains("prompt")) bad_field("prompt", "prompt is required");
    const json& p = body["prompt"];
    if (p.is_string()) return {text_prompt(p.get<std::string>())};
    if (p.is_array() && !p.empty() && p[0].is_number_integer()) return {id_prompt(p)};
    if (!p.is_array() || p.empty()) {
      bad_field("prompt", "prompt must be a string, a list of token ids, or a list of those");
    }
    if (p.size() > 64) bad_field("prompt", "at most 64 prompts in one request");
    std::vector<std::vector<int32_t>> prompts;
    for (const json& one : p) {
      if (one.is_string()) {
        prompts.push_back(text_prompt(one.get<std::string>()));
      } else if (one.is_array()) {
        prompts.push_back(id_prompt(one));
      } else {
        bad_field("prompt", "each prompt of a list must be a string or a list of token ids");
      }
    }
    return prompts;
  }

  std::vector<int32_t> chat_prompt(const json& body) const {
    if (!chat_template) {
      bad_field("messages",
                "this model has no chat template (tokenizer_config.json chat_template); start the "
                "server with --chat-template FILE");
    }
    if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty()) {
      bad_field("messages", "messages must be a non-empty list");
    }
    for (const json& m : body["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
        bad_field("messages", "every message needs a role");
      }
    }
    // The OpenAI API's tool definitions go to the template as transformers' `tools`.
    const json tools = body.contains("tools") ? body["tools"] : json(nullptr);
    if (!tools.is_null() && !tools.is_array()) bad_field("tools", "tools must be a list");
    std::string text;
    try {
      text =
          apply_chat_template(*chat_template, body["messages"], true, bos_token, eos_token, tools);
    } catch (const Error& e) {
      bad_field("messages", std::string("the chat template refused the messages: ") + e.what());
    }
    return tokenizer.encode(text);
  }

  // Queues one request; its tokens and end arrive on the returned channel, and its end is logged
  // and counted in the metrics.
  std::shared_ptr<Channel> submit(Request request, const std::string& id) {
    const size_t prompt = request.prompt.size();
    auto channel = std::make_shared<Channel>();
    RequestCallbacks callbacks;
    callbacks.on_token = [channel](const StepReport::Generated& g) {
      std::lock_guard lock(channel->mutex);
      channel->tokens.push_back(g.token);
      if (g.logprob) channel->logprobs.push_back(*g.logprob);
      channel->changed.notify_all();
    };
    callbacks.on_finish = [this, channel, id, prompt](const FinishedRequest& f) {
      record(f, id, prompt);
      std::lock_guard lock(channel->mutex);
      channel->done = f;
      channel->changed.notify_all();
    };
    try {
      channel->id = engine.submit(std::move(request), std::move(callbacks));
    } catch (const ServingEngine::QueueFull& e) {
      throw ApiError{503, std::string("the server is overloaded: ") + e.what(), "server_error", ""};
    } catch (const CapacityError& e) {
      throw ApiError{400, e.what(), "invalid_request_error", "max_tokens"};
    } catch (const InvalidArgument& e) {
      throw ApiError{400, e.what(), "invalid_request_error", ""};
    }
    return channel;
  }

  void record(const FinishedRequest& f, const std::string& id, size_t prompt) {
    const char* reason = finish_reason(f, false);
    {
      std::lock_guard lock(metrics_mutex);
      if (f.first_token_s >= 0) ttft.add(f.first_token_s - f.arrival_s);
      if (f.tokens.size() > 1) {
        tpot.add((f.finish_s - f.first_token_s) / static_cast<double>(f.tokens.size() - 1));
      }
      e2e.add(f.finish_s - f.arrival_s);
      ++success[std::string(reason) == "stop" ? 0 : std::string(reason) == "length" ? 1 : 2];
    }
    // The engine's failures answer 500 (or end a stream with an error event); everything else
    // that reached the engine was answered 200.
    std::fprintf(stderr,
                 "request %s: status %d, %s, prompt %zu tokens, generated %zu, ttft %.1f ms, "
                 "total %.1f ms\n",
                 id.c_str(), f.reason == FinishReason::kError ? 500 : 200,
                 f.reason == FinishReason::kError ? "error" : reason, prompt, f.tokens.size(),
                 f.first_token_s >= 0 ? (f.first_token_s - f.arrival_s) * 1e3 : -1.0,
                 (f.finish_s - f.arrival_s) * 1e3);
  }

  // OpenAI's logprobs objects: completions {tokens, token_logprobs, top_logprobs, text_offset},
  // chat {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
  // tokens [first, end) of a request: a response's whole list, or a stream chunk's part
  // (`offset`: the text offset of tokens[first], for text_offset).
  json logprobs_json(const std::vector<int32_t>& tokens_in, const std::vector<TokenLogprob>& lps,
                     size_t first, size_t end, size_t offset, bool chat) const {
    const auto bytes_of = [](const std::string& text) {
      json out = json::array();
      for (unsigned char c : text) out.push_back(static_cast<int>(c));
      return out;
    };
    if (chat) {
      json content = json::array();
      for (size_t i = first; i < end && i < lps.size(); ++i) {
        const std::string token = token_text(tokenizer, tokens_in[i]);
        json top = json::array();
        for (const auto& [id, lp] : lps[i].top) {
          const std::string text = token_text(tokenizer, id);
          top.push_back({{"token", text}, {"logprob", lp}, {"bytes", bytes_of(text)}});
        }
        content.push_back({{"token", token},
                           {"logprob", lps[i].logprob},
                           {"bytes", bytes_of(token)},
                           {"top_logprobs", top}});
      }
      return {{"content", content}};
    }
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
         offsets = json::array();
    for (size_t i = first; i < end && i < lps.size(); ++i) {
      const std::string token = token_text(tokenizer, tokens_in[i]);
      tokens.push_back(token);
      token_logprobs.push_back(lps[i].logprob);
      json alternatives = json::object();
      for (const auto& [id, lp] : lps[i].top) alternatives[token_text(tokenizer, id)] = lp;
      top.push_back(alternatives);
      offsets.push_back(offset);
      offset += token.size();
    }
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", top},
            {"text_offset", offsets}};
  }

  // vLLM's prompt_logprobs: null for the first prompt token, then for each other one a map from
  // token ids to {logprob, rank, decoded_token}: the token's own and its `top` alternatives.
  json vllm_prompt_logprobs_json(const std::vector<int32_t>& prompt,
                                 const std::vector<TokenLogprob>& lps, int top) const {
    json out = json::array({nullptr});
    for (size_t i = 0; i < lps.size() && i + 1 < prompt.size(); ++i) {
      const int32_t id = prompt[i + 1];
      json entry = {{std::to_string(id),
                     {{"logprob", lps[i].logprob},
                      {"rank", lps[i].rank},
                      {"decoded_token", token_text(tokenizer, id)}}}};
      for (size_t j = 0; j < lps[i].top.size() && j < static_cast<size_t>(top); ++j) {
        const auto& [alternative, lp] = lps[i].top[j];
        const std::string key = std::to_string(alternative);
        if (entry.contains(key)) continue;
        entry[key] = {{"logprob", lp},
                      {"rank", j + 1},
                      {"decoded_token", token_text(tokenizer, alternative)}};
      }
      out.push_back(entry);
    }
    return out;
  }

  // Completions' logprobs with echo: the prompt's tokens first (the first one without a logprob,
  // as OpenAI's), then the generated ones, one text offset running through both. `top`: the
  // alternatives asked for (the prompt's may have been scored with more, for prompt_logprobs).
  json echoed_logprobs_json(const std::vector<int32_t>& prompt, const FinishedRequest& f,
                            int top) const {
    const std::string first = token_text(tokenizer, prompt[0]);
    json out = {{"tokens", {first}},
                {"token_logprobs", {nullptr}},
                {"top_logprobs", {nullptr}},
                {"text_offset", {0}}};
    size_t offset = first.size();
    const std::vector<int32_t> scored(prompt.begin() + 1, prompt.end());
    std::vector<TokenLogprob> prompt_lps = f.prompt_logprobs;
    for (TokenLogprob& lp : prompt_lps) {
      lp.top.resize(std::min(lp.top.size(), static_cast<size_t>(top)));
    }
    const json prompt_part = logprobs_json(scored, prompt_lps, 0, scored.size(), offset, false);
    for (const int32_t id : scored) offset += token_text(tokenizer, id).size();
    const json generated_part =
        logprobs_json(f.tokens, f.logprobs, 0, f.tokens.size(), offset, false);
    for (const json& part : {prompt_part, generated_part}) {
      for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
        for (const json& v : part[key]) out[key].push_back(v);
      }
    }
    return out;
  }

  // The whole exchange of one completion or chat request.
  void serve(const httplib::Request& req, httplib::Response& res, bool chat) {
    check_auth(req);
    const json body = parse_body(req);
    const std::vector<std::vector<int32_t>> prompts =
        chat ? std::vector<std::vector<int32_t>>{chat_prompt(body)} : completion_prompts(body);
    Sampling s = parse_sampling(body, chat ? 512 : 16, chat);
    const bool want_logprobs = s.request.top_logprobs >= 0;
    const std::vector<std::string> stop = s.request.stop;
    const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id++);
    const int64_t created = static_cast<int64_t>(std::time(nullptr));
    const std::string object = chat ? "chat.completion" : "text_completion";
    size_t prompt_tokens = 0;
    for (const auto& p : prompts) prompt_tokens += p.size();
    // By value: the stream's provider runs after this function has returned.
    const auto usage = [prompt_tokens](size_t generated) {
      return json{{"prompt_tokens", prompt_tokens},
                  {"completion_tokens", generated},
                  {"total_tokens", prompt_tokens + generated}};
    };
    // Choice k = prompt k / n, sample k % n (its own seed, so the samples differ).
    std::vector<std::shared_ptr<Channel>> channels;
    try {
      for (size_t k = 0; k < prompts.size() * static_cast<size_t>(s.n); ++k) {
        Request r = s.request;
        r.prompt = prompts[k / static_cast<size_t>(s.n)];
        r.sampling.seed += k % static_cast<size_t>(s.n);
        channels.push_back(
            submit(std::move(r), channels.empty() ? id : id + "-" + std::to_string(k)));
      }
    } catch (...) {
      for (const auto& c : channels) engine.cancel(c->id);
      throw;
    }
    // From here on the engine logs the request (record); the header tells the logger so.
    res.set_header("X-Request-Id", id);
    if (!s.stream) {
      json choices = json::array();
      json prompt_logprobs = nullptr;
      size_t generated = 0;
      for (size_t k = 0; k < channels.size(); ++k) {
        std::unique_lock lock(channels[k]->mutex);
        channels[k]->changed.wait(lock, [&] { return channels[k]->done.has_value(); });
        FinishedRequest f = *channels[k]->done;
        lock.unlock();
        if (f.reason == FinishReason::kError) {
          throw ApiError{500, "the engine failed while running the request", "server_error", ""};
        }
        if (s.prompt_only) {  // the token it ran is not part of the answer
          f.tokens.clear();
          f.logprobs.clear();
          f.reason = FinishReason::kLength;
        }
        StreamText t(tokenizer, stop);
        t.update(f.tokens, /*complete=*/true);
        json choice = {{"index", k}, {"finish_reason", finish_reason(f, t.stopped())}};
        const std::vector<int32_t>& prompt = prompts[k / static_cast<size_t>(s.n)];
        if (chat) {
          choice["message"] = {{"role", "assistant"}, {"content", t.text()}};
        } else if (s.echo) {
          // The prompt's text as the tokenizer gives it back (special tokens skipped, as in the
          // completion's text): a text prompt's own text.
          StreamText echoed(tokenizer, {});
          echoed.update(prompt, /*complete=*/true);
          choice["text"] = echoed.text() + t.text();
        } else {
          choice["text"] = t.text();
        }
        choice["logprobs"] = !want_logprobs ? json(nullptr)
                             : s.echo
                                 ? echoed_logprobs_json(prompt, f, s.request.top_logprobs)
                                 : logprobs_json(f.tokens, f.logprobs, 0, f.tokens.size(), 0, chat);
        if (s.prompt_logprobs >= 0) {
          const json scored =
              vllm_prompt_logprobs_json(prompt, f.prompt_logprobs, s.prompt_logprobs);
          // vLLM's place for it: each completion choice, or beside a chat's choices.
          if (chat) {
            prompt_logprobs = scored;
          } else {
            choice["prompt_logprobs"] = scored;
          }
        }
        choices.push_back(choice);
        generated += f.tokens.size();
      }
      json out = {{"id", id},           {"object", object},
                  {"created", created}, {"model", options.served_model_name},
                  {"choices", choices}, {"usage", usage(generated)}};
      if (chat && s.prompt_logprobs >= 0) out["prompt_logprobs"] = prompt_logprobs;
      res.set_content(dump(out), "application/json");
      return;
    }
    // Server-sent events: per choice a chunk whenever it has new text, the last one with its
    // finish reason; then the usage when asked, then [DONE]. A client that goes away cancels the
    // requests.
    const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
    struct StreamState {
      size_t sent_bytes = 0;    // of the visible text
      size_t sent_tokens = 0;   // whose logprobs went out
      size_t token_offset = 0;  // text offset of the next token (logprobs' text_offset)
      size_t seen_tokens = 0;   // generated tokens a chunk went out for
      bool first = true, finished = false;
      std::shared_ptr<StreamText> text;  // the visible text so far, updated incrementally
    };
    auto states = std::make_shared<std::vector<StreamState>>(channels.size());
    for (StreamState& st : *states) st.text = std::make_shared<StreamText>(tokenizer, stop);
    const auto chunk = [=, this](size_t k, const std::string& text, const char* reason,
                                 const std::vector<int32_t>& tokens,
                                 const std::vector<TokenLogprob>& lps) {
      StreamState& st = (*states)[k];
      json choice = {{"index", k}};
      json logprobs = nullptr;
      if (want_logprobs) {
        logprobs = logprobs_json(tokens, lps, st.sent_tokens, lps.size(), st.token_offset, chat);
        for (size_t i = st.sent_tokens; i < lps.size(); ++i) {
          st.token_offset += token_text(tokenizer, tokens[i]).size();
        }
        st.sent_tokens = lps.size();
      }
      if (chat) {
        json delta = json::object();
        if (st.first) delta["role"] = "assistant";
        if (!text.empty() || st.first) delta["content"] = text;
        choice["delta"] = delta;
      } else {
        choice["text"] = text;
      }
      choice["logprobs"] = logprobs;
      st.first = false;
      choice["finish_reason"] = reason == nullptr ? json(nullptr) : json(reason);
      const json out = {{"id", id},
                        {"object", chunk_object},
                        {"created", created},
                        {"model", options.served_model_name},
                        {"choices", {choice}}};
      return "data: " + dump(out) + "\n\n";
    };
    const bool include_usage = s.include_usage;
    {
      std::lock_guard lock(streams_mutex);
      ++open_streams;
    }
    res.set_chunked_content_provider(
        "text/event-stream",
        [=, this](size_t, httplib::DataSink& sink) {
          // Wait a little for the first unfinished choice, then look at all of them.
          for (size_t k = 0; k < channels.size(); ++k) {
            if ((*states)[k].finished) continue;
            std::unique_lock lock(channels[k]->mutex);
            channels[k]->changed.wait_for(lock, std::chrono::milliseconds(50));
            break;
          }
          if (!sink.is_writable()) return false;
          size_t generated = 0;
          bool all_done = true;
          std::string out;
          for (size_t k = 0; k < channels.size(); ++k) {
            Channel& c = *channels[k];
            std::unique_lock lock(c.mutex);
            const std::vector<int32_t> tokens = c.tokens;
            const std::vector<TokenLogprob> lps = c.logprobs;
            const std::optional<FinishedRequest> done = c.done;
            lock.unlock();
            StreamState& st = (*states)[k];
            if (done) generated += done->tokens.size();
            if (st.finished) continue;
            StreamText& t = *st.text;
            t.update(tokens, done.has_value());
            // A chunk for every step that generated tokens, with the text they make visible
            // (possibly none: held back for a stop string or a split character, or tokens
            // without text), as vLLM does, so that clients see each token's time.
            if (t.text().size() > st.sent_bytes || tokens.size() > st.seen_tokens) {
              out += chunk(k, t.text().substr(st.sent_bytes), nullptr, tokens, lps);
              st.sent_bytes = t.text().size();
              st.seen_tokens = tokens.size();
            }
            if (!done && t.stopped()) {
              // The text reached a stop string the engine has not seen yet (special tokens are
              // skipped here): end the request now.
              engine.cancel(c.id);
            }
            if (done && done->reason == FinishReason::kError) {
              // The status line went out with the first byte: the failure is an error event (as
              // vLLM sends one), which OpenAI's client libraries raise.
              out += "data: " +
                     error_json(
                         {500, "the engine failed while running the request", "server_error", ""}) +
                     "\n\n";
              st.finished = true;
            } else if (done) {
              out += chunk(k, "", finish_reason(*done, t.stopped()), tokens, lps);
              st.finished = true;
            } else {
              all_done = false;
            }
          }
          if (!out.empty() && !sink.write(out.data(), out.size())) return false;
          if (!all_done) return true;
          std::string tail;
          if (include_usage) {
            tail += "data: " +
                    dump(json{{"id", id},
                              {"object", chunk_object},
                              {"created", created},
                              {"model", options.served_model_name},
                              {"choices", json::array()},
                              {"usage", usage(generated)}}) +
                    "\n\n";
          }
          tail += "data: [DONE]\n\n";
          sink.write(tail.data(), tail.size());
          sink.done();
          return true;
        },
        [=, this](bool success) {
          if (!success) {
            for (const auto& c : channels) {
              std::lock_guard lock(c->mutex);
              if (!c->done) {
                std::fprintf(stderr, "request %s: client went away, cancelled\n", id.c_str());
                engine.cancel(c->id);
              }
            }
          }
          std::lock_guard lock(streams_mutex);
          --open_streams;
          streams_ended.notify_all();
        });
  }

  std::string metrics() {
    const EngineSnapshot s = engine.snapshot();
    std::ostringstream out;
    out.precision(15);  // counters exact to 10^15, bucket bounds as written
    const std::string labels = "model_name=\"" + options.served_model_name + "\"";
    const auto gauge = [&](const char* name, const char* help, const char* type, double v) {
      out << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n"
          << name << "{" << labels << "} " << v << "\n";
    };
    gauge("vllm:num_requests_running", "Requests holding cache pages.", "gauge",
          static_cast<double>(s.running));
    gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", "gauge",
          static_cast<double>(s.waiting));
    gauge("vllm:kv_cache_usage_perc", "Fraction of the cache pages in use (1 = full).", "gauge",
          s.total_pages > 0 ? static_cast<double>(s.used_pages) / s.total_pages : 0.0);
    gauge(
        "vllm:cpu_cache_usage_perc",
        "Fraction of the swap space that preempted requests' records hold (1 = full).", "gauge",
        s.swap_space_bytes > 0 ? static_cast<double>(s.swap_used_bytes) / s.swap_space_bytes : 0.0);
    gauge("vllm:num_preemptions_total", "Preemptions (by swap or recompute).", "counter",
          static_cast<double>(s.stats.preemptions));
    gauge("vllm:prompt_tokens_total", "Prompt tokens of submitted requests.", "counter",
          static_cast<double>(s.prompt_tokens_total));
    gauge("vllm:generation_tokens_total", "Generated tokens.", "counter",
          static_cast<double>(s.generation_tokens_total));
    std::lock_guard lock(metrics_mutex);
    out << "# HELP vllm:request_success_total Finished requests by finish reason.\n"
        << "# TYPE vllm:request_success_total counter\n";
    const char* reasons[] = {"stop", "length", "abort"};
    for (int i = 0; i < 3; ++i) {
      out << "vllm:request_success_total{" << labels << ",finished_reason=\"" << reasons[i]
          << "\"} " << success[i] << "\n";
    }
    ttft.write(out, "vllm:time_to_first_token_seconds", "Time to first token.", labels);
    tpot.write(out, "vllm:time_per_output_token_seconds", "Time per output token.", labels);
    e2e.write(out, "vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels);
    return out.str();
  }

  void routes() {
    http.set_payload_max_length(options.max_body_bytes);
    const auto guarded = [](auto&& handler) {
      return [handler](const httplib::Request& req, httplib::Response& res) {
        try {
          handler(req, res);
        } catch (const ApiError& e) {
          send_error(res, e);
        } catch (const std::exception& e) {
          send_error(res, {500, e.what(), "server_error", ""});
        }
      };
    };
    http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("", "text/plain");
    });
    http.Get(
        "/v1/models", guarded([this](const httplib::Request& req, httplib::Response& res) {
          check_auth(req);
          const json model = {
              {"id", options.served_model_name},
              {"object", "model"},
              {"created", static_cast<int64_t>(std::time(nullptr))},
              {"owned_by", "quantmla"},
              {"max_model_len", options.max_model_len > 0
                                    ? options.max_model_len
                                    : engine.runner().config().max_position_embeddings}};
          res.set_content(json{{"object", "list"}, {"data", {model}}}.dump(), "application/json");
        }));
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics(), "text/plain; version=0.0.4");
    });
    http.Post("/v1/completions",
              guarded([this](const httplib::Request& req, httplib::Response& res) {
                serve(req, res, false);
              }));
    http.Post("/v1/chat/completions",
              guarded([this](const httplib::Request& req, httplib::Response& res) {
                serve(req, res, true);
              }));
    // Unknown routes, bodies over the limit, and anything else httplib answers by itself get an
    // OpenAI error object too.
    // One line for each request answered with an error before it reached the engine; those that
    // reached it are logged when they end (record).
    http.set_logger([](const httplib::Request& req, const httplib::Response& res) {
      const std::string message = std::exchange(answered_error, std::string());
      if (res.status < 400 || res.has_header("X-Request-Id")) return;
      std::fprintf(stderr, "request -: status %d, %s %s: %s\n", res.status, req.method.c_str(),
                   req.path.c_str(), message.c_str());
    });
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      const std::string message = res.status == 404   ? "no route " + req.method + " " + req.path
                                  : res.status == 413 ? "the request body is too large"
                                                      : "HTTP error " + std::to_string(res.status);
      send_error(res, {res.status, message,
                       res.status == 404 ? "NotFoundError" : "invalid_request_error", ""});
    });
    http.set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
          std::string message = "internal error";
          try {
            std::rethrow_exception(ep);
          } catch (const std::exception& e) {
            message = e.what();
          } catch (...) {
          }
          send_error(res, {500, message, "server_error", ""});
        });
  }
};

OpenAiServer::OpenAiServer(ServingEngine& engine, const Tokenizer& tokenizer,
                           std::optional<ChatTemplate> chat_template, std::string bos_token,
                           std::string eos_token, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, tokenizer, std::move(chat_template),
                                   std::move(bos_token), std::move(eos_token),
                                   std::move(options))) {}

OpenAiServer::~OpenAiServer() = default;

bool OpenAiServer::listen() {
  Impl& s = *impl_;
  // Debian's libcpp-httplib listens with a backlog of 5: a burst of clients connecting at once
  // (a benchmark's 256) overflows it, and the dropped handshakes come back seconds later or fail.
  // The socket is kept here and listened on again with the system's limit after binding.
  int listening = -1;
  // Responses and stream events go out as written, not held for the previous segment's ACK.
  s.http.set_tcp_nodelay(true);
  s.http.set_socket_options([&listening](socket_t sock) {
    httplib::default_socket_options(sock);
    if (listening < 0) listening = sock;
  });
  int port = s.options.port;
  if (port == 0) {
    port = s.http.bind_to_any_port(s.options.host);
    if (port < 0) return false;
  } else if (!s.http.bind_to_port(s.options.host, port)) {
    return false;
  }
  if (listening >= 0 && ::listen(listening, SOMAXCONN) != 0) {
    std::fprintf(stderr,
                 "serve: could not raise the listen backlog (%s); bursts of connections "
                 "may be refused\n",
                 std::strerror(errno));
  }
  s.bound_port = port;
  std::fprintf(stderr, "serve: listening on http://%s:%d (model %s)\n", s.options.host.c_str(),
               port, s.options.served_model_name.c_str());
  return s.http.listen_after_bind();
}

void OpenAiServer::stop(std::chrono::milliseconds grace) {
  Impl& s = *impl_;
  {
    std::unique_lock lock(s.streams_mutex);
    s.streams_ended.wait_for(lock, grace, [&s] { return s.open_streams == 0; });
  }
  s.http.stop();
}

int OpenAiServer::bound_port() const { return impl_->bound_port; }

}  // namespace quantmla::cli
