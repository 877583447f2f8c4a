#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace attnserve::server {

// The one conversion from the project's absl::Status to what goes on the wire: same code
// (the two enums share their numbering), same message.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace attnserve::server
