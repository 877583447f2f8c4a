#include "client/http_connection.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace attnserve::client {
namespace {

// An answer larger than this is not attnserve's.
constexpr size_t kMaxAnswer = 1ULL << 30;

// Waits until `fd` is ready for `events` or the deadline passes.
bool WaitFor(int fd, short events, std::chrono::steady_clock::time_point deadline) {
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{.fd = fd, .events = events, .revents = 0};
    const int n = poll(&p, 1, static_cast<int>(left.count()));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// Connects to host:port within the deadline; the socket is non-blocking.
absl::StatusOr<int> Dial(const std::string& host, const std::string& port,
                         std::chrono::steady_clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc)));
  }
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 ||
        (errno == EINPROGRESS && WaitFor(fd, POLLOUT, deadline))) {
      int error = 0;
      socklen_t len = sizeof(error);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
      if (error == 0) {
        // A request goes as its head, then its body: Nagle's algorithm would hold the body
        // back for the server's delayed ACK (40 ms a call).
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        freeaddrinfo(found);
        return fd;
      }
      last_error = std::strerror(error);
    } else {
      last_error = errno == EINPROGRESS ? "timed out" : std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  return absl::UnavailableError(
      absl::StrCat("cannot connect to ", host, ":", port, ": ", last_error));
}

// Decodes a chunked HTTP/1.1 body from the start of `body`, setting `consumed` to the bytes it
// took; OUT_OF_RANGE when `body` does not hold all of it yet.
absl::StatusOr<std::string> Unchunk(absl::string_view body, size_t* consumed) {
  std::string out;
  const size_t size_before = body.size();
  while (true) {
    const size_t eol = body.find("\r\n");
    if (eol == absl::string_view::npos) return absl::OutOfRangeError("more");
    uint64_t size = 0;
    std::string hex(absl::StripAsciiWhitespace(body.substr(0, body.find_first_of(";\r"))));
    if (!absl::SimpleHexAtoi(hex, &size) || size > kMaxAnswer) {
      return absl::DataLossError("bad chunk size");
    }
    body.remove_prefix(eol + 2);
    if (size == 0) {
      if (body.size() < 2) return absl::OutOfRangeError("more");
      if (!absl::StartsWith(body, "\r\n")) return absl::DataLossError("trailers are not read");
      body.remove_prefix(2);
      *consumed = size_before - body.size();
      return out;
    }
    if (body.size() < size + 2) return absl::OutOfRangeError("more");
    if (body.substr(size, 2) != "\r\n") return absl::DataLossError("a chunk without its CRLF");
    out.append(body.data(), size);
    body.remove_prefix(size + 2);
  }
}

// The absl code the server's status conversion (server/frontends/http/http_status.cc) maps to
// `status`.
absl::StatusCode CodeOfHttp(int status) {
  switch (status) {
    case 400:
      return absl::StatusCode::kInvalidArgument;
    case 401:
      return absl::StatusCode::kUnauthenticated;
    case 403:
      return absl::StatusCode::kPermissionDenied;
    case 404:
    case 405:
      return absl::StatusCode::kNotFound;
    case 409:
      return absl::StatusCode::kAlreadyExists;
    case 413:
    case 429:
      return absl::StatusCode::kResourceExhausted;
    case 499:
      return absl::StatusCode::kCancelled;
    case 501:
      return absl::StatusCode::kUnimplemented;
    case 503:
      return absl::StatusCode::kUnavailable;
    case 504:
      return absl::StatusCode::kDeadlineExceeded;
    default:
      return status >= 500 ? absl::StatusCode::kInternal : absl::StatusCode::kUnknown;
  }
}

}  // namespace

absl::StatusOr<HttpUrl> ParseHttpUrl(const std::string& url, bool bare_ok) {
  absl::string_view rest = url;
  if (!absl::ConsumePrefix(&rest, "http://") && !bare_ok) {
    return absl::InvalidArgumentError(absl::StrCat("URL '", url, "' is not http://HOST:PORT/PATH"));
  }
  const size_t slash = rest.find('/');
  const absl::string_view authority = rest.substr(0, slash);
  HttpUrl parsed;
  parsed.authority = std::string(authority);
  parsed.path = slash == absl::string_view::npos ? "/" : std::string(rest.substr(slash));
  parsed.host = std::string(authority);
  if (absl::StartsWith(authority, "[")) {  // [::1]:9090
    const size_t close = authority.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError("bad IPv6 address in URL");
    }
    parsed.host = std::string(authority.substr(1, close - 1));
    if (authority.size() > close + 2) parsed.port = std::string(authority.substr(close + 2));
  } else if (const size_t colon = authority.rfind(':'); colon != absl::string_view::npos) {
    parsed.host = std::string(authority.substr(0, colon));
    parsed.port = std::string(authority.substr(colon + 1));
  }
  if (parsed.host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no host in URL '", url, "'"));
  }
  return parsed;
}

absl::Status StatusOfHttp(const HttpResponse& response) {
  if (response.status >= 200 && response.status < 300) return absl::OkStatus();
  std::string message = absl::StrCat("HTTP ", response.status);
  const nlohmann::json body = nlohmann::json::parse(response.body, nullptr, false);
  if (body.is_object() && body.contains("error") && body["error"].is_string()) {
    absl::StrAppend(&message, ": ", body["error"].get<std::string>());
  }
  return absl::Status(CodeOfHttp(response.status), message);
}

void HttpConnection::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  in_.clear();
}

absl::Status HttpConnection::Connect(Deadline deadline) {
  absl::StatusOr<int> fd = Dial(url_.host, url_.port, deadline);
  if (!fd.ok()) return fd.status();
  fd_ = *fd;
  return absl::OkStatus();
}

absl::Status HttpConnection::SendAll(absl::string_view bytes, Deadline deadline) {
  for (size_t sent = 0; sent < bytes.size();) {
    if (!WaitFor(fd_, POLLOUT, deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("sending to ", url_.authority));
    }
    const ssize_t n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return absl::UnavailableError(
          absl::StrCat("sending to ", url_.authority, ": ", std::strerror(errno)));
    }
    if (n > 0) sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> HttpConnection::ReadMore(Deadline deadline) {
  char buffer[65536];
  while (true) {
    if (!WaitFor(fd_, POLLIN, deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("reading from ", url_.authority));
    }
    const ssize_t n = recv(fd_, buffer, sizeof(buffer), 0);
    if (n == 0) return false;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      if (errno == ECONNRESET) return false;
      return absl::UnavailableError(
          absl::StrCat("reading from ", url_.authority, ": ", std::strerror(errno)));
    }
    in_.append(buffer, static_cast<size_t>(n));
    if (in_.size() > kMaxAnswer) {
      return absl::ResourceExhaustedError(url_.authority + " answers too much");
    }
    return true;
  }
}

absl::StatusOr<HttpResponse> HttpConnection::ReadResponse(Deadline deadline, bool* nothing_read) {
  *nothing_read = true;
  size_t head_end;
  while ((head_end = in_.find("\r\n\r\n")) == std::string::npos) {
    absl::StatusOr<bool> more = ReadMore(deadline);
    if (!more.ok()) return more.status();
    if (!*more) {
      return absl::UnavailableError(
          absl::StrCat(url_.authority, " closed the connection before its answer"));
    }
    *nothing_read = false;
  }
  *nothing_read = false;
  HttpResponse response;
  const absl::string_view head(in_.data(), head_end);
  std::vector<absl::string_view> lines = absl::StrSplit(head, "\r\n");
  std::vector<absl::string_view> status_line = absl::StrSplit(lines[0], absl::MaxSplits(' ', 2));
  if (status_line.size() < 2 || !absl::StartsWith(status_line[0], "HTTP/") ||
      !absl::SimpleAtoi(status_line[1], &response.status)) {
    return absl::DataLossError(absl::StrCat(url_.authority, ": not an HTTP answer"));
  }
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == absl::string_view::npos) continue;
    response.headers[absl::AsciiStrToLower(lines[i].substr(0, colon))] =
        std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
  }
  const size_t body_start = head_end + 4;
  const auto header = [&](const std::string& name) -> std::string {
    const auto it = response.headers.find(name);
    return it == response.headers.end() ? "" : absl::AsciiStrToLower(it->second);
  };
  if (absl::StrContains(header("transfer-encoding"), "chunked")) {
    while (true) {
      size_t consumed = 0;
      absl::StatusOr<std::string> body =
          Unchunk(absl::string_view(in_).substr(body_start), &consumed);
      if (body.ok()) {
        response.body = *std::move(body);
        in_.erase(0, body_start + consumed);
        break;
      }
      if (body.status().code() != absl::StatusCode::kOutOfRange) return body.status();
      absl::StatusOr<bool> more = ReadMore(deadline);
      if (!more.ok()) return more.status();
      if (!*more) return absl::UnavailableError(url_.authority + ": the answer was cut short");
    }
  } else if (const std::string length = header("content-length"); !length.empty()) {
    size_t size = 0;
    if (!absl::SimpleAtoi(length, &size) || size > kMaxAnswer) {
      return absl::DataLossError(absl::StrCat(url_.authority, ": bad Content-Length"));
    }
    while (in_.size() < body_start + size) {
      absl::StatusOr<bool> more = ReadMore(deadline);
      if (!more.ok()) return more.status();
      if (!*more) return absl::UnavailableError(url_.authority + ": the answer was cut short");
    }
    response.body = in_.substr(body_start, size);
    in_.erase(0, body_start + size);
  } else {
    // Neither: the body runs to the connection's end.
    while (true) {
      absl::StatusOr<bool> more = ReadMore(deadline);
      if (!more.ok()) return more.status();
      if (!*more) break;
    }
    response.body = in_.substr(body_start);
    Close();
  }
  if (header("connection") == "close") Close();
  return response;
}

absl::StatusOr<HttpResponse> HttpConnection::Exchange(absl::string_view method,
                                                      absl::string_view path,
                                                      absl::string_view headers,
                                                      absl::string_view body,
                                                      absl::Duration timeout) {
  const Deadline deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
  const std::string head = absl::StrCat(
      method, " ", path, " HTTP/1.1\r\nHost: ", url_.authority, "\r\n", headers,
      body.empty() && method == "GET" ? "" : absl::StrCat("Content-Length: ", body.size(), "\r\n"),
      close_after_ ? "Connection: close\r\n" : "", "\r\n");
  // A kept connection the server has closed meanwhile fails at once: dial again, once.
  for (int attempt = 0; attempt < 2; ++attempt) {
    const bool reused = fd_ >= 0;
    if (!reused) {
      if (absl::Status s = Connect(deadline); !s.ok()) return s;
    }
    absl::Status sent = SendAll(head, deadline);
    if (sent.ok() && !body.empty()) sent = SendAll(body, deadline);
    bool nothing_read = true;
    absl::StatusOr<HttpResponse> response =
        sent.ok() ? ReadResponse(deadline, &nothing_read) : absl::StatusOr<HttpResponse>(sent);
    if (response.ok()) return response;
    Close();
    const bool stale =
        reused && nothing_read && response.status().code() == absl::StatusCode::kUnavailable;
    if (!stale) return response.status();
  }
  return absl::UnavailableError(absl::StrCat(url_.authority, " closed every connection"));
}

absl::StatusOr<std::string> HttpGet(const std::string& url, absl::Duration timeout) {
  absl::StatusOr<HttpUrl> parsed = ParseHttpUrl(url);
  if (!parsed.ok()) return parsed.status();
  HttpConnection connection(*parsed);
  connection.set_close_after(true);
  absl::StatusOr<HttpResponse> response =
      connection.Exchange("GET", parsed->path, "Accept: text/plain\r\n", "", timeout);
  if (!response.ok()) return response.status();
  if (response->status != 200) {
    return absl::FailedPreconditionError(absl::StrCat(url, " answered HTTP ", response->status));
  }
  return std::move(response->body);
}

}  // namespace attnserve::client
