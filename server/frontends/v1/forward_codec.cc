#include "server/frontends/v1/forward_codec.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/frontends/tensor_codec.h"

namespace attnserve::server {
namespace {

using Lengths = google::protobuf::RepeatedField<int32_t>;

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

// The shape of `tensor`.
std::span<const int64_t> Shape(const v1::Tensor& tensor) {
  return {tensor.shape().data(), static_cast<size_t>(tensor.shape_size())};
}

}  // namespace

absl::Status DecodeTensorBatch(const v1::Tensor& tensor, const Lengths& lengths,
                               absl::string_view what, std::vector<float>* copy, bool* raw,
                               core::RaggedBatch* batch) {
  // Shape and data only: finiteness and the layer's widths are Layer::Validate's, run once.
  absl::StatusOr<int64_t> count = ElementCount(Shape(tensor), what);
  if (!count.ok()) return count.status();
  absl::StatusOr<const float*> data = TensorData(tensor, what, *count, copy, raw);
  if (!data.ok()) return data.status();
  return MakeBatch(Shape(tensor), *data, {lengths.data(), static_cast<size_t>(lengths.size())},
                   what, batch);
}

bool HasTensor(const v1::Tensor& tensor) {
  return tensor.shape_size() > 0 || tensor.values_size() > 0 || !tensor.raw().empty();
}

absl::StatusOr<std::span<float>> SizeReplyTensor(const std::vector<int64_t>& shape, int64_t count,
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

namespace {

// The kinds as the wire spells them (the enum's value names, what JSON and protobufjs clients
// send), so a message never names a kind the caller cannot send.
std::string WireKindNames() {
  std::vector<std::string> names;
  for (core::AttentionKind kind : core::kAttentionKinds) {
    names.push_back(v1::AttentionKind_Name(KindToProto(kind)));
  }
  return absl::StrJoin(names, ", ");
}

}  // namespace

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
          absl::StrCat("kind is unspecified: send ", WireKindNames()));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown attention kind ", kind, ": send ", WireKindNames()));
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
  absl::Status status =
      DecodeTensorBatch(request.input(), request.lengths(), "input", &decoded->input_copy,
                        &decoded->raw_encoding, &args.input);
  if (!status.ok()) return status;
  if (!request.has_context() || !HasTensor(request.context())) {
    if (!request.context_lengths().empty()) {
      return absl::InvalidArgumentError("context_lengths given without a context");
    }
    args.context.reset();
    return absl::OkStatus();
  }
  // The reply's encoding follows the input's alone; the context may come either way.
  args.context.emplace();
  return DecodeTensorBatch(request.context(), request.context_lengths(), "context",
                           &decoded->context_copy, /*raw=*/nullptr, &*args.context);
}

absl::StatusOr<ForwardBuffers> PrepareForwardResponse(const DecodedForward& decoded,
                                                      const core::ForwardShapes& shapes,
                                                      v1::ForwardResponse* response) {
  ForwardBuffers buffers;
  absl::StatusOr<std::span<float>> output =
      SizeReplyTensor(OutputShape(decoded.args.input, shapes), shapes.output_size(),
                      decoded.raw_encoding, response->mutable_output());
  if (!output.ok()) return output.status();
  buffers.output = *output;
  if (decoded.args.return_attention) {
    absl::StatusOr<std::span<float>> attention =
        SizeReplyTensor(AttentionShape(shapes), shapes.attention_size(), decoded.raw_encoding,
                        response->mutable_attention());
    if (!attention.ok()) return attention.status();
    buffers.attention = *attention;
  }
  return buffers;
}

}  // namespace attnserve::server
