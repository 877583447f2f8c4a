#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "core/layer.h"
#include "server/forward_codec.h"

namespace attnserve::server {

// How a job's compute went, for its log line: zeros for a job answered without compute.
struct RunInfo {
  int batch_size = 0;       // calls that shared the compute run (dynamic batching)
  double compute_ms = 0.0;  // wall time of the run's Layer::Forward
};

// One accepted call waiting for compute. The scheduler calls Finish exactly once, from its
// worker thread (or from Submit when the call is refused), and destroys the job after it.
class Job {
 public:
  virtual ~Job() = default;

  // The call's decoded, validated arguments.
  virtual const core::ForwardArgs& args() const = 0;

  // Why the call must not be computed any more (deadline passed, cancelled), or OK.
  virtual absl::Status CheckAlive() const = 0;

  // Buffers for the results, sized from `shapes`, zero-filled; made only when compute starts
  // so queued calls hold no output memory.
  virtual ForwardBuffers Buffers(const core::ForwardShapes& shapes) = 0;

  // Answers the call.
  virtual void Finish(const absl::Status& status, const RunInfo& run) = 0;
};

// How a scheduler queues and batches.
struct SchedulerOptions {
  int max_queue = 128;              // queued jobs before Submit refuses with ResourceExhausted
  int64_t max_batch_tokens = 4096;  // tokens (input + context) one merged run may hold; 0: off
  int compute_threads = 0;          // OpenMP threads of the worker; 0: the default (every core)
};

// A model's queue and its worker thread, which runs Layer::Forward (oneDNN uses every core
// inside it) and answers the calls. Queued calls that ask for the same kind and no attention
// are merged into one packed ragged batch (dynamic batching): one set of larger matmuls
// instead of many small ones, at no added latency since only calls already waiting are taken.
class Scheduler {
 public:
  // `compute_mutex` is shared by every model's scheduler so that two Forward calls never
  // fight over the same cores.
  Scheduler(std::string model_name, std::shared_ptr<const core::Layer> layer,
            SchedulerOptions options, std::mutex* compute_mutex);
  ~Scheduler();

  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues `job`; when the queue is full (ResourceExhausted) or closed (Unavailable) the job is
  // finished with that status instead. Never blocks on compute.
  void Submit(std::unique_ptr<Job> job);

  // Refuses new jobs from now on; jobs still queued after `deadline` are answered Unavailable
  // instead of computed. Returns at once: Join waits for the worker.
  void Close(std::chrono::steady_clock::time_point deadline =
                 std::chrono::steady_clock::time_point::max());

  // Waits until every queued and running job is answered and the worker has stopped (after
  // Close).
  void Join();

  // Close and Join: refuses new jobs, lets every queued and running one finish.
  void Drain(std::chrono::steady_clock::time_point deadline =
                 std::chrono::steady_clock::time_point::max()) {
    Close(deadline);
    Join();
  }

  // Jobs accepted and not yet answered: queued or running.
  int pending() const { return pending_.load(); }

 private:
  void WorkerLoop();
  std::vector<std::unique_ptr<Job>> TakeBatchLocked();
  void RunBatch(std::vector<std::unique_ptr<Job>> jobs);
  // Both answer each job and reset its pointer, so a throw leaves only the unanswered ones.
  void RunOne(std::unique_ptr<Job>& job);
  void RunMerged(std::vector<std::unique_ptr<Job>>& jobs);

  const std::string model_name_;
  const std::shared_ptr<const core::Layer> layer_;
  const SchedulerOptions options_;
  std::mutex* const compute_mutex_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Job>> queue_;  // guarded by mu_
  bool closed_ = false;                     // guarded by mu_
  std::chrono::steady_clock::time_point drain_deadline_ =
      std::chrono::steady_clock::time_point::max();  // guarded by mu_
  std::atomic<int> pending_{0};
  std::thread worker_;
};

}  // namespace attnserve::server
