#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "client/float_array.h"
#include "grpcpp/support/status.h"

namespace attnserve::client {

// How float data travels: packed `values` or little-endian `raw` bytes (the fast path).
enum class Encoding { kRaw, kValues };

// Fills a wire Tensor from an array, in the chosen encoding.
absl::Status EncodeTensor(const FloatArray& array, Encoding encoding, v1::Tensor* tensor);

// Reads a wire Tensor in either encoding; INVALID_ARGUMENT when its data and shape disagree.
absl::StatusOr<FloatArray> DecodeTensor(const v1::Tensor& tensor);

// Parses a kind as the command line spells it: bidirectional, causal, cross, causal_cross.
absl::StatusOr<v1::AttentionKind> ParseKind(absl::string_view name);

// The command-line spelling of a kind (the inverse of ParseKind).
absl::string_view KindFlagName(v1::AttentionKind kind);

// Every kind's name (core's spelling: bidirectional, causal, cross, causal_cross), for flag
// checks and help, as a list and joined by `separator`.
std::vector<std::string> KindNameList();
std::string KindNames(absl::string_view separator);

// Parses "raw" or "values".
absl::StatusOr<Encoding> ParseEncoding(absl::string_view name);

// The same error as an absl::Status: gRPC's and abseil's codes share their numbers.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace attnserve::client
