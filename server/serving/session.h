#pragma once

// Decode sessions: a stream of steps that append tokens to B sequences whose keys and values
// the server keeps (core::KvSequence), each step answered with the new tokens' outputs. The
// transport-neutral half: a frontend opens a Session through Admission, hands it each step, and
// destroys it when its stream ends, which frees its cache at once.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/kv_cache.h"
#include "core/layer.h"
#include "server/serving/model_version.h"

namespace attnserve::server {

class DecodeQueue;
class ModelMetrics;

// The limits of decode sessions, for the whole process.
struct SessionOptions {
  int64_t kv_cache_bytes = int64_t{1} << 30;  // every cache together (--kv-cache-mib)
  int max_sessions = 256;                     // sessions open at once (--max-sessions)
  int64_t max_session_tokens = 32768;         // tokens one sequence may hold
  // Cache storage; unset: the model's precision (f32 caches f32, bf16 caches bf16).
  std::optional<core::KvPrecision> precision;
  // A step's tokens run in chunks of at most this many per compute run, so a long prompt does
  // not stall the other sessions' steps (chunked prefill).
  int64_t chunk_tokens = 256;
};

// One step as a frontend hands it over: per sequence b, `tokens[b]` new rows at `inputs[b]`
// ([tokens, d_model], row-major) and room for their outputs at `outputs[b]`
// ([tokens, d_output]).
struct StepArgs {
  std::vector<const float*> inputs;
  std::vector<int64_t> tokens;
  std::vector<float*> outputs;
  std::optional<int64_t> truncate_to;  // drop cached positions >= this first
  // The sequence's last step (sequence_end): once it is taken, the steps after it are refused
  // (NotFound: the sequence has ended), unless it fails.
  bool ends_sequence = false;
};

// The step of a batch's sequences: each reads its rows of `input` (padded or packed, not
// segmented) and writes its outputs to the same rows of `output` (`output_width` wide).
StepArgs MakeStepArgs(const core::RaggedBatch& input, std::span<float> output,
                      int64_t output_width);

class SessionManager;

// One decode session: a model (held as long as the session lives), a causal kind, B sequences.
// Its steps run one at a time, in the order they were handed over: a step handed over while
// another is queued or running waits for its answer (a client may send a sequence's requests
// without waiting for the answers, as Triton's sequence batcher allows).
class Session {
 public:
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& model() const { return version_->name; }
  // The version it was opened on, held (weights and all) as long as the session lives: its
  // cached keys were made by these weights.
  const VersionHandle& version() const { return version_; }
  const std::shared_ptr<const core::Layer>& layer() const { return version_->layer; }
  core::AttentionKind kind() const { return kind_; }
  int64_t batch() const { return static_cast<int64_t>(positions_.size()); }
  // Each sequence's cached length (query tokens so far).
  std::vector<int64_t> positions() const;

  // Checks `args` against the session and its limits and reserves cache room for it: a refused
  // step (InvalidArgument, ResourceExhausted naming the limit) changes nothing and `done` is not
  // called. Otherwise the step is queued for the model's compute and `done` runs once with its
  // answer, on the compute thread, or before Step returns when it ran inline on this thread
  // (DecodeQueue::Submit); positions() then include it.
  // While another step of the session is queued or running, the step waits its turn and Step
  // returns OK: it is checked when its turn comes, and `done` then gets its answer or refusal.
  // Past 64 steps waiting, or when the model's --max-queue places are taken (each waiting step
  // holds one), ResourceExhausted; Unavailable once the server drains. `ticket`
  // (NewStepTicket) names the step for Withdraw.
  absl::Status Step(StepArgs args, std::function<void(absl::Status)> done, uint64_t ticket = 0);

  // Takes back the step handed over with `ticket` if it still waits for its turn (its caller
  // left): `done` runs at once, on this thread, with `why`, and the session is unchanged. A
  // step taken runs and is answered as usual. Safe from any thread.
  void Withdraw(uint64_t ticket, const absl::Status& why);

  // A ticket no other step of the process has.
  static uint64_t NewStepTicket();

  // Takes a queued step back (its stream ended): `done` runs at once with `why`. A step whose
  // chunk is running is answered `why` when that chunk ends, the rest of it not run and its
  // chunks done taken back. Safe from any thread.
  void CancelStep(const absl::Status& why);

  // The sequence this session served started over on another session (sequence_start on its
  // id): a step taken runs on, the steps waiting for their turn and any after are NotFound.
  void Replaced();

 private:
  friend class SessionManager;
  friend class DecodeQueue;

  Session(SessionManager* manager, VersionHandle version, core::AttentionKind kind,
          DecodeQueue* queue, ModelMetrics* metrics);
  // Reserves room in every sequence for `lengths`; ResourceExhausted (and nothing kept) when the
  // budget cannot take it.
  absl::Status ReserveAll(const std::vector<int64_t>& lengths);
  // Checks the step whose turn it is (busy_ set) against the session and its limits, and
  // reserves its room; mu_ held. A refusal changes nothing.
  absl::Status Take(const StepArgs& args);
  // Queues a taken step for the model's compute; mu_ not held. Its answer passes the turn on.
  void Run(StepArgs args, std::function<void(absl::Status)> done);
  // Frees each sequence's context rows (and their charge) once they are all projected; mu_ held.
  void DropProjectedContext();
  // A step that computed `done_tokens` of each sequence is answered without them (refused, or
  // cut short): each sequence goes back to where the step began, and the blocks that position
  // does not need go back to the pool; mu_ held.
  void Rewind(const std::vector<int64_t>& done_tokens);
  // A step is answered: the next waiting one that is taken begins (the refused are answered
  // so), else the session is idle again. Before the step's own answer, which may end the
  // session.
  void NextTurn();

  struct Waiting {
    StepArgs args;
    std::function<void(absl::Status)> done;
    uint64_t ticket;
  };

  SessionManager* const manager_;
  // Guards the sequences' state below between the frontend's thread (Step) and the compute
  // thread (the step's run): they never use it at once, the lock orders what each sees.
  mutable std::mutex mu_;
  const VersionHandle version_;
  const core::AttentionKind kind_;
  DecodeQueue* const queue_;
  ModelMetrics* const metrics_;
  std::vector<int64_t> positions_;
  // Charged to the budget (and the model's cache bytes) beside the caches' blocks: the
  // sequences' bookkeeping, and the context rows still held.
  int64_t charged_bytes_ = 0;
  std::vector<std::unique_ptr<core::KvSequence>> caches_;    // kCausal: keys, values so far
  std::vector<std::unique_ptr<core::KvSequence>> contexts_;  // kCausalCross: the context's
  // kCausalCross: each sequence's context length, and its rows ([length, d_context]) until they
  // are all projected (contexts_[b]->length() rows so far: runs project those their queries
  // see, and more while they are light), charged meanwhile (in charged_bytes_).
  std::vector<int64_t> context_lengths_;
  std::vector<std::vector<float>> context_rows_;
  // A step is queued or running; the steps handed over meanwhile, in order.
  bool busy_ = false;
  std::deque<Waiting> waiting_;
  bool ending_ = false;    // a step that ends the sequence was taken
  bool replaced_ = false;  // the sequence started over on another session (Replaced)
};

// Opens sessions within the process's limits: the KV cache budget and the session count.
class SessionManager {
 public:
  explicit SessionManager(SessionOptions options);

  const SessionOptions& options() const { return options_; }
  const core::KvCacheBudget& budget() const { return budget_; }
  core::KvCacheBudget& budget() { return budget_; }  // (its pool's idle slabs: the server's)

  // A session of `batch` sequences on `version` (its steps run by `queue`). For
  // kCausalCross, `context` (width d_context, one sequence per b) is copied (its rows charged to
  // the budget until they are projected) and projected once, by the runs whose queries reach
  // it. InvalidArgument for another kind or a layer that cannot serve it;
  // ResourceExhausted when --max-sessions are open. A `restart` (a sequence_start on an id that
  // has a session, which ends when this one's first step is taken) may open one session past
  // the limit: restarting a sequence is not refused because every session is open.
  absl::StatusOr<std::unique_ptr<Session>> Open(VersionHandle version, core::AttentionKind kind,
                                                int64_t batch, const core::RaggedBatch* context,
                                                DecodeQueue* queue, ModelMetrics* metrics,
                                                bool restart = false);

  // Sessions open now.
  int open() const { return open_.load(); }

 private:
  friend class Session;

  const SessionOptions options_;
  core::KvCacheBudget budget_;
  std::atomic<int> open_{0};
};

}  // namespace attnserve::server
