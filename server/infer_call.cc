#include "server/infer_call.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "server/forward_codec.h"
#include "server/grpc_status.h"
#include "server/raw_call.h"

namespace attnserve::server {
namespace {

absl::Status NotAnInferRequest() {
  return absl::InvalidArgumentError(
      "the request body is not a valid inference.ModelInferRequest (malformed protobuf)");
}

}  // namespace

InferCall::InferCall(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                     grpc::ByteBuffer* response)
    : Job(Clock::now(), SteadyDeadline(*context)),
      request_bytes_(*request),
      response_bytes_(response) {}

absl::StatusOr<absl::string_view> InferCall::RequestedModel() {
  using inference::ModelInferRequest;
  if (!ScanStringFields(&request_bytes_,
                        {{ModelInferRequest::kModelNameFieldNumber, &model_},
                         {ModelInferRequest::kModelVersionFieldNumber, &version_}})) {
    return NotAnInferRequest();
  }
  if (!version_.empty() && version_ != kInferModelVersion) {
    return absl::NotFoundError(absl::StrCat("model version '", version_.substr(0, 64),
                                            "' is not served; every model is version ",
                                            kInferModelVersion));
  }
  return absl::string_view(model_);
}

absl::Status InferCall::Decode() {
  request_ = google::protobuf::Arena::CreateMessage<inference::ModelInferRequest>(&arena_);
  grpc::ProtoBufferReader reader(&request_bytes_);
  if (!request_->ParseFromZeroCopyStream(&reader)) return NotAnInferRequest();
  return DecodeInferRequest(*request_, &decoded_);
}

int64_t InferCall::ReplyBytes(const core::ForwardShapes& shapes) const {
  // The id and names come back too; the tensors are ForwardResponse's.
  return ForwardReplyBytes(shapes) + static_cast<int64_t>(request_->id().size() + model_.size());
}

absl::StatusOr<ForwardBuffers> InferCall::Buffers(const core::ForwardShapes& shapes) {
  response_ = google::protobuf::Arena::CreateMessage<inference::ModelInferResponse>(&arena_);
  return PrepareInferResponse(*request_, &decoded_, shapes, response_);
}

void InferCall::Finish(const absl::Status& status) {
  grpc::Status answer = ToGrpcStatus(status);
  if (status.ok() && response_ != nullptr) {
    bool own_buffer = false;
    answer = grpc::SerializationTraits<inference::ModelInferResponse>::Serialize(
        *response_, response_bytes_, &own_buffer);
  }
  // After this gRPC may call OnDone at any time, which deletes this call: touch nothing.
  reactor_.Finish(answer);
}

}  // namespace attnserve::server
