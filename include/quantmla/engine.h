// The scheduler on a thread of its own: any thread submits requests and gets their tokens and
// their end through callbacks that run on the engine thread (keep them short: they delay the
// next step). Submitting never waits for a step.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "quantmla/error.h"
#include "quantmla/scheduler.h"

namespace quantmla {

struct RequestCallbacks {
  std::function<void(const StepReport::Generated&)> on_token;  // each token, in order
  std::function<void(const FinishedRequest&)> on_finish;       // once, last
};

// What /metrics reports.
struct EngineSnapshot {
  int64_t running = 0, waiting = 0;
  int64_t used_pages = 0, total_pages = 0;
  int64_t swap_used_bytes = 0, swap_space_bytes = 0;  // preempted requests' records on the host
  SchedulerStats stats;
  int64_t prompt_tokens_total = 0, generation_tokens_total = 0;
  int64_t finished_total = 0;
};

class ServingEngine {
 public:
  // `max_waiting`: submissions beyond this many waiting requests are refused (QueueFull).
  ServingEngine(Runner& runner, PagePool& pool, const SchedulerOptions& options,
                std::function<std::string(std::span<const int32_t>)> detokenize,
                int64_t max_waiting);
  ~ServingEngine();  // shutdown(0)
  ServingEngine(const ServingEngine&) = delete;
  ServingEngine& operator=(const ServingEngine&) = delete;

  struct QueueFull : Error {
    using Error::Error;
  };
  // Validates (Scheduler::validate's errors) and queues for the engine thread, or throws QueueFull
  // when max_waiting requests wait or shutdown began. The callbacks may run before submit
  // returns.
  RequestId submit(Request request, RequestCallbacks callbacks);
  // Cancels a waiting or running request; its on_finish follows (kCancelled) within a step.
  void cancel(RequestId id);
  // The state as of the engine's last step (plus the inbox): never waits for a running step.
  EngineSnapshot snapshot() const;
  // Stops taking requests, lets the queued and running ones finish for up to `deadline`, cancels
  // what is left, and stops the thread.
  void shutdown(std::chrono::milliseconds deadline);
  const Runner& runner() const { return runner_; }

 private:
  struct Arrival {
    RequestId id;
    Request request;
    RequestCallbacks callbacks;
  };
  void loop();
  // Moves the inbox into the scheduler (engine thread).
  void admit(std::vector<Arrival>& arrivals, std::vector<RequestId>& cancels);
  // Copies the scheduler's and the pool's state into published_ (engine thread).
  void publish();

  Runner& runner_;
  PagePool& pool_;
  int64_t max_waiting_;
  // Submissions and cancellations land in the inbox under inbox_mutex_, which is never held
  // across a step, so an HTTP thread never waits for the GPU; the engine thread moves them into
  // the scheduler between steps.
  mutable std::mutex inbox_mutex_;
  std::condition_variable wake_;
  std::vector<Arrival> inbox_;
  std::vector<RequestId> cancels_;
  RequestId next_id_ = 1;
  int64_t queued_ = 0;     // the scheduler's waiting requests after the last step
  bool has_work_ = false;  // the scheduler's, after the last step
  bool accepting_ = true, stopping_ = false;
  // What snapshot() returns, as of the last step: published by the engine thread between steps
  // under a lock of its own, so that /metrics never waits for a step (a thread waiting on a
  // lock held across steps could starve for a whole generation).
  mutable std::mutex snapshot_mutex_;
  EngineSnapshot published_;
  // Engine thread only (after construction).
  Scheduler scheduler_;
  int64_t prompt_tokens_total_ = 0, generation_tokens_total_ = 0, finished_total_ = 0;
  std::map<RequestId, RequestCallbacks> callbacks_;
  std::set<RequestId> failed_;  // cancelled because a step or a callback failed: kError
  std::thread thread_;
};

}  // namespace quantmla
