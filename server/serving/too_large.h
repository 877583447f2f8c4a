#pragma once

// "Too large" as a status: ResourceExhausted, as gRPC says it, marked so that a protocol that
// tells it apart from "the server is full" (HTTP: 413, not 429) can. One mark for every place
// that refuses a message for its size (admission's reply limit, a frontend's body limit).

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"

namespace attnserve::server {

inline constexpr absl::string_view kTooLargePayload = "attnserve/too-large";

// ResourceExhausted with `message`, marked too large.
inline absl::Status MessageTooLarge(absl::string_view message) {
  absl::Status status = absl::ResourceExhaustedError(message);
  status.SetPayload(kTooLargePayload, absl::Cord("1"));
  return status;
}

// True for a status MessageTooLarge made.
inline bool IsMessageTooLarge(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted &&
         status.GetPayload(kTooLargePayload).has_value();
}

}  // namespace attnserve::server
