#pragma once

#include <string>

#include "absl/status/status.h"
#include "google/protobuf/arena.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "inference/grpc_service.pb.h"
#include "server/infer_codec.h"
#include "server/job.h"

namespace attnserve::server {

// One Open Inference Protocol ModelInfer call, the twin of ForwardCall: the request's bytes as
// gRPC received them (a raw method, so a body that is not a ModelInferRequest gets a clear
// INVALID_ARGUMENT), parsed onto an arena only once the call holds a queue place, answered
// through its own reactor, which takes the call out of its queue the moment the caller leaves.
// Made with `new`; deletes itself when gRPC is done with the call.
class InferCall final : public Job {
 public:
  InferCall(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
            grpc::ByteBuffer* response);

  // What gRPC's handler returns.
  grpc::ServerUnaryReactor* reactor() { return &reactor_; }

  absl::StatusOr<absl::string_view> RequestedModel() override;
  absl::Status Decode() override;
  const core::ForwardArgs& args() const override { return decoded_.args; }
  int64_t ReplyBytes(const core::ForwardShapes& shapes) const override;
  absl::StatusOr<ForwardBuffers> Buffers(const core::ForwardShapes& shapes) override;
  void Finish(const absl::Status& status) override;

 private:
  class Reactor final : public grpc::ServerUnaryReactor {
   public:
    explicit Reactor(InferCall* call) : call_(call) {}
    void OnCancel() override { call_->CallerGone(); }
    void OnDone() override { delete call_; }

   private:
    InferCall* const call_;
  };

  grpc::ByteBuffer request_bytes_;  // shares gRPC's slices, no copy
  grpc::ByteBuffer* const response_bytes_;
  Reactor reactor_{this};
  std::string model_, version_;
  google::protobuf::Arena arena_;
  inference::ModelInferRequest* request_ = nullptr;
  inference::ModelInferResponse* response_ = nullptr;
  DecodedInfer decoded_;
};

}  // namespace attnserve::server
