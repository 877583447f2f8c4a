#include "server/frontends/oip/infer_call.h"

#include "absl/strings/str_cat.h"
#include "server/frontends/tensor_codec.h"

namespace attnserve::server {
absl::StatusOr<absl::string_view> InferCall::RequestedModel() {
  using inference::ModelInferRequest;
  if (!ScanStringFields(&request_bytes_,
                        {{ModelInferRequest::kModelNameFieldNumber, &model_},
                         {ModelInferRequest::kModelVersionFieldNumber, &version_}})) {
    return Malformed();
  }
  absl::StatusOr<uint64_t> version = ParseModelVersion(version_);
  if (!version.ok()) return version.status();
  version_number_ = *version;
  return absl::string_view(model_);
}

absl::Status InferCall::Decode() {
  if (!Parse()) return Malformed();
  return DecodeInferRequest(*request_, &decoded_);
}

int64_t InferCall::ReplyBytes(const core::ForwardShapes& shapes) const {
  return InferReplyBytes(*request_, shapes);
}

absl::StatusOr<ForwardBuffers> InferCall::Buffers(const core::ForwardShapes& shapes) {
  return PrepareInferResponse(*request_, &decoded_, shapes, version().version, NewResponse());
}

}  // namespace attnserve::server
