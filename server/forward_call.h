#pragma once

#include <chrono>
#include <string>

#include "absl/status/status.h"
#include "attnserve/v1/attention.pb.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"
#include "server/forward_codec.h"
#include "server/scheduler.h"

namespace attnserve::server {

// One Forward call on its way through a scheduler: the gRPC side of a Job. It points into the
// request and response that gRPC owns until Finish, and answers through the reactor.
class ForwardCall final : public Job {
 public:
  ForwardCall(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
              const v1::ForwardRequest* request, v1::ForwardResponse* response,
              std::string model_name);

  // Decodes the request in place; InvalidArgument for a malformed one.
  absl::Status Decode();

  const core::ForwardArgs& args() const override { return decoded_.args; }
  absl::Status CheckAlive() const override;
  ForwardBuffers Buffers(const core::ForwardShapes& shapes) override;
  void Finish(const absl::Status& status, const RunInfo& run) override;

 private:
  grpc::CallbackServerContext* const context_;
  grpc::ServerUnaryReactor* const reactor_;
  const v1::ForwardRequest* const request_;
  v1::ForwardResponse* const response_;
  const std::string model_name_;
  const std::chrono::steady_clock::time_point accepted_;
  DecodedForward decoded_;
};

// Answers a call that never reached a scheduler, logging the failure like any other.
void FinishRefused(grpc::ServerUnaryReactor* reactor, const absl::Status& status,
                   const v1::ForwardRequest& request);

}  // namespace attnserve::server
