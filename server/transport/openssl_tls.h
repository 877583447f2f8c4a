#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/transport/credentials.h"

namespace attnserve::server {

// TLS for a port served through OpenSSL rather than gRPC (the REST port), from the same files
// as the gRPC port and with the same rules: the certificate and key are re-read when they
// change (checked at most every `refresh_seconds`, on a handshake), and with a client CA every
// client must present a certificate it signed (mTLS), the CA bundle rotating the same way.
class OpenSslTls {
 public:
  // Reads the files now, so a wrong path fails at start with the file named.
  static absl::StatusOr<std::unique_ptr<OpenSslTls>> Load(const TlsFiles& files);
  ~OpenSslTls();

  // Configures `ssl_ctx` (an SSL_CTX*, as the HTTP library hands it): TLS 1.2 or later, the
  // certificate chosen per handshake from the newest files, client certificates required and
  // verified when a client CA is set. False when OpenSSL refuses a setting.
  bool Configure(void* ssl_ctx);

  struct Material;

 private:
  explicit OpenSslTls(TlsFiles files) : files_(std::move(files)) {}
  absl::Status Reload();
  // The newest material, re-read first when the files changed and the refresh time passed.
  std::shared_ptr<const Material> Current();
  static int OnCertificate(void* ssl, void* self);

  const TlsFiles files_;
  std::mutex mu_;
  std::shared_ptr<const Material> material_;       // guarded by mu_
  std::string stamp_;                              // guarded by mu_
  std::chrono::steady_clock::time_point checked_;  // guarded by mu_
};

}  // namespace attnserve::server
