#pragma once

// Conversion between the wire's ForwardRequest/ForwardResponse and core::ForwardArgs, and the
// tensor-encoding checks every frontend shares (shapes, byte counts, lengths vs rows). Only
// encoding-level checks live here; the semantic ones (widths, lengths vs S, context vs kind)
// are core::Layer::Validate's.

#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "core/layer.h"
#include "core/layer_spec.h"
#include "server/job.h"

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

// The element count of a batch tensor of `shape`: rank 3 ([B, S, width], padded) or 2
// ([T, width], packed), positive dimensions, no overflow. InvalidArgument naming `what`.
absl::StatusOr<int64_t> ElementCount(std::span<const int64_t> shape, absl::string_view what);

// Makes `batch` a view of `data` (ElementCount(shape) floats) with the caller's `lengths`, or
// full lengths when there are none. InvalidArgument naming `what` when the lengths cannot
// describe the tensor (count vs B, sum vs T, negative, too many sequences); lengths vs S are
// the layer's Validate.
absl::Status MakeBatch(std::span<const int64_t> shape, const float* data,
                       std::span<const int32_t> lengths, absl::string_view what,
                       core::RaggedBatch* batch);

// ResourceExhausted for a reply tensor of `count` floats, more than a message field can hold.
absl::Status CheckReplyFloats(int64_t count);

// `count` float32 values from little-endian `bytes`: in place when the bytes are aligned for
// float, else copied into `copy` (protobuf gives no alignment promise). InvalidArgument when
// the byte count is not 4 * count.
absl::StatusOr<const float*> RawFloats(absl::string_view bytes, int64_t count,
                                       std::vector<float>* copy);

// Bytes a ForwardResponse with these shapes takes on the wire, a little over.
int64_t ForwardReplyBytes(const core::ForwardShapes& shapes);

// Sizes the response's tensors in the request's encoding and layout, zero-filled, and returns
// spans over them for Forward to write into. ResourceExhausted for a size the reply cannot hold.
absl::StatusOr<ForwardBuffers> PrepareForwardResponse(const DecodedForward& decoded,
                                                      const core::ForwardShapes& shapes,
                                                      v1::ForwardResponse* response);

}  // namespace attnserve::server
