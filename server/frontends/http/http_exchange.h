#pragma once

// One HTTP request and its reply as the REST handlers see them, whatever server library reads
// the bytes (http_server.cc adapts civetweb to it; tests can fake it).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
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

// The bytes of request bodies a REST port holds at once, each from its first byte to its
// request's end (the call reads its tensors in place), counted as they arrive: senders that
// stall in the middle of large bodies cannot push the server's memory past it, and headers
// declaring a large body that never comes hold none of it.
class HttpBodyBudget {
 public:
  // `changed` (if any) hears each change of the bytes held, as it happens (a gauge's deltas).
  explicit HttpBodyBudget(int64_t limit, std::function<void(int64_t change)> changed = nullptr)
      : limit_(limit), changed_(std::move(changed)) {}
  int64_t limit() const { return limit_; }
  int64_t used() const { return used_.load(); }
  // Takes `bytes` more; false, taking nothing, when that would pass the limit.
  bool Take(int64_t bytes) {
    int64_t used = used_.load();
    do {
      if (used + bytes > limit_) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes));
    if (changed_) changed_(bytes);
    return true;
  }
  void Give(int64_t bytes) {
    used_.fetch_sub(bytes);
    if (changed_) changed_(-bytes);
  }

 private:
  const int64_t limit_;
  const std::function<void(int64_t change)> changed_;
  std::atomic<int64_t> used_{0};
};

// How a request's body is read.
struct HttpBodyLimits {
  int64_t max_bytes = 64 << 20;                          // --max-message-mib
  Clock::duration read_time = std::chrono::seconds(10);  // the whole body, from its start
  HttpBodyBudget* budget = nullptr;                      // the port's (none: unbounded)
};

// A request body read whole, with spare capacity past its end (for an in-place JSON parse). It
// holds its bytes received of the port's budget (in steps of 64 KiB) until it goes.
class HttpBody {
 public:
  HttpBody() = default;
  HttpBody(HttpBody&& other) noexcept
      : bytes(std::move(other.bytes)),
        budget_(std::exchange(other.budget_, nullptr)),
        charged_(std::exchange(other.charged_, 0)) {}
  HttpBody& operator=(HttpBody&&) = delete;
  ~HttpBody() {
    if (budget_ != nullptr) budget_->Give(charged_);
  }

  // Charges `held` bytes (rounded up to 64 KiB) to `budget`, which must be the same one each
  // time (none: nothing is charged): false, with nothing taken, when the budget cannot take them.
  bool Hold(int64_t held, HttpBodyBudget* budget) {
    constexpr int64_t kStep = 64 << 10;
    const int64_t more = (held + kStep - 1) / kStep * kStep - charged_;
    if (budget == nullptr || more <= 0) return true;
    if (!budget->Take(more)) return false;
    budget_ = budget;
    charged_ += more;
    return true;
  }

  std::string bytes;

 private:
  HttpBodyBudget* budget_ = nullptr;
  int64_t charged_ = 0;
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

  // Reads the whole body under `limits`: at most max_bytes, within read_time from now (a client
  // that sends it byte by byte is cut off then), leaving `padding` spare bytes of capacity after
  // it, charged to the budget. TooLarge past max_bytes; Unavailable when the budget cannot take
  // it; InvalidArgument for a body that ends early, times out or is malformed.
  virtual absl::Status ReadBody(const HttpBodyLimits& limits, size_t padding, HttpBody* body) = 0;

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
