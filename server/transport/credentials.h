#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/server_credentials.h"

namespace attnserve::server {

// Where the main port's TLS material lives (PEM files); all empty: plaintext.
struct TlsFiles {
  std::string cert;          // certificate chain (--tls-cert)
  std::string key;           // private key (--tls-key)
  std::string client_ca;     // CA bundle client certificates must chain to (--tls-client-ca)
  int refresh_seconds = 10;  // how often the files are checked for a rotation
};

// The main port's credentials: TLS (mTLS when `files.client_ca` is set) with the files re-read
// every `refresh_seconds` (gRPC's FileWatcherCertificateProvider: rotation without restart), or
// plaintext. When `auth` is set it runs on every call of the port before the request is read.
// Fails with a clear message when a file is missing or not PEM, or TLS is half configured.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files, std::shared_ptr<grpc::AuthMetadataProcessor> auth);

}  // namespace attnserve::server
