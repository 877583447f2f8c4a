#include "server/forward_call.h"

#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "server/grpc_status.h"
#include "server/raw_call.h"

namespace attnserve::server {
namespace {

absl::Status NotAForwardRequest() {
  return absl::InvalidArgumentError(
      "the request body is not a valid attnserve.v1.ForwardRequest (malformed protobuf)");
}

}  // namespace

ForwardCall::ForwardCall(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                         grpc::ByteBuffer* response)
    : Job(Clock::now(), SteadyDeadline(*context)),
      request_bytes_(*request),
      response_bytes_(response) {}

absl::StatusOr<absl::string_view> ForwardCall::RequestedModel() {
  if (!ScanStringFields(&request_bytes_, {{v1::ForwardRequest::kModelFieldNumber, &model_}})) {
    return NotAForwardRequest();
  }
  return absl::string_view(model_);
}

absl::Status ForwardCall::Decode() {
  request_ = google::protobuf::Arena::CreateMessage<v1::ForwardRequest>(&arena_);
  grpc::ProtoBufferReader reader(&request_bytes_);
  if (!request_->ParseFromZeroCopyStream(&reader)) return NotAForwardRequest();
  return DecodeForwardRequest(*request_, &decoded_);
}

int64_t ForwardCall::ReplyBytes(const core::ForwardShapes& shapes) const {
  return ForwardReplyBytes(shapes);
}

absl::StatusOr<ForwardBuffers> ForwardCall::Buffers(const core::ForwardShapes& shapes) {
  response_ = google::protobuf::Arena::CreateMessage<v1::ForwardResponse>(&arena_);
  return PrepareForwardResponse(decoded_, shapes, response_);
}

void ForwardCall::Finish(const absl::Status& status) {
  grpc::Status answer = ToGrpcStatus(status);
  if (status.ok() && response_ != nullptr) {
    bool own_buffer = false;
    answer = grpc::SerializationTraits<v1::ForwardResponse>::Serialize(*response_,
                                                                      response_bytes_, &own_buffer);
  }
  // After this gRPC may call OnDone at any time, which deletes this call: touch nothing.
  reactor_.Finish(answer);
}

}  // namespace attnserve::server
