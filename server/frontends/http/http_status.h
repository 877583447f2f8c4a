#pragma once

// The one conversion of an absl::Status to the REST frontend's answer: the HTTP status a
// client of the Open Inference Protocol expects for each code, and the protocol's error body.

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attnserve::server {

// A request body over the limit: MessageTooLarge (server/serving/too_large.h), HTTP 413.
absl::Status TooLarge(absl::string_view message);

// The HTTP status for `status`: 200 OK, 400 invalid argument (also failed precondition, out of
// range), 401 unauthenticated, 403 permission denied, 404 not found, 409 aborted or already
// exists, 413 too large (TooLarge), 429 a full queue or overload (resource exhausted: retry
// later, elsewhere), 499 cancelled (the caller left), 501 unimplemented, 503 unavailable
// (shutting down: a load balancer moves away), 504 deadline exceeded, 500 the rest. A request
// or reply over --max-message-mib (IsMessageTooLarge) is 413.
int HttpStatus(const absl::Status& status);

// The protocol's error body, `{"error": "MESSAGE"}`.
std::string ErrorJson(absl::string_view message);

// Appends `text` to `out` as a JSON string (quoted, escaped; bytes that are not UTF-8 become
// U+FFFD, so a client's bytes quoted in a message cannot make the reply invalid JSON).
void AppendJsonString(absl::string_view text, std::string* out);

}  // namespace attnserve::server
