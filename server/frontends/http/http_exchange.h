#pragma once

// One HTTP request and its reply as the REST handlers see them, whatever server library reads
// the bytes (http_server.cc adapts civetweb to it; tests can fake it).

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/serving/clock.h"

namespace attnserve::server {

// A request body read whole, with spare capacity past its end (for an in-place JSON parse).
struct HttpBody {
  std::string bytes;
};

class HttpExchange {
 public:
  virtual ~HttpExchange() = default;

  virtual absl::string_view method() const = 0;
  // The path, percent-decoded, without the query.
  virtual absl::string_view path() const = 0;
  // A request header's value (names are case-insensitive), or nullopt.
  virtual std::optional<absl::string_view> Header(absl::string_view name) const = 0;
  // The caller's address in gRPC's peer form ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000"), so
  // one rule (transport/admin_auth.h) reads both protocols' peers.
  virtual std::string peer() const = 0;
  // The declared Content-Length, or -1 (chunked, or none).
  virtual int64_t content_length() const = 0;

  // Reads the whole body, at most `max_bytes`, by `deadline` (a client that sends it byte by
  // byte is cut off then), leaving `padding` spare bytes of capacity after it. TooLarge past
  // the limit; InvalidArgument for a body that ends early, times out or is malformed.
  virtual absl::Status ReadBody(int64_t max_bytes, Clock::time_point deadline, size_t padding,
                                HttpBody* body) = 0;

  // Sends the reply: status, Content-Type, extra headers, then `body` and `more` (pieces sent
  // after it without a copy). `close` ends the connection after it (the request body was not
  // read, or the server is shutting down).
  virtual void Reply(int status, absl::string_view content_type, absl::string_view body,
                     std::span<const std::span<const char>> more = {},
                     const std::vector<std::pair<std::string, std::string>>& headers = {},
                     bool close = false) = 0;

  // The route's captured path segments ({model}, {version}), set by the router.
  std::map<std::string, std::string, std::less<>> params;
};

}  // namespace attnserve::server
