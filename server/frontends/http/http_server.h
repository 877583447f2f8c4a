#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/frontends/http/http_router.h"
#include "server/frontends/http/slow_read_cutter.h"
#include "server/observability/log_summary.h"
#include "server/transport/credentials.h"
#include "server/transport/openssl_tls.h"
#include "server/transport/token_auth.h"

struct mg_context;
struct mg_connection;

namespace attnserve::server {

// How the REST port is bounded. Each open connection holds one of `max_connections` threads
// (the library's model); more wait in the listen queue, costing the server nothing.
struct HttpServerOptions {
  std::string listen = "0.0.0.0:8000";       // HOST:PORT; port 0 picks one
  TlsFiles tls;                              // TLS / mTLS when set (the gRPC port's flags)
  std::shared_ptr<TokenAuthenticator> auth;  // bearer tokens when set
  int max_connections = 1024;
  // A request's line and headers must arrive within this (byte-by-byte senders are cut off);
  // also the bound on each read and write of a body.
  int header_timeout_ms = 10'000;
  // The whole body must arrive within this, from its first byte.
  int body_timeout_ms = 30'000;
  int idle_timeout_ms = 5'000;      // a keep-alive connection with no request for this is closed
  int max_header_bytes = 16 << 10;  // the request line and headers (at most 64 headers)
};

// The HTTP/1.1 server of the REST frontend (civetweb, the library prometheus-cpp already
// serves /metrics with): it bounds the connections, authenticates (bearer tokens, TLS/mTLS)
// and hands each request to the router. Health endpoints need no token (probes send none).
class HttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerOptions options,
                                                           HttpRouter router);
  // Stops (Stop).
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The port bound.
  int port() const { return port_; }

  // Replies from now on close their connection (shutting down: clients reconnect elsewhere).
  void CloseConnections() { closing_.store(true); }

  // Stops listening, waits for the requests being handled to be answered, closes connections.
  void Stop();

  // Writes the counts of summarised failures not yet logged.
  void FlushLog() { failures_.Flush(); }

 private:
  explicit HttpServer(HttpServerOptions options, HttpRouter router);
  static int Handle(mg_connection* connection);
  static int InitTls(void* ssl_ctx, void* self);
  static int LogMessage(const mg_connection* connection, const char* message);
  static int LibraryError(mg_connection* connection, int status, const char* message);
  absl::Status Authenticate(const mg_connection* connection) const;

  const HttpServerOptions options_;
  const HttpRouter router_;
  std::unique_ptr<OpenSslTls> tls_;
  mg_context* context_ = nullptr;
  int port_ = 0;
  std::atomic<bool> closing_{false};
  LogSummarizer failures_;
  SlowReadCutter cutter_;
};

}  // namespace attnserve::server
