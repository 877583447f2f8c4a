#pragma once

// The HTTP(S) endpoint Prometheus scrapes: GET /metrics on its own port, with optional TLS and
// a bearer-token check, built so that clients holding connections open cannot stop a scrape.
//
// Why not prometheus-cpp's Exposer (civetweb): civetweb gives each connection a thread of a
// fixed pool, so N idle or slow connections stop /metrics whatever N the pool has; and Debian
// 12's civetweb (1.15, built for the OpenSSL 1.1 API) crashes the process on the first HTTPS
// request under OpenSSL 3 (it calls SSL_get_peer_certificate, which OpenSSL 3 no longer
// exports). This server is one thread polling every connection, so a slow one costs a slot and
// a few kilobytes, never the thread; TLS is OpenSSL linked directly (as gRPC links it).

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve::server {

// How the metrics port is served (ServerOptions' --metrics-* flags fill it).
struct MetricsHttpOptions {
  std::string listen;  // HOST:PORT or [V6HOST]:PORT; port 0 picks one
  // Both set: HTTPS only, with this PEM certificate chain and key (the main port's files),
  // re-read when they change; both empty: plain HTTP.
  std::string tls_cert;
  std::string tls_key;
  int tls_refresh_seconds = 10;  // how often the TLS files are checked for a rotation
  // Decides each request from its Authorization header's value ("" when it has none): false
  // answers 401. Null: every request is served. Runs on the endpoint's one thread.
  std::function<bool(absl::string_view authorization)> authorize;
};

// A running endpoint: one thread serving GET /metrics with the text `render` returns.
class MetricsHttpServer {
 public:
  // The exposition's body, rendered for each authorized GET /metrics.
  using Render = std::function<std::string()>;

  // Binds `options.listen` and starts serving. Unavailable when the address cannot be bound;
  // InvalidArgument when the TLS files cannot be read or do not match.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(MetricsHttpOptions options,
                                                                  Render render);

  // Stops serving and closes every connection.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port.
  int port() const;

 private:
  class Loop;
  explicit MetricsHttpServer(std::unique_ptr<Loop> loop);

  std::unique_ptr<Loop> loop_;
};

}  // namespace attnserve::server
