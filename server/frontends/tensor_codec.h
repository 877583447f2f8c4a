#pragma once

// The tensor-encoding checks and reply shapes every frontend shares (attnserve.v1, the Open
// Inference Protocol): shapes, byte counts, lengths vs rows, and where a reply's rows go. Only
// encoding-level checks live here; the semantic ones (widths, lengths vs S, context vs kind)
// are core::Layer::Validate's.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layer.h"

namespace attnserve::server {

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

// Bytes a reply with these shapes takes on the wire, a little over (either protocol; a caller
// adds what its own envelope echoes back).
int64_t ForwardReplyBytes(const core::ForwardShapes& shapes);

// The reply's output shape in the request's layout: [T, width] for a packed `input`,
// [B, S, width] for a padded one.
std::vector<int64_t> OutputShape(const core::RaggedBatch& input, const core::ForwardShapes& shapes);

// The reply's attention shape, [B, H, S, S_kv].
std::vector<int64_t> AttentionShape(const core::ForwardShapes& shapes);

}  // namespace attnserve::server
