#include "server/forward_codec.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve::server {
namespace {

static_assert(std::endian::native == std::endian::little,
              "raw tensors are little-endian float32, read in place");

using Lengths = google::protobuf::RepeatedField<int32_t>;

// Sequences per batch. Empty sequences cost no tokens but a few words of bookkeeping each: a
// 64 MiB message of zero lengths would otherwise hold the worker for seconds and take gigabytes.
constexpr int64_t kMaxSequences = int64_t{1} << 16;

// Floats one reply tensor may hold: what a repeated field indexes with an int, and 2 GiB of raw
// bytes, the most a gRPC message can carry.
constexpr int64_t kMaxReplyFloats = (int64_t{1} << 29) - 1;

// "[2, 4, 256]".
std::string ShapeText(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<int64_t> ElementCount(std::span<const int64_t> shape, absl::string_view what) {
  const int rank = static_cast<int>(shape.size());
  if (rank != 2 && rank != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": shape must be [B, S, width] (padded) or [T, width] (packed), got rank ", rank,
        rank == 0 ? " (shape missing)" : ""));
  }
  int64_t count = 1;
  for (const int64_t dim : shape) {
    if (dim <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": shape ", ShapeText(shape), " has a non-positive dimension"));
    }
    if (count > std::numeric_limits<int64_t>::max() / 4 / dim) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": shape ", ShapeText(shape), " is too large"));
    }
    count *= dim;
  }
  return count;
}

absl::StatusOr<const float*> RawFloats(absl::string_view bytes, int64_t count,
                                       std::vector<float>* copy) {
  if (static_cast<int64_t>(bytes.size()) != count * static_cast<int64_t>(sizeof(float))) {
    return absl::InvalidArgumentError(absl::StrCat("holds ", bytes.size(), " bytes for ", count,
                                                   " float32 elements (", count * 4, " bytes)"));
  }
  if (count == 0) return copy->data();
  if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(float) == 0) {
    return reinterpret_cast<const float*>(bytes.data());
  }
  copy->resize(count);
  std::memcpy(copy->data(), bytes.data(), bytes.size());
  return copy->data();
}

namespace {

// Points at the tensor's floats, in place when possible, after checking their count.
absl::StatusOr<const float*> TensorData(const v1::Tensor& tensor, absl::string_view what,
                                        int64_t count, std::vector<float>* copy, bool* raw) {
  const bool has_values = tensor.values_size() > 0;
  const bool has_raw = !tensor.raw().empty();
  if (has_values == has_raw) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, has_values ? ": both values and raw are set; send exactly one"
                                      : ": no data (neither values nor raw is set)"));
  }
  if (raw != nullptr) *raw = has_raw;
  if (has_values) {
    if (tensor.values_size() != count) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", tensor.values_size(), " values for a shape of ", count, " elements"));
    }
    return tensor.values().data();
  }
  absl::StatusOr<const float*> data = RawFloats(tensor.raw(), count, copy);
  if (!data.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": raw ", data.status().message()));
  }
  return data;
}

// Fills the batch's lengths from the wire's, or full lengths when none are given.
absl::Status DecodeLengths(std::span<const int64_t> shape, std::span<const int32_t> lengths,
                           absl::string_view what, core::RaggedBatch* batch) {
  const bool packed = shape.size() == 2;
  const int64_t sequences = packed ? std::max<int64_t>(lengths.size(), 1) : shape[0];
  if (sequences > kMaxSequences) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", sequences, " sequences in one call, over the limit of ", kMaxSequences));
  }
  if (packed) {
    const int64_t rows = shape[0];
    if (lengths.empty()) {
      batch->lengths = {rows};
      return absl::OkStatus();
    }
    int64_t sum = 0;
    for (int32_t length : lengths) {
      if (length < 0) {
        return absl::InvalidArgumentError(absl::StrCat(what, " lengths: negative length ", length));
      }
      sum += length;
    }
    if (sum != rows) {
      return absl::InvalidArgumentError(absl::StrCat(what, " lengths sum to ", sum,
                                                     " but the packed tensor has ", rows, " rows"));
    }
  } else {
    const int64_t batch_size = shape[0];
    batch->padded_length = shape[1];
    if (lengths.empty()) {
      batch->lengths.assign(batch_size, batch->padded_length);
      return absl::OkStatus();
    }
    if (static_cast<int64_t>(lengths.size()) != batch_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", lengths.size(), " lengths for a batch of ", batch_size));
    }
  }
  batch->lengths.assign(lengths.begin(), lengths.end());
  return absl::OkStatus();
}

// The shape of `tensor`.
std::span<const int64_t> Shape(const v1::Tensor& tensor) {
  return {tensor.shape().data(), static_cast<size_t>(tensor.shape_size())};
}

absl::Status DecodeBatch(const v1::Tensor& tensor, const Lengths& lengths, absl::string_view what,
                         std::vector<float>* copy, bool* raw, core::RaggedBatch* batch) {
  // Shape and data only: finiteness and the layer's widths are Layer::Validate's, run once.
  absl::StatusOr<int64_t> count = ElementCount(Shape(tensor), what);
  if (!count.ok()) return count.status();
  absl::StatusOr<const float*> data = TensorData(tensor, what, *count, copy, raw);
  if (!data.ok()) return data.status();
  return MakeBatch(Shape(tensor), *data, {lengths.data(), static_cast<size_t>(lengths.size())},
                   what, batch);
}

// An absent context and an empty one mean the same: no context.
bool HasContext(const v1::ForwardRequest& request) {
  if (!request.has_context()) return false;
  const v1::Tensor& c = request.context();
  return c.shape_size() > 0 || c.values_size() > 0 || !c.raw().empty();
}

// Writes `shape` and sizes the data of `tensor`, returning the float span to fill. A count
// that a repeated field or the wire cannot hold is refused here, whatever admission checked.
absl::StatusOr<std::span<float>> SizeTensor(const std::vector<int64_t>& shape, int64_t count,
                                            bool raw, v1::Tensor* tensor) {
  if (absl::Status status = CheckReplyFloats(count); !status.ok()) return status;
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  if (raw) {
    std::string* bytes = tensor->mutable_raw();
    bytes->resize(count * sizeof(float));  // zero-filled: padded rows stay 0
    return std::span<float>(reinterpret_cast<float*>(bytes->data()), static_cast<size_t>(count));
  }
  tensor->mutable_values()->Resize(static_cast<int>(count), 0.0f);
  return std::span<float>(tensor->mutable_values()->mutable_data(), static_cast<size_t>(count));
}

}  // namespace

absl::Status MakeBatch(std::span<const int64_t> shape, const float* data,
                       std::span<const int32_t> lengths, absl::string_view what,
                       core::RaggedBatch* batch) {
  batch->data = data;
  batch->width = shape.back();
  batch->padded_length = core::RaggedBatch::kPacked;
  return DecodeLengths(shape, lengths, what, batch);
}

absl::Status CheckReplyFloats(int64_t count) {
  if (count < 0 || count > kMaxReplyFloats) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a reply tensor of ", count, " floats is over the limit of ", kMaxReplyFloats));
  }
  return absl::OkStatus();
}

absl::StatusOr<core::AttentionKind> KindFromProto(int kind) {
  switch (kind) {
    case v1::ATTENTION_KIND_BIDIRECTIONAL:
      return core::AttentionKind::kBidirectional;
    case v1::ATTENTION_KIND_CAUSAL:
      return core::AttentionKind::kCausal;
    case v1::ATTENTION_KIND_CROSS:
      return core::AttentionKind::kCross;
    case v1::ATTENTION_KIND_CAUSAL_CROSS:
      return core::AttentionKind::kCausalCross;
    case v1::ATTENTION_KIND_UNSPECIFIED:
      return absl::InvalidArgumentError(
          "kind is unspecified: say BIDIRECTIONAL, CAUSAL, CROSS or CAUSAL_CROSS");
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown attention kind ", kind));
  }
}

v1::AttentionKind KindToProto(core::AttentionKind kind) {
  switch (kind) {
    case core::AttentionKind::kBidirectional:
      return v1::ATTENTION_KIND_BIDIRECTIONAL;
    case core::AttentionKind::kCausal:
      return v1::ATTENTION_KIND_CAUSAL;
    case core::AttentionKind::kCross:
      return v1::ATTENTION_KIND_CROSS;
    case core::AttentionKind::kCausalCross:
      return v1::ATTENTION_KIND_CAUSAL_CROSS;
  }
  return v1::ATTENTION_KIND_UNSPECIFIED;
}

absl::Status DecodeForwardRequest(const v1::ForwardRequest& request, DecodedForward* decoded) {
  absl::StatusOr<core::AttentionKind> kind = KindFromProto(request.kind());
  if (!kind.ok()) return kind.status();
  core::ForwardArgs& args = decoded->args;
  args.kind = *kind;
  args.return_attention = request.return_attention();
  absl::Status status = DecodeBatch(request.input(), request.lengths(), "input",
                                    &decoded->input_copy, &decoded->raw_encoding, &args.input);
  if (!status.ok()) return status;
  if (!HasContext(request)) {
    if (!request.context_lengths().empty()) {
      return absl::InvalidArgumentError("context_lengths given without a context");
    }
    args.context.reset();
    return absl::OkStatus();
  }
  // The reply's encoding follows the input's alone; the context may come either way.
  args.context.emplace();
  return DecodeBatch(request.context(), request.context_lengths(), "context",
                     &decoded->context_copy, /*raw=*/nullptr, &*args.context);
}

int64_t ForwardReplyBytes(const core::ForwardShapes& shapes) {
  return (shapes.output_size() + shapes.attention_size()) * int64_t{sizeof(float)} + 64;
}

absl::StatusOr<ForwardBuffers> PrepareForwardResponse(const DecodedForward& decoded,
                                                      const core::ForwardShapes& shapes,
                                                      v1::ForwardResponse* response) {
  const core::RaggedBatch& input = decoded.args.input;
  std::vector<int64_t> output_shape;
  if (input.packed()) {
    output_shape = {shapes.output_rows, shapes.output_width};
  } else {
    output_shape = {input.batch(), input.padded_length, shapes.output_width};
  }
  ForwardBuffers buffers;
  absl::StatusOr<std::span<float>> output = SizeTensor(
      output_shape, shapes.output_size(), decoded.raw_encoding, response->mutable_output());
  if (!output.ok()) return output.status();
  buffers.output = *output;
  if (decoded.args.return_attention) {
    const std::vector<int64_t> dims(std::begin(shapes.attention_dims),
                                    std::end(shapes.attention_dims));
    absl::StatusOr<std::span<float>> attention = SizeTensor(
        dims, shapes.attention_size(), decoded.raw_encoding, response->mutable_attention());
    if (!attention.ok()) return attention.status();
    buffers.attention = *attention;
  }
  return buffers;
}

}  // namespace attnserve::server
