#pragma once

// One Forward call as admission and the schedulers see it, whatever protocol it came in on. A
// frontend (attnserve.v1, the Open Inference Protocol over gRPC or REST) implements Job for its
// wire format;
// everything after decoding is the same for every frontend.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layer.h"
#include "server/observability/call_protocol.h"
#include "server/serving/clock.h"
#include "server/serving/model_version.h"

namespace attnserve::server {

// Where Layer::Forward writes a call's results: inside its reply's own tensors.
struct ForwardBuffers {
  std::span<float> output;
  std::span<float> attention;
};

// What a call's compute run was like, for its metrics and log line; zeros for a call answered
// without compute.
struct RunInfo {
  int batch_calls = 0;           // calls that shared the run (dynamic batching)
  int64_t batch_tokens = 0;      // tokens (input + context) of the run
  double queue_seconds = 0.0;    // from arrival to the start of the run
  double compute_seconds = 0.0;  // the run's Layer::Forward
};

class Scheduler;

// One accepted call on its way to an answer. Admission answers it or hands it to a scheduler,
// which answers it: Finish is called exactly once, and the job may be gone after it. A job in a
// queue is not owned by the queue; the frontend keeps it alive until Finish.
class Job {
 public:
  virtual ~Job() = default;
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // The model the caller named ("" for the only one), as sent: it may be anything. Read before
  // the rest of the call; an error when the call cannot be read even that far.
  virtual absl::StatusOr<absl::string_view> RequestedModel() = 0;

  // The version the caller named (read with RequestedModel); 0 for the newest ready one.
  virtual uint64_t RequestedVersion() const { return 0; }

  // The transport the call came in on (its metrics' protocol label).
  virtual CallProtocol protocol() const { return CallProtocol::kGrpc; }

  // The model version the call was admitted with: admission sets it, and the call holds it (its
  // weights stay loaded) until it is answered, whatever swaps happen meanwhile.
  const ModelVersion& version() const { return *version_; }
  void set_version(VersionHandle version) { version_ = std::move(version); }
  bool has_version() const { return version_ != nullptr; }
  // Hands the hold over to whoever answers the call, which lets go once the answer is sent.
  VersionHandle TakeVersion() { return std::move(version_); }

  // Decodes the protocol's tensors into args(), in place where the bytes allow. Only the
  // encoding is checked here (InvalidArgument naming the tensor); shapes against the layer and
  // finiteness are the layer's Validate, run once by admission.
  virtual absl::Status Decode() = 0;

  // The decoded call (valid after Decode).
  virtual const core::ForwardArgs& args() const = 0;

  // Bytes the reply takes on the wire for these shapes, to hold it to the message limit.
  virtual int64_t ReplyBytes(const core::ForwardShapes& shapes) const = 0;

  // Sizes the reply's tensors (zero-filled) and returns where Forward writes; made only when
  // compute starts, so queued calls hold no reply memory. An error when the reply cannot hold
  // them.
  virtual absl::StatusOr<ForwardBuffers> Buffers(const core::ForwardShapes& shapes) = 0;

  // Sends the answer. Called once; the job may be destroyed from inside it.
  virtual void Finish(const absl::Status& status) = 0;

  // When the call arrived, and when its caller stops waiting (max() for no deadline).
  Clock::time_point arrival() const { return arrival_; }
  Clock::time_point deadline() const { return deadline_; }

  // The frontend says its caller left (cancelled, or the deadline passed): a queued job is
  // answered at once, without compute, and frees its queue place. Safe from any thread, at any
  // time before Finish.
  void CallerGone();

  // OK while the caller still waits; otherwise DeadlineExceeded or Cancelled.
  absl::Status CheckAlive(Clock::time_point now = Clock::now()) const;

 protected:
  Job(Clock::time_point arrival, Clock::time_point deadline)
      : arrival_(arrival), deadline_(deadline) {}

 private:
  friend class Scheduler;  // sets queue_ while the job is queued

  const Clock::time_point arrival_;
  const Clock::time_point deadline_;
  std::atomic<bool> gone_{false};
  std::atomic<Scheduler*> queue_{nullptr};
  VersionHandle version_;
};

}  // namespace attnserve::server
