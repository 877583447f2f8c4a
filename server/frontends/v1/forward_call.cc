#include "server/frontends/v1/forward_call.h"

#include "server/frontends/tensor_codec.h"

namespace attnserve::server {
absl::StatusOr<absl::string_view> ForwardCall::RequestedModel() {
  if (!ScanStringFields(&request_bytes_, {{v1::ForwardRequest::kModelFieldNumber, &model_}},
                        {{v1::ForwardRequest::kVersionFieldNumber, &version_}})) {
    return Malformed();
  }
  return absl::string_view(model_);
}

absl::Status ForwardCall::Decode() {
  if (!Parse()) return Malformed();
  return DecodeForwardRequest(*request_, &decoded_);
}

int64_t ForwardCall::ReplyBytes(const core::ForwardShapes& shapes) const {
  return ForwardReplyBytes(shapes);
}

absl::StatusOr<ForwardBuffers> ForwardCall::Buffers(const core::ForwardShapes& shapes) {
  return PrepareForwardResponse(decoded_, shapes, NewResponse());
}

}  // namespace attnserve::server
