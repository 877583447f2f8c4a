#pragma once

#include <string>

#include "absl/status/status.h"
#include "inference/grpc_service.pb.h"
#include "server/frontends/oip/infer_codec.h"
#include "server/frontends/raw_call.h"

namespace attnserve::server {

// One Open Inference Protocol ModelInfer call: a RawCall whose body is a ModelInferRequest,
// decoded by the protocol's codec (infer_codec).
class InferCall final
    : public RawCall<inference::ModelInferRequest, inference::ModelInferResponse> {
 public:
  InferCall(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
            grpc::ByteBuffer* response)
      : RawCall(context, request, response) {}

  absl::StatusOr<absl::string_view> RequestedModel() override;
  uint64_t RequestedVersion() const override { return version_number_; }
  absl::Status Decode() override;
  const core::ForwardArgs& args() const override { return decoded_.args; }
  int64_t ReplyBytes(const core::ForwardShapes& shapes) const override;
  absl::StatusOr<ForwardBuffers> Buffers(const core::ForwardShapes& shapes) override;

 private:
  std::string model_, version_;
  uint64_t version_number_ = 0;
  DecodedInfer decoded_;
};

}  // namespace attnserve::server
