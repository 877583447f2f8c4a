#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace attnserve::server {

// Reads a token file: one token a line; blank lines, surrounding spaces and `#` comment lines
// are ignored. Fails when the file cannot be read or holds no token.
absl::StatusOr<std::vector<std::string>> ReadTokenFile(
    const std::string& path, absl::string_view flag = "--auth-token-file");

// True when `a` and `b` are equal, in a time that depends only on the length of `a` (the
// presented token), so a caller cannot learn a token byte by byte from the answer's timing.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// The one place that decides whether a call on the main port is authenticated: gRPC runs it on
// each call's initial metadata, before the request message is read, and fails the call with
// UNAUTHENTICATED when `authorization: Bearer TOKEN` is missing or names no current token.
// Tokens come from a file and are re-read when it changes (ReloadIfChanged) or on demand
// (Reload, on SIGHUP); they are never logged.
class TokenAuthenticator final : public grpc::AuthMetadataProcessor {
 public:
  // Loads the tokens of `path`; fails with the file's problem (never its content).
  // `flag` names the file in messages.
  static absl::StatusOr<std::shared_ptr<TokenAuthenticator>> Load(
      const std::string& path, absl::string_view flag = "--auth-token-file");

  // Re-reads the file. A file that cannot be read or is empty (e.g. caught mid-rotation) keeps
  // the current tokens and returns the problem.
  absl::Status Reload();

  // Re-reads the file when its modification time, size or inode changed since the last read
  // (a Kubernetes Secret rotates by swapping a symlink: a new inode).
  void ReloadIfChanged();

  // How many tokens are accepted now.
  int token_count() const;

  // Whether `presented` is one of the tokens (constant time over them).
  bool Accepts(absl::string_view presented) const;

  // Calls presenting a token of `admin` (--admin-token-file) are let through too, and their
  // header is left on the call for the repository API to check (AdminAuthorizer).
  void AlsoAccept(std::shared_ptr<TokenAuthenticator> admin) { admin_ = std::move(admin); }
  // The check itself, for any protocol: OK when `authorization` (the header's value, absent:
  // nullptr) is `Bearer TOKEN` naming a current token, else Unauthenticated saying what is
  // wrong (never the token). Process (gRPC metadata) and the HTTP frontend both call it.
  absl::Status Check(const absl::string_view* authorization) const;

  // Checks without blocking, on gRPC's own thread.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  TokenAuthenticator(std::string path, absl::string_view flag)
      : path_(std::move(path)), flag_(flag) {}

  // The file's identity (mtime, size, inode), to notice a change without reading it.
  std::string FileStamp() const;

  const std::string path_;
  const std::string flag_;
  mutable std::mutex mu_;
  std::vector<std::string> tokens_;            // guarded by mu_
  std::string stamp_;                          // guarded by mu_
  std::shared_ptr<TokenAuthenticator> admin_;  // set before serving
};

}  // namespace attnserve::server
