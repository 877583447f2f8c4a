#include "server/forward_call.h"

#include <utility>

#include "core/layer_spec.h"
#include "server/grpc_status.h"
#include "server/logging.h"

namespace attnserve::server {
namespace {

double MillisSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

ForwardCall::ForwardCall(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                         const v1::ForwardRequest* request, v1::ForwardResponse* response,
                         std::string model_name)
    : context_(context),
      reactor_(reactor),
      request_(request),
      response_(response),
      model_name_(std::move(model_name)),
      accepted_(std::chrono::steady_clock::now()) {}

absl::Status ForwardCall::Decode() { return DecodeForwardRequest(*request_, &decoded_); }

absl::Status ForwardCall::CheckAlive() const {
  // The deadline first: once it passes gRPC also marks the call cancelled, and the caller
  // wants to hear which of the two happened.
  if (context_->deadline() <= std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the deadline passed while the call was queued");
  }
  if (context_->IsCancelled()) {
    return absl::CancelledError("the call was cancelled while queued");
  }
  return absl::OkStatus();
}

ForwardBuffers ForwardCall::Buffers(const core::ForwardShapes& shapes) {
  return PrepareForwardResponse(decoded_, shapes, response_);
}

void ForwardCall::Finish(const absl::Status& status, const RunInfo& run) {
  const core::ForwardArgs& args = decoded_.args;
  const double ms = MillisSince(accepted_);
  if (status.ok()) {
    if (LogEnabled(LogLevel::kDebug)) {
      Log(LogLevel::kDebug, "forward",
          {{"model", model_name_},
           {"kind", std::string(core::KindName(args.kind))},
           {"batch", args.input.batch()},
           {"tokens", args.input.total_length()},
           {"merged", run.batch_size},
           {"compute_ms", run.compute_ms},
           {"ms", ms}});
    }
  } else {
    Log(LogLevel::kWarn, "forward failed",
        {{"model", model_name_},
         {"code", absl::StatusCodeToString(status.code())},
         {"error", std::string(status.message())},
         {"ms", ms}});
  }
  // After this the request and response belong to gRPC again: touch nothing.
  reactor_->Finish(ToGrpcStatus(status));
}

void FinishRefused(grpc::ServerUnaryReactor* reactor, const absl::Status& status,
                   const v1::ForwardRequest& request) {
  Log(LogLevel::kWarn, "forward refused",
      {{"model", Clipped(request.model())},
       {"code", absl::StatusCodeToString(status.code())},
       {"error", std::string(status.message())}});
  reactor->Finish(ToGrpcStatus(status));
}

}  // namespace attnserve::server
