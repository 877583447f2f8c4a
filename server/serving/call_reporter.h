#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/observability/log_summary.h"
#include "server/observability/metrics.h"
#include "server/serving/job.h"

namespace attnserve::server {

// The one place every call's answer passes through, whether admission refused it or a scheduler
// computed it, for every frontend: the call is logged (and counted) the same way, then finished.
class CallReporter {
 public:
  // Records into `metrics`, which outlives the reporter; null records nothing.
  explicit CallReporter(Metrics* metrics = nullptr);
  virtual ~CallReporter() = default;

  // Where the schedulers record their queues and compute runs.
  Metrics& metrics() { return *metrics_; }

  // A call arrived (any frontend): it is in flight until answered.
  void Arrived() { metrics_->CallArrived(); }

  // Answers `job` with `status`. `model` is the served model's name, or "" when the call named
  // none the server has (a client's text is never a label); then `requested`, the name it sent,
  // is what its log line names (clipped). `decoded` says whether job.args() holds the call (false
  // for calls refused before decoding).
  virtual void Answer(Job& job, absl::string_view model, bool decoded, const absl::Status& status,
                      const RunInfo& run, absl::string_view requested = {});

  // A decode session's message answered (any frontend): counted, and a refused or failed one
  // logged as failed calls are, under its own code's summary ("session RESOURCE_EXHAUSTED").
  void SessionMessageAnswered(absl::string_view model, const absl::Status& status);

  // Writes the failure counts not yet logged (at shutdown).
  void FlushLog() { failures_.Flush(); }

 private:
  std::unique_ptr<Metrics> disabled_;  // when no metrics were given
  Metrics* const metrics_;
  // Failed calls and session messages: one line per status code per 10 s at most (each at
  // debug).
  LogSummarizer failures_;
};

}  // namespace attnserve::server
