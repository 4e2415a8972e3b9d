// ServingEngine: one thread steps the scheduler; submissions and cancellations take the same lock
// (they wait for at most one step).
#include "quantmla/engine.h"

#include <cstdio>
#include <utility>
#include <vector>

#include "quantmla/error.h"

namespace quantmla {

ServingEngine::ServingEngine(Runner& runner, PagePool& pool, const SchedulerOptions& options,
                             std::function<std::string(std::span<const int32_t>)> detokenize,
                             int64_t max_waiting)
    : runner_(runner),
      pool_(pool),
      max_waiting_(max_waiting),
      scheduler_(runner, pool, options, std::move(detokenize)) {
  thread_ = std::thread([this] { loop(); });
}

ServingEngine::~ServingEngine() { shutdown(std::chrono::milliseconds(0)); }

RequestId ServingEngine::submit(Request request, RequestCallbacks callbacks) {
  std::lock_guard lock(mutex_);
  if (!accepting_) throw QueueFull("the server is shutting down");
  if (scheduler_.num_waiting() >= max_waiting_) {
    throw QueueFull(std::to_string(scheduler_.num_waiting()) + " requests are waiting already");
  }
  const int64_t prompt = static_cast<int64_t>(request.prompt.size());
  const RequestId id = scheduler_.add(std::move(request));
  prompt_tokens_total_ += prompt;
  callbacks_[id] = std::move(callbacks);
  wake_.notify_all();
  return id;
}

void ServingEngine::cancel(RequestId id) {
  std::lock_guard lock(mutex_);
  scheduler_.cancel(id);
  wake_.notify_all();
}

EngineSnapshot ServingEngine::snapshot() const {
  std::lock_guard lock(mutex_);
  EngineSnapshot s;
  s.running = scheduler_.num_running();
  s.waiting = scheduler_.num_waiting();
  s.used_pages = pool_.used_pages();
  s.total_pages = pool_.num_pages();
  s.stats = scheduler_.stats();
  s.prompt_tokens_total = prompt_tokens_total_;
  s.generation_tokens_total = generation_tokens_total_;
  s.finished_total = finished_total_;
  return s;
}

void ServingEngine::loop() {
  for (;;) {
    std::vector<std::pair<RequestCallbacks*, StepReport::Generated>> tokens;
    std::vector<std::pair<RequestCallbacks, FinishedRequest>> finished;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || scheduler_.has_work(); });
      if (stopping_ && !scheduler_.has_work()) return;
      StepReport report;
      try {
        report = scheduler_.step();
      } catch (const std::exception& e) {
        // The step committed nothing; every request ends with an error rather than the server.
        std::fprintf(stderr, "engine: step failed: %s; cancelling %lld requests\n", e.what(),
                     static_cast<long long>(scheduler_.num_running() + scheduler_.num_waiting()));
        for (const auto& [id, unused] : callbacks_) {
          if (scheduler_.cancel(id)) failed_.insert(id);
        }
        continue;
      }
      generation_tokens_total_ += static_cast<int64_t>(report.generated.size());
      for (StepReport::Generated& g : report.generated) {
        const auto it = callbacks_.find(g.id);
        if (it != callbacks_.end()) tokens.emplace_back(&it->second, std::move(g));
      }
      for (FinishedRequest& f : report.finished) {
        ++finished_total_;
        if (failed_.erase(f.id) > 0) f.reason = FinishReason::kError;
      }
      // Tokens first (their callbacks stay valid until the finished ones are taken out below,
      // after they ran), then the ends.
      lock.unlock();
      for (auto& [callbacks, token] : tokens) {
        if (callbacks->on_token) callbacks->on_token(token);
      }
      lock.lock();
      for (FinishedRequest& f : report.finished) {
        const auto it = callbacks_.find(f.id);
        if (it == callbacks_.end()) continue;
        finished.emplace_back(std::move(it->second), std::move(f));
        callbacks_.erase(it);
      }
    }
    for (auto& [callbacks, done] : finished) {
      if (callbacks.on_finish) callbacks.on_finish(done);
    }
  }
}

void ServingEngine::shutdown(std::chrono::milliseconds deadline) {
  {
    std::unique_lock lock(mutex_);
    if (!thread_.joinable()) return;
    accepting_ = false;
    const auto until = std::chrono::steady_clock::now() + deadline;
    while (scheduler_.has_work() && std::chrono::steady_clock::now() < until) {
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      lock.lock();
    }
    for (const auto& [id, unused] : callbacks_) scheduler_.cancel(id);
    stopping_ = true;
    wake_.notify_all();
  }
  thread_.join();
}

}  // namespace quantmla
