#pragma once

#include <chrono>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

// The client's HTTP/1.1: plain TCP, no proxy, no TLS. The metrics scrape (one GET) and the load
// tester's REST mode (keep-alive connections, one call at a time each) share it.
namespace attnserve::client {

// Where an http:// URL (or a bare HOST:PORT) points: the host and port to dial, the Host
// header, the path.
struct HttpUrl {
  std::string host;
  std::string port = "80";
  std::string authority;
  std::string path = "/";
};

// Splits http://HOST[:PORT][/PATH] (HOST may be [IPv6]); with `bare_ok`, HOST:PORT without
// the scheme too. Nothing but plain http.
absl::StatusOr<HttpUrl> ParseHttpUrl(const std::string& url, bool bare_ok = false);

// One answer: its status, headers (names lower-cased) and body (de-chunked).
struct HttpResponse {
  int status = 0;
  std::map<std::string, std::string> headers;
  std::string body;
};

// The status an attnserve REST answer stands for: OK for 2xx, else the code the server's
// status conversion maps to that HTTP status, with the body's "error" text as its message.
absl::Status StatusOfHttp(const HttpResponse& response);

// One HTTP/1.1 connection, kept alive between exchanges and made again when the server closed
// it: an idle keep-alive connection the server let go is redialled and the request sent once
// more, when nothing of an answer came (the request may have reached the server: fit for the
// reads and the one-shot infer calls the client sends, not for calls that must not repeat).
// Not thread safe: one exchange at a time.
class HttpConnection {
 public:
  explicit HttpConnection(HttpUrl url) : url_(std::move(url)) {}
  ~HttpConnection() { Close(); }
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  // Sends `method path` with `headers` (each "Name: value\r\n") and `body`, and reads the
  // answer, both within `timeout`. UNAVAILABLE when the server cannot be reached or closed the
  // connection mid-answer, DEADLINE_EXCEEDED past the timeout, DATA_LOSS for what is not HTTP,
  // RESOURCE_EXHAUSTED for an answer over 1 GiB.
  absl::StatusOr<HttpResponse> Exchange(absl::string_view method, absl::string_view path,
                                        absl::string_view headers, absl::string_view body,
                                        absl::Duration timeout);

  // Asks the server to close the connection after the next answer (a one-shot GET).
  void set_close_after(bool close) { close_after_ = close; }

 private:
  using Deadline = std::chrono::steady_clock::time_point;
  absl::Status Connect(Deadline deadline);
  absl::Status SendAll(absl::string_view bytes, Deadline deadline);
  // Reads one answer; `nothing_read` says whether the connection closed before its first byte.
  absl::StatusOr<HttpResponse> ReadResponse(Deadline deadline, bool* nothing_read);
  // Reads more bytes into in_: false at the connection's end.
  absl::StatusOr<bool> ReadMore(Deadline deadline);
  void Close();

  const HttpUrl url_;
  int fd_ = -1;
  bool close_after_ = false;
  std::string in_;  // bytes read and not yet consumed
};

// GETs an http:// URL over a fresh connection and returns its body; UNAVAILABLE when
// unreachable, FAILED_PRECONDITION on a status other than 200.
absl::StatusOr<std::string> HttpGet(const std::string& url, absl::Duration timeout);

}  // namespace attnserve::client
