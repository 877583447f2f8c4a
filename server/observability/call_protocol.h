#pragma once

// The transport a call came in on, for its metrics' `protocol` label.

#include "absl/strings/string_view.h"

namespace attnserve::server {

enum class CallProtocol { kGrpc = 0, kHttp = 1 };
inline constexpr int kCallProtocols = 2;

// The label value: "grpc" (attnserve.v1 and the Open Inference Protocol's gRPC form) or "http"
// (its REST form).
inline absl::string_view ProtocolLabel(CallProtocol protocol) {
  return protocol == CallProtocol::kHttp ? "http" : "grpc";
}

}  // namespace attnserve::server
