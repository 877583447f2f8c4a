#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

namespace attnserve::server {

class Scheduler;

// The one thread that computes, for every model: Layer::Forward uses every core (oneDNN and the
// attention kernel through OpenMP), so two runs at once would only fight over them. Models take
// turns: after a run of one model, the next model with a run ready goes first. The thread sleeps
// while nothing is ready (no polling), waking when a call is queued or a delay window closes.
class ComputeExecutor {
 public:
  // `compute_threads`: OpenMP threads per run (0: OpenMP's default, every core).
  explicit ComputeExecutor(int compute_threads);
  // Stops the thread; every scheduler must have been removed (drained) first.
  ~ComputeExecutor();

  ComputeExecutor(const ComputeExecutor&) = delete;
  ComputeExecutor& operator=(const ComputeExecutor&) = delete;

  // Schedulers join and leave the rotation (they do so themselves when made and destroyed).
  void Add(Scheduler* scheduler);
  void Remove(Scheduler* scheduler);

  // A scheduler's queue changed (a call queued, taken back, or the queue closed).
  void Notify();

 private:
  void Loop();

  const int compute_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Scheduler*> schedulers_;  // guarded by mu_
  size_t next_ = 0;                     // guarded by mu_: who goes first next time
  bool changed_ = false;                // guarded by mu_
  bool stop_ = false;                   // guarded by mu_
  Scheduler* running_ = nullptr;        // guarded by mu_: Remove waits while it runs
  std::condition_variable idle_cv_;
  std::thread thread_;
};

}  // namespace attnserve::server
