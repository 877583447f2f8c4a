#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/job.h"

namespace attnserve::server {

// The one place every call's answer passes through, whether admission refused it or a scheduler
// computed it, for every frontend: the call is logged (and counted) the same way, then finished.
class CallReporter {
 public:
  virtual ~CallReporter() = default;

  // Answers `job` with `status`. `model` is the served model's name, or "" when the call named
  // none the server has (a client's text is never a label); `decoded` says whether job.args()
  // holds the call (false for calls refused before decoding).
  virtual void Answer(Job& job, absl::string_view model, bool decoded, const absl::Status& status,
              const RunInfo& run);
};

}  // namespace attnserve::server
