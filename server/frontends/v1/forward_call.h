#pragma once

#include <string>

#include "absl/status/status.h"
#include "attnserve/v1/attention.pb.h"
#include "server/frontends/raw_call.h"
#include "server/frontends/v1/forward_codec.h"

namespace attnserve::server {

// One attnserve.v1 Forward call: a RawCall whose body is a ForwardRequest, decoded by the v1
// codec.
class ForwardCall final : public RawCall<v1::ForwardRequest, v1::ForwardResponse> {
 public:
  ForwardCall(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
              grpc::ByteBuffer* response)
      : RawCall(context, request, response) {}

  absl::StatusOr<absl::string_view> RequestedModel() override;
  uint64_t RequestedVersion() const override { return version_; }
  absl::Status Decode() override;
  const core::ForwardArgs& args() const override { return decoded_.args; }
  int64_t ReplyBytes(const core::ForwardShapes& shapes) const override;
  absl::StatusOr<ForwardBuffers> Buffers(const core::ForwardShapes& shapes) override;

 private:
  std::string model_;
  uint64_t version_ = 0;
  DecodedForward decoded_;
};

}  // namespace attnserve::server
