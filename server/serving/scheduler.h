#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/layer.h"
#include "server/serving/call_reporter.h"
#include "server/serving/compute_executor.h"
#include "server/serving/job.h"
#include "server/serving/run_cost.h"

namespace attnserve::server {

// How a model's queue admits and batches.
struct SchedulerOptions {
  int max_queue = 128;              // calls queued (or being decoded) before ResourceExhausted
  int64_t max_batch_tokens = 4096;  // tokens (input + context) a merged run aims at; 0: no merging
  // How long the oldest queued call may wait for others to merge with before its run starts,
  // unless max_batch_tokens are queued sooner (Triton's max_queue_delay_microseconds); 0: runs
  // start as soon as the executor is free, merging only the calls already waiting.
  std::chrono::microseconds max_queue_delay{0};
  // The queueing delay a model tolerates standing (CoDel's target): once every call that
  // started a run in the last 100 ms had waited longer, the model is overloaded and a call with
  // a deadline that would wait longer than this is refused at once. 0: off. Calls without a
  // deadline are bounded by max_queue alone.
  std::chrono::milliseconds queue_delay_target{200};
};

// One model's queue and batching policy, for every version of the model. It holds only live
// calls: a call whose caller leaves is answered and removed at once. When the compute executor
// gives this model its turn, the queued calls that ask for the same version, the same kind and
// no attention are merged into one packed ragged batch (one set of larger matmuls instead of many
// small ones), read in place from each call's request.
//
// Why one scheduler per model and not per (model, version): each call carries the version it
// was admitted with (Job::version(), a VersionHandle), so a swap changes nothing here: no queue
// is made, drained or torn down per swap, the queue bound and the learnt run cost stay the
// model's, and the executor's fair turns stay per model. The one rule a version adds is that a
// merged run holds calls of one version only (Mergeable).
class Scheduler final : public RunQueue {
 public:
  // `executor` and `reporter` outlive the scheduler; the scheduler registers with the executor.
  Scheduler(std::string model_name, SchedulerOptions options, ComputeExecutor* executor,
            CallReporter* reporter);
  // Drains (answers every queued call) and leaves the executor.
  ~Scheduler();

  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  const std::string& model_name() const { return model_name_; }

  // Holds a queue place for a call about to be decoded, so a full queue or a deadline that
  // the work already queued makes impossible is found before any work is spent on the call:
  // Unavailable once closed, ResourceExhausted when full or overloaded (past the target delay),
  // DeadlineExceeded when the work ahead outlasts `deadline`. The place is used by Submit or
  // given back by Release.
  absl::Status Reserve(Clock::time_point deadline = Clock::time_point::max());
  void Release();

  // Holds a place for a session's step that waits for the step before it (Session::Step), so
  // that --max-queue bounds the requests a model holds, sequences' included: Unavailable once
  // closed, ResourceExhausted when full. Given back by ReleaseWaitingStep when its turn comes
  // or it is taken back; a drain does not wait for it (the session's turns end it).
  absl::Status ReserveWaitingStep();
  void ReleaseWaitingStep();

  // Queues `job`, which holds a place from Reserve and has been decoded and validated; or,
  // now that its own size is known, refuses it (DeadlineExceeded) when it cannot finish before
  // its deadline, and the caller gives the place back. Never waits for other calls' compute;
  // a small call (kInlineCallFlops), alone, with no delay window and the executor idle, is
  // computed and answered on the calling thread before Submit returns
  // (ComputeExecutor::TryRunInline); so may be the calls found dead on the way.
  absl::Status Submit(Job* job);

  // Answers `job` (Cancelled or DeadlineExceeded) and frees its place, if it is still queued;
  // does nothing otherwise (it is running or answered).
  void Cancel(Job* job);

  // Refuses new calls from now on; calls still queued after `deadline` are answered Unavailable
  // instead of computed. Returns at once: Join waits. (An unloaded model is not closed: calls
  // find no ready version at admission, and those admitted before finish on theirs.)
  void Close(Clock::time_point deadline = Clock::time_point::max());

  // The model's queue bound changed (its config.json's max_queue).
  void SetMaxQueue(int max_queue);

  // Waits until every queued and running call is answered (after Close).
  void Join();

  // Close and Join.
  void Drain(Clock::time_point deadline = Clock::time_point::max()) {
    Close(deadline);
    Join();
  }

  // Calls queued or running.
  int pending() const;

  // The executor's side. When this model next has a run ready: a time <= now when it has one,
  // later while the delay window is open, max() when nothing is queued.
  Clock::time_point ReadyAt(Clock::time_point now) const override;

  // Takes the calls of the next run (possibly none), answering dead ones on the way, and runs
  // them: Layer::Forward on the calling thread, then every call is answered. On a caller's
  // thread (`on_caller`), one small call at most.
  void RunNext(Clock::time_point now, bool on_caller) noexcept override;

 private:
  // A queue place is free (calls queued, being decoded, and sessions' waiting steps under
  // --max-queue) and the scheduler open; mu_ held. A refusal is counted as shed.
  absl::Status PlaceLocked();
  // Submit's end, once `job` is queued: it is taken back if its caller left (`gone`), then run
  // on this thread or left to the compute thread. Nothing may throw from here back to the
  // admission, which would give back the job's place and answer it a second time.
  void Dispatch(Job* job, bool gone, bool run_inline) noexcept;
  struct Queued {
    Job* job;
    int64_t tokens;
    bool small;  // may run on a caller's thread (SmallEnoughToRunInline), judged once
  };
  // A call leaving the queue without compute, and its answer.
  struct Dropped {
    Job* job;
    absl::Status status;
  };

  // When the queued calls' run may start (the delay window); the queue is not empty.
  Clock::time_point RunStartLocked(Clock::time_point now) const;
  // Seconds until the work already queued and running is done, by the runs' measured cost.
  double WaitLocked(Clock::time_point now) const;
  // Whether a call of `tokens` that starts now ends after `deadline` (never before the first
  // run was measured).
  bool MissesLocked(Clock::time_point now, Clock::time_point deadline, int64_t tokens) const;
  // CoDel's state: overloaded while the calls starting runs all waited past the target.
  void TrackQueueDelayLocked(Clock::time_point now, double waited_seconds);
  // The next run's calls; `small_only` (a run on a caller's thread): one call, and only if it
  // is small enough for that.
  std::vector<Job*> TakeLocked(Clock::time_point now, bool small_only,
                               std::vector<Dropped>* dropped);
  // Whether a run of `tokens` holding `jobs` and `joining`, started now, ends after one of
  // their deadlines.
  bool RunMissesLocked(Clock::time_point now, const std::vector<Job*>& jobs, const Job* joining,
                       int64_t tokens) const;
  void Run(const std::vector<Job*>& jobs);
  void RunOne(Job* job, RunInfo run);
  void RunMerged(const std::vector<Job*>& jobs, RunInfo run);
  // A run is done: its cost is learnt, and compute spent on calls past their deadline counted.
  void RunDone(const std::vector<Job*>& jobs, const RunInfo& run);
  // Copies a merged run's rows of `job` (packed, from `rows`) into its reply, in its layout,
  // and checks them finite (core::CheckOutputFinite).
  absl::Status CopyRowsBack(Job* job, const float* rows, int64_t width);
  void Answer(Job* job, const absl::Status& status, const RunInfo& run = {});
  void Finished(int count);

  const std::string model_name_;
  SchedulerOptions options_;  // max_queue guarded by mu_
  ComputeExecutor* const executor_;
  CallReporter* const reporter_;
  ModelMetrics& metrics_;  // this model's queue depth, waits and compute runs

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;  // pending_ reached 0
  std::deque<Queued> queue_;         // guarded by mu_
  int64_t queued_tokens_ = 0;        // guarded by mu_
  int reserved_ = 0;                 // guarded by mu_: places held by calls being decoded
  int waiting_steps_ = 0;            // guarded by mu_: places held by sessions' waiting steps
  int running_ = 0;                  // guarded by mu_
  bool closed_ = false;              // guarded by mu_
  Clock::time_point drain_deadline_ = Clock::time_point::max();  // guarded by mu_
  RunCost cost_;                                                 // guarded by mu_
  bool computing_ = false;                                       // guarded by mu_
  Clock::time_point run_end_;  // guarded by mu_: when the run under way should end
  // CoDel (guarded by mu_): the least wait of the calls that started runs this interval.
  Clock::time_point interval_end_;
  double min_wait_seconds_ = 0;
  bool overloaded_ = false;
};

}  // namespace attnserve::server
