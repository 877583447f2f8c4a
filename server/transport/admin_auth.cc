#include "server/transport/admin_auth.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace attnserve::server {

bool IsLoopbackPeer(absl::string_view peer) {
  return absl::StartsWith(peer, "ipv4:127.") || absl::StartsWith(peer, "ipv6:[::1]:") ||
         absl::StartsWith(peer, "ipv6:%5B::1%5D:") || absl::StartsWith(peer, "ipv6:[::ffff:127.") ||
         absl::StartsWith(peer, "unix:");
}

absl::Status AdminAuthorizer::Authorize(const grpc::ServerContextBase& context) const {
  const auto& metadata = context.client_metadata();
  const auto header = metadata.find("authorization");
  absl::string_view value;
  if (header != metadata.end()) value = {header->second.data(), header->second.size()};
  return Authorize(context.peer(), header != metadata.end() ? &value : nullptr);
}

absl::Status AdminAuthorizer::Authorize(absl::string_view peer,
                                        const absl::string_view* authorization) const {
  if (tokens_ == nullptr) {
    if (IsLoopbackPeer(peer)) return absl::OkStatus();
    return absl::PermissionDeniedError(
        absl::StrCat("the repository API is served to loopback callers only (the server has no "
                     "--admin-token-file); this call came from ",
                     peer));
  }
  if (authorization != nullptr && absl::StartsWith(*authorization, "Bearer ") &&
      tokens_->Accepts(authorization->substr(7))) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      "the repository API needs an admin token: send 'authorization: Bearer TOKEN' with a "
      "token of --admin-token-file");
}

}  // namespace attnserve::server
