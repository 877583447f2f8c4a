#pragma once

#include <atomic>
#include <cstdint>

#include "server/serving/call_reporter.h"
#include "server/serving/job.h"
#include "server/serving/model_registry.h"
#include "server/serving/session.h"

namespace attnserve::server {

// What a frontend answers while the server drains (Admission::accepting() is false): the client
// goes on elsewhere.
inline absl::Status ShuttingDown() { return absl::UnavailableError("the server is shutting down"); }

// The one way into compute, for every frontend. It decides, in this order, each in one place:
// shutting down? which model? deadline already passed? room in its queue, and time before the
// deadline for the work already queued (the scheduler's measured cost)? — all before the call's
// tensors are decoded, so refusals cost next to nothing — then decode (the frontend's codec),
// validate once against the layer (shapes, lengths, kind, finiteness), check the reply fits the
// message limit, and queue unless the call's own run would end past its deadline. Every job handed
// in is answered exactly once: here when refused, by the scheduler otherwise.
class Admission {
 public:
  // `registry`, `reporter` and `sessions` outlive this; replies over `max_reply_bytes` are
  // refused.
  Admission(ModelRegistry* registry, CallReporter* reporter, SessionManager* sessions,
            int64_t max_reply_bytes);

  // Takes `job` from a frontend. Never throws and never waits for a run on the compute thread
  // (a small call may be computed on this thread, one call at most: Scheduler::Submit).
  void Admit(Job* job);

  // Opens a decode session of `batch` sequences on the model named `model` ("" for the only
  // one) at `version` (0: its newest ready one), which the session holds for its life:
  // Unavailable when shutting down, NotFound for the model or version, then
  // SessionManager::Open's refusals (`restart`: see there). `context` (kCausalCross) is copied.
  absl::StatusOr<std::unique_ptr<Session>> OpenSession(absl::string_view model, uint64_t version,
                                                       core::AttentionKind kind, int64_t batch,
                                                       const core::RaggedBatch* context,
                                                       bool restart = false);

  // A message of a decode session was answered with `status` (every frontend's session
  // messages, refused and malformed ones too, are counted here). `model` is the session's model,
  // or the name the message gave when no session holds it (any name not served counts as "").
  void SessionMessageAnswered(absl::string_view model, const absl::Status& status) {
    reporter_->SessionMessageAnswered(model, status);
  }

  // Whether a reply of `bytes` fits the message limit (--max-message-mib): the one check of it,
  // for calls and for sessions' messages. ResourceExhausted, marked too large, if not.
  absl::Status CheckReplyBytes(int64_t bytes) const;

  // From now on calls are answered Unavailable (shutdown has begun).
  void StopAccepting() { accepting_.store(false); }
  bool accepting() const { return accepting_.load(); }

  ModelRegistry& registry() const { return *registry_; }

 private:
  // Decode, validate (against the job's version), size check and submit for a call holding a
  // queue place in `model`.
  absl::Status Queue(Job* job, ServedModel& model);

  ModelRegistry* const registry_;
  CallReporter* const reporter_;
  SessionManager* const sessions_;
  const int64_t max_reply_bytes_;
  std::atomic<bool> accepting_{true};
};

}  // namespace attnserve::server
