#include "client/wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace attnserve::client {

absl::Status EncodeTensor(const FloatArray& array, Encoding encoding, v1::Tensor* tensor) {
  if (array.ElementCount() != static_cast<int64_t>(array.values.size())) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", array.ShapeString(), " does not hold ",
                                                   array.values.size(), " values"));
  }
  tensor->Clear();
  tensor->mutable_shape()->Add(array.shape.begin(), array.shape.end());
  if (encoding == Encoding::kValues) {
    tensor->mutable_values()->Add(array.values.begin(), array.values.end());
  } else {
    tensor->set_raw(reinterpret_cast<const char*>(array.values.data()),
                    array.values.size() * sizeof(float));
  }
  return absl::OkStatus();
}

absl::StatusOr<FloatArray> DecodeTensor(const v1::Tensor& tensor) {
  FloatArray array{.shape = {tensor.shape().begin(), tensor.shape().end()}, .values = {}};
  const auto present =
      static_cast<int64_t>(tensor.raw().empty() ? tensor.values_size() : tensor.raw().size() / 4);
  const int64_t count = BoundedElementCount(array.shape, present);
  if (!tensor.raw().empty()) {
    if (count < 0 || tensor.raw().size() != static_cast<size_t>(count) * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor of shape ", array.ShapeString(), " carries ", tensor.raw().size(), " raw bytes"));
    }
    array.values.resize(count);
    std::memcpy(array.values.data(), tensor.raw().data(), tensor.raw().size());
    return array;
  }
  if (count < 0 || tensor.values_size() != count) {
    return absl::InvalidArgumentError(absl::StrCat("tensor of shape ", array.ShapeString(),
                                                   " carries ", tensor.values_size(), " values"));
  }
  array.values.assign(tensor.values().begin(), tensor.values().end());
  return array;
}

absl::StatusOr<v1::AttentionKind> ParseKind(absl::string_view name) {
  if (name == "bidirectional") return v1::ATTENTION_KIND_BIDIRECTIONAL;
  if (name == "causal") return v1::ATTENTION_KIND_CAUSAL;
  if (name == "cross") return v1::ATTENTION_KIND_CROSS;
  if (name == "causal-cross") return v1::ATTENTION_KIND_CAUSAL_CROSS;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown kind '", name, "': expected bidirectional, causal, cross or causal-cross"));
}

absl::string_view KindFlagName(v1::AttentionKind kind) {
  switch (kind) {
    case v1::ATTENTION_KIND_BIDIRECTIONAL:
      return "bidirectional";
    case v1::ATTENTION_KIND_CAUSAL:
      return "causal";
    case v1::ATTENTION_KIND_CROSS:
      return "cross";
    case v1::ATTENTION_KIND_CAUSAL_CROSS:
      return "causal-cross";
    default:
      return "unspecified";
  }
}

absl::StatusOr<Encoding> ParseEncoding(absl::string_view name) {
  if (name == "raw") return Encoding::kRaw;
  if (name == "values") return Encoding::kValues;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown encoding '", name, "': expected raw or values"));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace attnserve::client
