#include "client/wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/layer_spec.h"

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

// The wire enum lists the kinds in core's order from 1 (0 is UNSPECIFIED), so the one table of
// names, core's, serves the command line too.
static_assert(v1::ATTENTION_KIND_BIDIRECTIONAL ==
              static_cast<int>(core::AttentionKind::kBidirectional) + 1);
static_assert(v1::ATTENTION_KIND_CAUSAL == static_cast<int>(core::AttentionKind::kCausal) + 1);
static_assert(v1::ATTENTION_KIND_CROSS == static_cast<int>(core::AttentionKind::kCross) + 1);
static_assert(v1::ATTENTION_KIND_CAUSAL_CROSS ==
              static_cast<int>(core::AttentionKind::kCausalCross) + 1);

absl::StatusOr<v1::AttentionKind> ParseKind(absl::string_view name) {
  const std::optional<core::AttentionKind> kind =
      core::KindFromName(std::string_view(name.data(), name.size()));
  if (!kind) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown kind '", name, "': expected ", KindNames(", ")));
  }
  return static_cast<v1::AttentionKind>(static_cast<int>(*kind) + 1);
}

absl::string_view KindFlagName(v1::AttentionKind kind) {
  if (kind < v1::ATTENTION_KIND_BIDIRECTIONAL || kind > v1::ATTENTION_KIND_CAUSAL_CROSS) {
    return "unspecified";
  }
  const std::string_view name = core::KindName(static_cast<core::AttentionKind>(kind - 1));
  return absl::string_view(name.data(), name.size());
}

std::vector<std::string> KindNameList() {
  std::vector<std::string> names;
  for (core::AttentionKind kind : core::kAttentionKinds) names.emplace_back(core::KindName(kind));
  return names;
}

std::string KindNames(absl::string_view separator) {
  return absl::StrJoin(KindNameList(), separator);
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
