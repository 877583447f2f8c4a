#include "core/weights.h"

#include <cmath>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnserve::core {
namespace {

// Large enough for any real attention layer, small enough that products of two dimensions
// never overflow int64 and a corrupt spec is refused before anything is allocated.
constexpr int64_t kMaxDimension = int64_t{1} << 20;

absl::Status CheckDimension(const char* name, int64_t value) {
  if (value <= 0 || value > kMaxDimension) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer spec: ", name, " is ", value, ", expected 1..", kMaxDimension));
  }
  return absl::OkStatus();
}

absl::Status CheckSpec(const LayerSpec& spec) {
  for (const auto& [name, value] :
       {std::pair{"d_model", spec.d_model}, std::pair{"d_context", spec.d_context},
        std::pair{"num_heads", spec.num_heads}, std::pair{"head_dim", spec.head_dim}}) {
    if (absl::Status s = CheckDimension(name, value); !s.ok()) return s;
  }
  return CheckDimension("inner width (num_heads * head_dim)", spec.inner());
}

// A matrix or bias must have exactly `expected` finite values; a NaN or infinity in a weight
// would silently poison every output, so it is refused at load rather than served.
absl::Status CheckBuffer(const char* name, const std::vector<float>& values, int64_t expected) {
  if (static_cast<int64_t>(values.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("layer weights: ", name, " has ",
                                                   values.size(), " values, expected ", expected));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer weights: ", name, " has a non-finite value at index ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckWeights(const LayerWeights& weights) {
  const LayerSpec& spec = weights.spec;
  if (absl::Status s = CheckSpec(spec); !s.ok()) return s;
  const int64_t inner = spec.inner();
  const int64_t bias_inner = spec.has_bias ? inner : 0;
  const bool out = spec.has_output_projection;
  const int64_t bias_out = out && spec.has_bias ? spec.d_model : 0;
  const struct {
    const char* name;
    const std::vector<float>& values;
    int64_t expected;
  } buffers[] = {
      {"w_q", weights.w_q, inner * spec.d_model},
      {"b_q", weights.b_q, bias_inner},
      {"w_k", weights.w_k, inner * spec.d_context},
      {"b_k", weights.b_k, bias_inner},
      {"w_v", weights.w_v, inner * spec.d_context},
      {"b_v", weights.b_v, bias_inner},
      {"w_o", weights.w_o, out ? spec.d_model * inner : 0},
      {"b_o", weights.b_o, bias_out},
  };
  for (const auto& buffer : buffers) {
    if (absl::Status s = CheckBuffer(buffer.name, buffer.values, buffer.expected); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerWeights> LoadLayerWeights(const std::string& path,
                                              const LoadOptions& options) {
  (void)options;
  return absl::UnimplementedError(absl::StrCat(path, ": the loader is being written"));
}

}  // namespace attnserve::core
