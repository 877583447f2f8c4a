#pragma once

#include <memory>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/server_context.h"
#include "server/transport/token_auth.h"

namespace attnserve::server {

// True for a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") of this
// machine's loopback.
bool IsLoopbackPeer(absl::string_view peer);

// The one place that decides who may use the repository API (load, unload, index): a caller
// presenting `authorization: Bearer TOKEN` with a token of --admin-token-file, or, without that
// file, any caller on loopback. Otherwise PermissionDenied saying which rule refused.
class AdminAuthorizer {
 public:
  // `tokens` null: loopback callers only.
  explicit AdminAuthorizer(std::shared_ptr<TokenAuthenticator> tokens)
      : tokens_(std::move(tokens)) {}

  absl::Status Authorize(const grpc::ServerContextBase& context) const;

  // The same rule for any protocol: `peer` in gRPC's form, `authorization` the header's value
  // (null when absent).
  absl::Status Authorize(absl::string_view peer, const absl::string_view* authorization) const;

 private:
  const std::shared_ptr<TokenAuthenticator> tokens_;
};

}  // namespace attnserve::server
