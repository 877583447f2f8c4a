#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

#include "server/serving/clock.h"

namespace attnserve::server {

// What the executor gives turns to: one model's queue of work (its Scheduler).
class RunQueue {
 public:
  virtual ~RunQueue() = default;

  // When this queue next has a run ready: a time <= now when it has one, later while it waits
  // (a delay window, a deadline to answer), max() when it has nothing.
  virtual Clock::time_point ReadyAt(Clock::time_point now) const = 0;

  // Takes and runs the next run (possibly none) on the calling thread: the executor's, or
  // (`on_caller`) the thread of a caller that queued work, through TryRunInline, which then
  // computes alone; a queue then takes only what is small enough for that (kInlineCallFlops),
  // leaving the rest ready for the executor's thread. Nothing escapes it: an exception ends the
  // process, on a caller's thread as on the executor's, never leaving the executor running.
  virtual void RunNext(Clock::time_point now, bool on_caller) noexcept = 0;
};

// What a queue computes on a caller's thread, in the engine's count of FLOPs. A decode step the
// engine would compute on one thread anyway (under core::kSerialFlops: Layer::Decode runs it
// serially) goes inline whole, with the short steps queued meanwhile that fit beside it. A
// Forward call goes inline only below this, a tenth of that: a lone 1-token call of a layer up
// to about 700 wide. Calls of 16 tokens computed on a caller's thread raised p99 at 8 callers
// (the calls arriving meanwhile waited for a thread that was computing and was also one of
// gRPC's pollers, instead of joining a run on the compute thread).
inline constexpr double kInlineCallFlops = 4e6;

// The one thread that computes, for every model: Layer::Forward uses every core (oneDNN and the
// attention kernel through OpenMP), so two runs at once would only fight over them. Models take
// turns: after a run of one model, the next model with a run ready goes first. The thread sleeps
// while nothing is ready (no polling), waking when a call is queued or a delay window closes.
// A run small enough for one core may go on its caller's thread instead (TryRunInline), never
// beside another run.
class ComputeExecutor {
 public:
  // `compute_threads`: OpenMP threads per run (0: OpenMP's default, every core).
  explicit ComputeExecutor(int compute_threads);
  // Stops the thread; every queue must have been removed (drained) first.
  ~ComputeExecutor();

  ComputeExecutor(const ComputeExecutor&) = delete;
  ComputeExecutor& operator=(const ComputeExecutor&) = delete;

  // Queues join and leave the rotation (they do so themselves when made and destroyed).
  void Add(RunQueue* queue);
  void Remove(RunQueue* queue);

  // A queue changed (a call queued, taken back, or the queue closed).
  void Notify();

  // Runs `queue`'s next run on the calling thread when the executor is idle and no other queue
  // has a run ready (true), saving the hand-off to the compute thread and back; else false, and
  // the caller Notifies. For work small enough to compute on one thread (a generation step, a
  // small call: kInlineCallFlops): the run uses this thread alone, and counts as the queue's
  // turn. What the run leaves in the queue (what it may not take on a caller's thread, what was
  // queued meanwhile) is the compute thread's, which is woken for it.
  bool TryRunInline(RunQueue* queue);

 private:
  void Loop();

  const int compute_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<RunQueue*> queues_;  // guarded by mu_
  size_t next_ = 0;                // guarded by mu_: who goes first next time
  bool changed_ = false;           // guarded by mu_
  bool stop_ = false;              // guarded by mu_
  RunQueue* running_ = nullptr;    // guarded by mu_: Remove waits while it runs (here or inline)
  bool inline_ = false;            // guarded by mu_: running_ runs on a TryRunInline caller
  bool notified_inline_ = false;   // guarded by mu_: the thread is to look again when it ends
  std::condition_variable idle_cv_;
  std::thread thread_;
};

}  // namespace attnserve::server
