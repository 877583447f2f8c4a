#include "server/call_reporter.h"

#include <string>

#include "core/layer_spec.h"
#include "server/logging.h"

namespace attnserve::server {

void CallReporter::Answer(Job& job, absl::string_view model, bool decoded,
                          const absl::Status& status, const RunInfo& run) {
  const double seconds = SecondsSince(job.arrival());
  if (status.ok()) {
    if (LogEnabled(LogLevel::kDebug)) {
      const core::ForwardArgs& args = job.args();
      Log(LogLevel::kDebug, "forward",
          {{"model", std::string(model)},
           {"kind", std::string(core::KindName(args.kind))},
           {"batch", args.input.batch()},
           {"tokens", args.input.total_length()},
           {"merged", run.batch_calls},
           {"queue_ms", run.queue_seconds * 1e3},
           {"compute_ms", run.compute_seconds * 1e3},
           {"ms", seconds * 1e3}});
    }
  } else if (LogEnabled(LogLevel::kWarn)) {
    Log(LogLevel::kWarn, "forward failed",
        {{"model", std::string(model)},
         {"kind", decoded ? std::string(core::KindName(job.args().kind)) : std::string()},
         {"code", absl::StatusCodeToString(status.code())},
         {"error", std::string(status.message())},
         {"ms", seconds * 1e3}});
  }
  job.Finish(status);
}

}  // namespace attnserve::server
