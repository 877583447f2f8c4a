#include "server/frontends/http/http_server.h"

#include <civetweb.h>
#include <strings.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/frontends/http/civetweb_openssl3.h"
#include "server/frontends/http/http_status.h"
#include "server/frontends/http/oip_routes.h"
#include "server/observability/logging.h"
#include "server/transport/listening_sockets.h"

namespace attnserve::server {
namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// `raw` with its %XX escapes decoded; nullopt for a malformed escape or one that decodes to a
// NUL byte. (civetweb decodes into a C string, which a %00 cut short: /v2/models/demo%00x/ready
// was read as /v2/models/demo, and answered as that.)
std::optional<std::string> DecodePath(absl::string_view raw) {
  std::string path;
  path.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] != '%') {
      path.push_back(raw[i]);
      continue;
    }
    const int high = i + 2 < raw.size() ? HexDigit(raw[i + 1]) : -1;
    const int low = high >= 0 ? HexDigit(raw[i + 2]) : -1;
    if (low < 0 || (high == 0 && low == 0)) return std::nullopt;
    path.push_back(static_cast<char>(high * 16 + low));
    i += 2;
  }
  return path;
}

// One request on a civetweb connection, as the handlers see it.
class CivetExchange final : public HttpExchange {
 public:
  CivetExchange(mg_connection* connection, bool closing, SlowReadCutter* cutter)
      : connection_(connection),
        info_(mg_get_request_info(connection)),
        path_(DecodePath(info_->local_uri != nullptr ? info_->local_uri : "")),
        closing_(closing),
        cutter_(cutter) {}

  absl::string_view method() const override { return info_->request_method; }
  absl::string_view path() const override {
    return path_.has_value() ? absl::string_view(*path_) : absl::string_view();
  }
  // False when the path holds a malformed %-escape or a %00.
  bool path_ok() const { return path_.has_value(); }
  std::string peer() const override {
    const absl::string_view address = info_->remote_addr;
    return address.find(':') == absl::string_view::npos
               ? absl::StrCat("ipv4:", address, ":", info_->remote_port)
               : absl::StrCat("ipv6:[", address, "]:", info_->remote_port);
  }

  std::optional<absl::string_view> Header(absl::string_view name) const override {
    for (int i = 0; i < info_->num_headers; ++i) {
      if (absl::EqualsIgnoreCase(info_->http_headers[i].name, name)) {
        return absl::string_view(info_->http_headers[i].value);
      }
    }
    return std::nullopt;
  }
  // How many headers are named `name`.
  int HeaderCount(absl::string_view name) const {
    int count = 0;
    for (int i = 0; i < info_->num_headers; ++i) {
      count += absl::EqualsIgnoreCase(info_->http_headers[i].name, name) ? 1 : 0;
    }
    return count;
  }
  int64_t content_length() const override {
    return Header("Transfer-Encoding").has_value() ? -1 : info_->content_length;
  }

  absl::Status ReadBody(const HttpBodyLimits& limits, size_t padding, HttpBody* body) override;
  void Reply(int status, absl::string_view content_type, absl::string_view body,
             std::span<const std::span<const char>> more,
             const std::vector<std::pair<std::string, std::string>>& headers, bool close) override;

  bool replied() const { return replied_; }

  // After an answer that closes the connection, what is left of the body is read and dropped
  // for a moment (a lingering close): closed with unread bytes, the connection would be reset,
  // and a client still sending its body (too large: 413) would get the reset, not the answer.
  void Linger();

 private:
  // Body reads on this connection, while the watch lives, are cut at `deadline`.
  SlowReadCutter::Watch WatchReads(Clock::time_point deadline) const {
    return SlowReadCutter::Watch(*cutter_, info_->remote_addr, info_->remote_port,
                                 info_->server_port, deadline);
  }

  mg_connection* const connection_;
  const mg_request_info* const info_;
  const std::optional<std::string> path_;  // decoded here (decode_url is off)
  const bool closing_;
  SlowReadCutter* const cutter_;
  bool replied_ = false;
  bool closes_ = false;  // the answer said Connection: close
};

void CivetExchange::Linger() {
  if (!closes_) return;
  // At most this long (cut by the cutter if a read blocks past it) and this many bytes, then
  // the connection closes whatever is left.
  constexpr auto kLingerTime = std::chrono::seconds(2);
  constexpr int64_t kLingerBytes = 64 << 20;
  const Clock::time_point until = Clock::now() + kLingerTime;
  const SlowReadCutter::Watch watch = WatchReads(until);
  char chunk[16 << 10];
  for (int64_t dropped = 0; dropped < kLingerBytes && Clock::now() < until;) {
    const int n = mg_read(connection_, chunk, sizeof(chunk));
    if (n <= 0) break;
    dropped += n;
  }
}

// Where a request's body ends must be beyond doubt (RFC 9112 6.3): civetweb takes the first of
// two Content-Length headers and reads a length from its leading digits ("0, 41", "0x29" and
// "5.0" are lengths to it), where another server may read the same header otherwise.
absl::Status CheckFraming(const CivetExchange& exchange) {
  const std::optional<absl::string_view> length = exchange.Header("Content-Length");
  if (exchange.Header("Transfer-Encoding").has_value() && length.has_value()) {
    return absl::InvalidArgumentError(
        "both Transfer-Encoding and Content-Length: send one of them");
  }
  if (const int count = exchange.HeaderCount("Content-Length"); count > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Content-Length given ", count, " times: send it once"));
  }
  if (!length.has_value()) return absl::OkStatus();
  // (civetweb strips the spaces before a value, and those between a name and its colon.)
  const absl::string_view digits = absl::StripTrailingAsciiWhitespace(*length);
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit)) {
    return absl::InvalidArgumentError(absl::StrCat("Content-Length '", Clipped(*length),
                                                   "' is not a length (decimal digits alone)"));
  }
  return absl::OkStatus();
}

// A body the port's budget cannot take now (others hold it): the client may retry soon.
absl::Status BudgetSpent(const HttpBodyBudget& budget) {
  return absl::UnavailableError(
      absl::StrCat("the server holds ", budget.used() >> 20,
                   " MiB of request bodies, its limit (--http-bodies-mib ", budget.limit() >> 20,
                   "): retry shortly"));
}

absl::Status CivetExchange::ReadBody(const HttpBodyLimits& limits, size_t padding, HttpBody* body) {
  const int64_t max_bytes = limits.max_bytes;
  const Clock::time_point deadline = Clock::now() + limits.read_time;
  const int64_t declared = content_length();
  if (declared > max_bytes) {
    return TooLarge(absl::StrCat("the body of ", declared, " bytes is over the limit of ",
                                 max_bytes, " (--max-message-mib)"));
  }
  std::string& bytes = body->bytes;
  bytes.clear();
  // Room for the declared length at once (address space: pages hold memory once written), the
  // budget charged as bytes arrive.
  bytes.reserve((declared >= 0 ? declared : 64 << 10) + padding);
  // civetweb's mg_read returns only once it has all it was asked for: a client that sends a
  // byte at a time would hold a large read far past the deadline. Reads start small, double
  // while they are quick and drop to a byte when one is slow, so the deadline is checked at
  // least every few bytes of a trickle and full-size reads serve a fast client; and a read
  // still blocked at the deadline has its connection cut (a fast start, then a trickle).
  const SlowReadCutter::Watch watch = WatchReads(deadline);
  constexpr size_t kMaxRead = 64 << 10;
  // On the heap: civetweb's threads have stacks of 100 KiB or so. (Not zeroed: every byte used
  // is read into it first.)
  const auto buffer = std::make_unique_for_overwrite<char[]>(kMaxRead);
  char* const chunk = buffer.get();
  size_t want = 64;
  while (true) {
    const Clock::time_point start = Clock::now();
    const int n = mg_read(connection_, chunk, want);
    if (n <= 0 && Clock::now() > deadline) {  // the cutter ended the read
      return absl::InvalidArgumentError(
          absl::StrCat("the body took too long to arrive (", bytes.size(), " bytes so far)"));
    }
    if (n == 0) break;
    if (n < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the body could not be read after ", bytes.size(),
          " bytes (malformed chunked encoding, a pause past --http-header-timeout, or the "
          "client left)"));
    }
    if (static_cast<int64_t>(bytes.size()) + n > max_bytes) {
      return TooLarge(
          absl::StrCat("the body is over the limit of ", max_bytes, " bytes (--max-message-mib)"));
    }
    if (!body->Hold(static_cast<int64_t>(bytes.size()) + n, limits.budget)) {
      return BudgetSpent(*limits.budget);
    }
    if (bytes.capacity() < bytes.size() + n + padding) {
      bytes.reserve(std::min<size_t>(2 * (bytes.size() + n), max_bytes) + padding);
    }
    bytes.append(chunk, n);
    const Clock::time_point now = Clock::now();
    if (now > deadline) {
      return absl::InvalidArgumentError(
          absl::StrCat("the body took too long to arrive (", bytes.size(), " bytes so far)"));
    }
    want = now - start > std::chrono::milliseconds(20) ? 1 : std::min(kMaxRead, want * 2);
  }
  if (declared >= 0 && static_cast<int64_t>(bytes.size()) < declared) {
    return absl::InvalidArgumentError(
        absl::StrCat("the body stopped after ", bytes.size(), " of ", declared,
                     " bytes (the client closed, or paused past --http-header-timeout)"));
  }
  return absl::OkStatus();
}

void CivetExchange::Reply(int status, absl::string_view content_type, absl::string_view body,
                          std::span<const std::span<const char>> more,
                          const std::vector<std::pair<std::string, std::string>>& headers,
                          bool close) {
  replied_ = true;
  size_t length = body.size();
  for (const auto& piece : more) length += piece.size();
  std::string head =
      absl::StrCat("HTTP/1.1 ", status, " ", mg_get_response_code_text(nullptr, status),
                   "\r\nContent-Type: ", content_type, "\r\nContent-Length: ", length, "\r\n");
  for (const auto& [name, value] : headers) absl::StrAppend(&head, name, ": ", value, "\r\n");
  if (close || closing_) {
    closes_ = true;
    head += "Connection: close\r\n";
    // civetweb would otherwise keep the connection, and first read the rest of the body (all
    // its declared length, as slowly as the client sends it) to find the next request.
    mg_disable_connection_keep_alive(connection_);
  }
  head += "\r\n";
  head.append(body.data(), body.size());
  mg_write(connection_, head.data(), head.size());
  for (const auto& piece : more) mg_write(connection_, piece.data(), piece.size());
}

}  // namespace

HttpServer::HttpServer(HttpServerOptions options, HttpRouter router)
    : options_(std::move(options)), router_(std::move(router)) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerOptions options,
                                                              HttpRouter router) {
  const bool tls = !options.tls.cert.empty();
  std::unique_ptr<HttpServer> server(new HttpServer(std::move(options), std::move(router)));
  if (tls) {
    absl::StatusOr<std::unique_ptr<OpenSslTls>> loaded = OpenSslTls::Load(server->options_.tls);
    if (!loaded.ok()) return loaded.status();
    server->tls_ = *std::move(loaded);
  }
  mg_init_library(tls ? MG_FEATURES_TLS : 0);
  if (tls && !RepairCivetwebOpenSsl3()) {
    return absl::FailedPreconditionError(
        "this civetweb cannot serve TLS with this OpenSSL (SSL_get_peer_certificate missing)");
  }
  const HttpServerOptions& o = server->options_;
  const std::string ports = o.listen + (tls ? "s" : "");
  const std::string threads = std::to_string(o.max_connections);
  const std::string header_timeout = std::to_string(o.header_timeout_ms);
  const std::string idle_timeout = std::to_string(o.idle_timeout_ms);
  const std::string header_bytes = std::to_string(o.max_header_bytes);
  const char* civet_options[] = {"listening_ports", ports.c_str(), "num_threads", threads.c_str(),
                                 "request_timeout_ms", header_timeout.c_str(),
                                 "keep_alive_timeout_ms", idle_timeout.c_str(), "enable_keep_alive",
                                 "yes", "max_request_size", header_bytes.c_str(), "tcp_nodelay",
                                 "1", "enable_auth_domain_check", "no",
                                 // Paths are decoded by CivetExchange, which refuses a %00.
                                 "decode_url", "no", nullptr};
  mg_callbacks callbacks{};
  callbacks.log_message = &HttpServer::LogMessage;
  callbacks.http_error = &HttpServer::LibraryError;
  // Every request, from the first the listener accepts: a handler set after mg_start (which
  // already accepts) left a moment in which civetweb answered requests itself, 404.
  callbacks.begin_request = &HttpServer::Handle;
  if (tls) callbacks.init_ssl = &HttpServer::InitTls;
  server->context_ = mg_start(&callbacks, server.get(), civet_options);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", o.listen, " (--http-listen)"));
  }
  mg_server_port bound{};
  if (mg_get_server_ports(server->context_, 1, &bound) < 1) {
    return absl::UnavailableError(absl::StrCat("no port bound for ", o.listen));
  }
  server->port_ = bound.port;
  return server;
}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
  if (context_ == nullptr) return;
  // civetweb's listener thread waits for connections in poll() with a 2 s timeout and looks at
  // mg_stop's flag only between waits, so mg_stop took up to 2 s on an idle port. A listening
  // socket shut down for reading is readable at once, which ends that wait: accept() then fails
  // (civetweb ignores it) until the flag is seen. (Without /proc, mg_stop takes its 2 s.)
  for (const ListeningSocket& socket : ListeningSocketsOn(port_)) shutdown(socket.fd, SHUT_RD);
  mg_stop(context_);
  context_ = nullptr;
  cutter_.Stop();  // after: requests still reading their bodies are cut at their deadlines
  failures_.Flush();
}

int HttpServer::InitTls(void* ssl_ctx, void* self) {
  return static_cast<HttpServer*>(self)->tls_->Configure(ssl_ctx) ? 1 : -1;
}

int HttpServer::LogMessage(const mg_connection* connection, const char* message) {
  // A connection's lines (a failed handshake, a malformed request) are summarised in its
  // server's log: a flood of bad connections is counted, not written line by line.
  if (connection == nullptr) {
    Log(LogLevel::kWarn, "HTTP server", {{"error", Clipped(message)}});
    return 1;
  }
  auto* self = static_cast<HttpServer*>(mg_get_user_data(mg_get_context(connection)));
  if (self != nullptr) {
    self->failures_.Add(LogLevel::kInfo, "http library", "HTTP connection failed",
                        {{"error", Clipped(message)}});
  }
  return 1;
}

int HttpServer::LibraryError(mg_connection* connection, int status, const char* message) {
  // What civetweb refuses itself (a request line or headers it cannot parse or that are too
  // large, a length it cannot take) is answered as every error of the port is: JSON, and the
  // connection closed (the request's end is unknown).
  HttpServer& self = *static_cast<HttpServer*>(mg_get_user_data(mg_get_context(connection)));
  const std::string body = ErrorJson(message != nullptr ? message : "");
  self.failures_.Add(LogLevel::kInfo, "http refused by the library", "HTTP request refused",
                     {{"status", status}, {"error", Clipped(body)}});
  CivetExchange(connection, /*closing=*/true, &self.cutter_)
      .Reply(status, "application/json", body, {}, {}, /*close=*/true);
  return 0;
}

absl::Status HttpServer::Authenticate(const mg_connection* connection) const {
  if (options_.auth == nullptr) return absl::OkStatus();
  const char* header = mg_get_header(connection, "Authorization");
  if (header == nullptr) return options_.auth->Check(nullptr);
  const absl::string_view value(header);
  return options_.auth->Check(&value);
}

int HttpServer::Handle(mg_connection* connection) {
  HttpServer& self = *static_cast<HttpServer*>(mg_get_user_data(mg_get_context(connection)));
  CivetExchange exchange(connection, self.closing_.load(), &self.cutter_);
  struct LingerAtEnd {
    CivetExchange& exchange;
    ~LingerAtEnd() { exchange.Linger(); }
  } linger{exchange};
  if (mg_get_request_info(connection)->num_headers >= MG_MAX_HEADERS) {
    // civetweb keeps the first 64 and drops the rest silently: refuse rather than guess.
    ReplyError(
        exchange,
        absl::InvalidArgumentError(absl::StrCat("more than ", MG_MAX_HEADERS - 1, " headers")),
        /*close=*/true);
    return 400;
  }
  if (!exchange.path_ok()) {
    ReplyError(exchange,
               absl::InvalidArgumentError(
                   "the path holds a malformed %-escape or a NUL byte (%00): no endpoint has one"),
               /*close=*/true);
    return 400;
  }
  if (absl::Status framing = CheckFraming(exchange); !framing.ok()) {
    // A proxy in front that took another length than civetweb's would see another request in
    // the same bytes (request smuggling): refused, and the connection closed unread.
    ReplyError(exchange, framing, /*close=*/true);
    return 400;
  }
  // The probes' two paths need no token (probes send none); every other path does, whether or
  // not it names an endpoint.
  if (exchange.path() != "/v2/health/live" && exchange.path() != "/v2/health/ready") {
    if (absl::Status status = self.Authenticate(connection); !status.ok()) {
      self.failures_.Add(
          LogLevel::kInfo, "http UNAUTHENTICATED", "HTTP call refused",
          {{"path", Clipped(exchange.path())}, {"error", std::string(status.message())}});
      ReplyError(exchange, status, /*close=*/exchange.content_length() != 0);
      return 401;
    }
  }
  try {
    self.router_.Dispatch(exchange);
  } catch (const std::exception& e) {
    // No request may take the server down with it: the request fails, the others go on.
    self.failures_.Add(LogLevel::kError, "http INTERNAL", "HTTP call failed",
                       {{"path", Clipped(exchange.path())}, {"error", e.what()}});
    ReplyError(exchange, absl::InternalError(absl::StrCat("the call failed: ", e.what())),
               /*close=*/true);
    return 500;
  }
  return 200;
}

}  // namespace attnserve::server
