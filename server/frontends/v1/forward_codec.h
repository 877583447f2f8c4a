#pragma once

// Conversion between the wire's ForwardRequest/ForwardResponse and core::ForwardArgs. Only
// encoding-level checks live here (with the shared ones of tensor_codec.h); the semantic ones
// (widths, lengths vs S, context vs kind) are core::Layer::Validate's.

#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "core/layer.h"
#include "core/layer_spec.h"
#include "server/serving/job.h"

namespace attnserve::server {

// A request's tensors seen as core batches, pointing into the request's own buffers (no copy,
// except raw bytes that are not float-aligned), plus how the reply must be encoded.
struct DecodedForward {
  DecodedForward() = default;
  DecodedForward(const DecodedForward&) = delete;
  DecodedForward& operator=(const DecodedForward&) = delete;

  core::ForwardArgs args;
  bool raw_encoding = false;  // the input came as raw bytes, so the reply goes as raw bytes
  std::vector<float> input_copy, context_copy;  // only for misaligned raw bytes
};

// The core kind of a wire kind; InvalidArgument for UNSPECIFIED or an unknown number.
absl::StatusOr<core::AttentionKind> KindFromProto(int kind);

// The wire kind of a core kind.
v1::AttentionKind KindToProto(core::AttentionKind kind);

// Decodes `request` into `decoded` (which then points into `request`: keep it alive).
// InvalidArgument, saying what is wrong, for a malformed encoding. Values are not scanned:
// finiteness is checked once, by core::Layer::Validate at admission.
absl::Status DecodeForwardRequest(const v1::ForwardRequest& request, DecodedForward* decoded);

// Decodes `tensor` with its `lengths` into `batch` (pointing into the tensor; `copy` holds
// misaligned raw bytes), saying in `raw` (when not null) whether it came as raw bytes.
// InvalidArgument naming `what`. Forward's and Decode's tensors alike.
absl::Status DecodeTensorBatch(const v1::Tensor& tensor,
                               const google::protobuf::RepeatedField<int32_t>& lengths,
                               absl::string_view what, std::vector<float>* copy, bool* raw,
                               core::RaggedBatch* batch);

// An absent tensor and an empty one mean the same: none.
bool HasTensor(const v1::Tensor& tensor);

// Writes `shape` into `tensor` and sizes its data (raw bytes or values, zero-filled), returning
// the floats to fill. ResourceExhausted for a count a reply cannot hold.
absl::StatusOr<std::span<float>> SizeReplyTensor(const std::vector<int64_t>& shape, int64_t count,
                                                 bool raw, v1::Tensor* tensor);

// Sizes the response's tensors in the request's encoding and layout, zero-filled, and returns
// spans over them for Forward to write into. ResourceExhausted for a size the reply cannot hold.
absl::StatusOr<ForwardBuffers> PrepareForwardResponse(const DecodedForward& decoded,
                                                      const core::ForwardShapes& shapes,
                                                      v1::ForwardResponse* response);

}  // namespace attnserve::server
