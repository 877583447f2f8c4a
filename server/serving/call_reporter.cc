#include "server/serving/call_reporter.h"

#include <optional>
#include <string>

#include "core/layer_spec.h"
#include "server/observability/logging.h"

namespace attnserve::server {
namespace {

// What the operator must look at (overload, server faults) is a warning; a caller's mistake or
// a caller leaving is information.
LogLevel FailureLevel(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnimplemented:
      return LogLevel::kWarn;
    default:
      return LogLevel::kInfo;
  }
}

}  // namespace

CallReporter::CallReporter(Metrics* metrics)
    : disabled_(metrics == nullptr ? Metrics::Disabled() : nullptr),
      metrics_(metrics != nullptr ? metrics : disabled_.get()) {}

void CallReporter::Answer(Job& job, absl::string_view model, bool decoded,
                          const absl::Status& status, const RunInfo& run,
                          absl::string_view requested) {
  const double seconds = SecondsSince(job.arrival());
  const std::optional<core::AttentionKind> kind =
      decoded ? std::optional(job.args().kind) : std::nullopt;
  ModelMetrics& model_metrics = metrics_->ForModel(model);
  metrics_->CallAnswered(model_metrics, job.protocol(), kind, status.code(),
                         status.ok() ? job.args().input.total_length() : 0, seconds);
  if (run.batch_calls > 0) model_metrics.QueueWait(run.queue_seconds);
  if (status.ok()) {
    if (LogEnabled(LogLevel::kDebug)) {
      const core::ForwardArgs& args = job.args();
      Log(LogLevel::kDebug, "forward",
          {{"model", std::string(model)},
           {"version", job.has_version() ? job.version().version : int64_t{0}},
           {"kind", std::string(core::KindName(args.kind))},
           {"batch", args.input.batch()},
           {"tokens", args.input.total_length()},
           {"merged", run.batch_calls},
           {"queue_ms", run.queue_seconds * 1e3},
           {"compute_ms", run.compute_seconds * 1e3},
           {"ms", seconds * 1e3}});
    }
  } else if (LogEnabled(LogLevel::kDebug) || LogEnabled(FailureLevel(status.code()))) {
    const std::string code = absl::StatusCodeToString(status.code());
    failures_.Add(FailureLevel(status.code()), code, "forward failed",
                  {{"model", model.empty() ? Clipped(requested) : std::string(model)},
                   {"kind", kind ? std::string(core::KindName(*kind)) : std::string()},
                   {"code", code},
                   {"error", std::string(status.message())},
                   {"ms", seconds * 1e3}});
  }
  // The call held its version until now; the hold ends after the answer is sent (the job may
  // be gone inside Finish), so a retired version is freed only once no answer needs it.
  const VersionHandle held = job.TakeVersion();
  job.Finish(status);
}

void CallReporter::SessionMessageAnswered(absl::string_view model, const absl::Status& status) {
  metrics_->SessionMessageAnswered(metrics_->ForModel(model), status.code());
  if (status.ok() || !(LogEnabled(LogLevel::kDebug) || LogEnabled(FailureLevel(status.code())))) {
    return;
  }
  const std::string code = absl::StatusCodeToString(status.code());
  failures_.Add(
      FailureLevel(status.code()), "session " + code, "session message failed",
      {{"model", Clipped(model)}, {"code", code}, {"error", std::string(status.message())}});
}

}  // namespace attnserve::server
