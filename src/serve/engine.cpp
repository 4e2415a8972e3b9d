// ServingEngine: one thread steps the scheduler; submissions and cancellations go through an
// inbox that the thread empties between steps, so they never wait for one.
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
  publish();
  thread_ = std::thread([this] { loop(); });
}

ServingEngine::~ServingEngine() { shutdown(std::chrono::milliseconds(0)); }

RequestId ServingEngine::submit(Request request, RequestCallbacks callbacks) {
  scheduler_.validate(request);  // config and pool size only: safe beside a step
  std::lock_guard lock(inbox_mutex_);
  if (!accepting_) throw QueueFull("the server is shutting down");
  const int64_t waiting = queued_ + static_cast<int64_t>(inbox_.size());
  if (waiting >= max_waiting_) {
    throw QueueFull(std::to_string(waiting) + " requests are waiting already");
  }
  const RequestId id = next_id_++;
  inbox_.push_back({id, std::move(request), std::move(callbacks)});
  wake_.notify_all();
  return id;
}

void ServingEngine::cancel(RequestId id) {
  std::lock_guard lock(inbox_mutex_);
  cancels_.push_back(id);
  wake_.notify_all();
}

EngineSnapshot ServingEngine::snapshot() const {
  EngineSnapshot s;
  {
    std::lock_guard lock(snapshot_mutex_);
    s = published_;
  }
  std::lock_guard inbox(inbox_mutex_);
  s.waiting += static_cast<int64_t>(inbox_.size());
  return s;
}

void ServingEngine::publish() {
  EngineSnapshot s;
  s.running = scheduler_.num_running();
  s.waiting = scheduler_.num_waiting();
  s.used_pages = pool_.used_pages();
  s.total_pages = pool_.num_pages();
  s.swap_used_bytes = scheduler_.swap_used_bytes();
  s.swap_space_bytes = scheduler_.options().swap_space_bytes;
  s.stats = scheduler_.stats();
  s.prompt_tokens_total = prompt_tokens_total_;
  s.generation_tokens_total = generation_tokens_total_;
  s.finished_total = finished_total_;
  std::lock_guard lock(snapshot_mutex_);
  published_ = s;
}

void ServingEngine::admit(std::vector<Arrival>& arrivals, std::vector<RequestId>& cancels) {
  for (Arrival& a : arrivals) {
    prompt_tokens_total_ += static_cast<int64_t>(a.request.prompt.size());
    scheduler_.add(std::move(a.request), a.id);  // validated in submit
    callbacks_[a.id] = std::move(a.callbacks);
  }
  for (const RequestId id : cancels) scheduler_.cancel(id);
  arrivals.clear();
  cancels.clear();
}

void ServingEngine::loop() {
  std::vector<Arrival> arrivals;
  std::vector<RequestId> cancels;
  for (;;) {
    bool stopping = false;
    {
      std::unique_lock inbox(inbox_mutex_);
      wake_.wait(inbox,
                 [&] { return stopping_ || has_work_ || !inbox_.empty() || !cancels_.empty(); });
      arrivals.swap(inbox_);
      cancels.swap(cancels_);
      if (!arrivals.empty()) has_work_ = true;  // shutdown() must not see an idle engine now
      stopping = stopping_;
    }
    std::vector<std::pair<RequestCallbacks*, StepReport::Generated>> tokens;
    std::vector<FinishedRequest> ended;
    {
      admit(arrivals, cancels);
      publish();
      if (stopping) {
        // Past the deadline: whatever is left ends as cancelled (reported by the steps below).
        for (const auto& [id, unused] : callbacks_) scheduler_.cancel(id);
        if (!scheduler_.has_work()) return;
      }
      StepReport report;
      bool stepped = scheduler_.has_work();
      if (stepped) {
        try {
          report = scheduler_.step();
        } catch (const std::exception& e) {
          // The step committed nothing; every request ends with an error rather than the server.
          std::fprintf(stderr, "engine: step failed: %s; cancelling %lld requests\n", e.what(),
                       static_cast<long long>(scheduler_.num_running() + scheduler_.num_waiting()));
          for (const auto& [id, unused] : callbacks_) {
            if (scheduler_.cancel(id)) failed_.insert(id);
          }
          stepped = false;
        }
      }
      {
        std::lock_guard inbox(inbox_mutex_);
        has_work_ = scheduler_.has_work();
        queued_ = scheduler_.num_waiting();
      }
      if (!stepped) {
        publish();
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
      ended = std::move(report.finished);
      publish();
    }
    // The callbacks: tokens first, then the ends (callbacks_ is this thread's alone, so the
    // pointers stay valid until then).
    for (auto& [callbacks, token] : tokens) {
      if (!callbacks->on_token) continue;
      try {
        callbacks->on_token(token);
      } catch (const std::exception& e) {
        // A client's handler failed: that request ends (with an error), the server goes on.
        std::fprintf(stderr, "engine: request %lld: %s; cancelled\n",
                     static_cast<long long>(token.id), e.what());
        if (scheduler_.cancel(token.id)) failed_.insert(token.id);
      }
    }
    std::vector<std::pair<RequestCallbacks, FinishedRequest>> finished;
    for (FinishedRequest& f : ended) {
      const auto it = callbacks_.find(f.id);
      if (it == callbacks_.end()) continue;
      finished.emplace_back(std::move(it->second), std::move(f));
      callbacks_.erase(it);
    }
    for (auto& [callbacks, done] : finished) {
      if (!callbacks.on_finish) continue;
      try {
        callbacks.on_finish(done);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "engine: request %lld: %s while finishing\n",
                     static_cast<long long>(done.id), e.what());
      }
    }
  }
}

void ServingEngine::shutdown(std::chrono::milliseconds deadline) {
  {
    std::lock_guard inbox(inbox_mutex_);
    if (!thread_.joinable() || stopping_) return;
    accepting_ = false;
  }
  const auto until = std::chrono::steady_clock::now() + deadline;
  for (;;) {
    {
      std::lock_guard inbox(inbox_mutex_);
      if ((!has_work_ && inbox_.empty() && cancels_.empty()) ||
          std::chrono::steady_clock::now() >= until) {
        stopping_ = true;
        wake_.notify_all();
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  thread_.join();
}

}  // namespace quantmla
