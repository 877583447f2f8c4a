#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/layer.h"
#include "server/serving/compute_executor.h"
#include "server/serving/scheduler.h"
#include "server/serving/session.h"

namespace attnserve::server {

class ModelMetrics;

// One model's decode steps, of all its sessions, run by the compute executor in turns with the
// model's Forward calls: each run takes the waiting steps (of one kind and version, each kind
// and version in turn) and computes them as one Layer::Decode (continuous batching: every
// session's new tokens in one matmul), a long step a chunk at a time so that it does not stall
// the others: up to `chunk_tokens` a sequence a run and, when other sessions are open and
// stepping, no more than such a chunk costs at position 0 (in cached keys read and projections);
// while short steps share the run, or ran within the last 100 ms (sessions generating, between
// two of their steps), no more than they cost together, or a floor's worth (so a run then takes
// about twice theirs alone when they are many, however long the prompt). A causal cross
// session's context is projected the same way: a run projects the context rows its queries see,
// topped up to a few dozen rows, all of the run's in one matmul.
class DecodeQueue final : public RunQueue {
 public:
  // `executor`, `metrics` and `calls` (the model's call queue, whose --max-queue places the
  // sessions' waiting steps hold; none in tests: no bound but each session's) outlive the queue;
  // it registers with the executor.
  DecodeQueue(std::string model_name, int64_t chunk_tokens, ComputeExecutor* executor,
              ModelMetrics* metrics, Scheduler* calls = nullptr);
  // Drains (refuses new steps, finishes queued ones) and leaves the executor.
  ~DecodeQueue();

  // Queues a checked and reserved step of `session`. `done` runs once, on the compute thread,
  // or before Submit returns when the step was small and the executor idle (run inline).
  void Submit(Session* session, StepArgs args, std::function<void(absl::Status)> done);

  // A place among the model's queued calls for a session's step that waits for the one before
  // it (Scheduler::ReserveWaitingStep), given back by ReleaseWaitingStep.
  absl::Status ReserveWaitingStep();
  void ReleaseWaitingStep();

  // Takes the session's queued step back and answers it `why`, the room it reserved given
  // back; a step whose chunk is running is answered so when that chunk ends, its chunks done
  // taken back (the session goes back to where the step began).
  void Cancel(Session* session, const absl::Status& why);

  // Refuses new steps from now on (Unavailable); queued steps still run until `deadline`,
  // after which what is left of them is answered Unavailable. Join waits for them.
  void Close(Clock::time_point deadline = Clock::time_point::max());
  void Join();
  bool closed() const;

  // The bytes the model's sessions' caches hold (attnserve_kv_cache_bytes).
  std::atomic<int64_t>& kv_bytes() { return kv_bytes_; }
  // The model's sessions open (each counts itself in and out).
  std::atomic<int64_t>& sessions() { return sessions_; }

  Clock::time_point ReadyAt(Clock::time_point now) const override;
  // On a caller's thread (`on_caller`), only steps the engine computes on one thread, as many
  // as stay under core::kSerialFlops in all.
  void RunNext(Clock::time_point now, bool on_caller) noexcept override;

 private:
  struct Pending {
    Session* session;
    StepArgs args;
    std::function<void(absl::Status)> done;
    std::vector<int64_t> done_tokens;  // per sequence: tokens already computed
    // The whole step's cost in the engine's FLOPs (Reads), judged when it is queued: under
    // core::kSerialFlops, the engine computes it on one thread, and it may run on a caller's.
    double flops = 0;
    bool running = false;
    bool answered = false;
    // Not OK: the step is answered this, with the chunk running, rather than run to its end
    // (its stream ended while the chunk ran).
    absl::Status stop;
  };
  // One run's share of `step`: the next chunk of each of its sequences, within `budget`
  // tokens and (when not null) `reads` cached keys read, at least one token while it lasts.
  // `sequence_of` gets the sequence of each entry added.
  void AddChunk(Pending& step, int64_t* budget, int64_t* reads,
                std::vector<core::DecodeSequence>* run, std::vector<size_t>* sequence_of) const;
  static bool Finished(const Pending& step);
  // A step of `session` answered without running whole, after `done_tokens` of each sequence
  // had run: the session goes back to where the step began (Session::Rewind).
  void GiveBack(Session& session, const std::vector<int64_t>& done_tokens);
  // After a run's (or a drain's) answers: the queue is idle again unless steps wait.
  void EndRun();
  // A step of a few tokens a sequence (generation), as against a prompt's prefill.
  static bool Short(const Pending& step);
  // The cost of the rest of `step` in cached keys read (its queries times the keys each sees,
  // plus their projections in the same unit), and that of `n` queries of sequence `b` of
  // `session` from its position.
  static int64_t Reads(const Pending& step);
  static int64_t Reads(const Session& session, size_t b, int64_t n);
  // Causal cross: the context rows `n` queries of sequence `b` of `session` see from its
  // position that are not projected yet.
  static int64_t ContextRowsToProject(const Session& session, size_t b, int64_t n);

  const std::string model_name_;
  const int64_t chunk_tokens_;
  ComputeExecutor* const executor_;
  ModelMetrics* const metrics_;
  Scheduler* const calls_;
  std::atomic<int64_t> kv_bytes_{0};
  std::atomic<int64_t> sessions_{0};
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  std::list<Pending> pending_;  // guarded by mu_ (a list: a running step stays put)
  bool closed_ = false;         // guarded by mu_
  Clock::time_point drain_deadline_ = Clock::time_point::max();  // guarded by mu_
  bool running_ = false;  // guarded by mu_; a run, until its steps are answered
  // The short steps' cost (Reads) in the latest run that had any, and when it ran. RunNext's
  // own (runs are one at a time).
  int64_t recent_short_reads_ = 0;
  Clock::time_point recent_short_at_;
  // A run's kind and version (its layer: only compared, never used).
  using Group = std::pair<core::AttentionKind, const core::Layer*>;
  // Runs so far, and the latest run of each group (RunNext's turns).
  uint64_t runs_ = 0;
  std::map<Group, uint64_t> group_runs_;
};

}  // namespace attnserve::server
