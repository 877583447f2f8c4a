#include "server/transport/token_auth.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/observability/logging.h"

namespace attnserve::server {
namespace {

constexpr absl::string_view kBearer = "Bearer ";

}  // namespace

absl::StatusOr<std::vector<std::string>> ReadTokenFile(const std::string& path,
                                                       absl::string_view flag) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read it"));
  std::vector<std::string> tokens;
  std::string line;
  while (std::getline(in, line)) {
    const absl::string_view token = absl::StripAsciiWhitespace(line);
    if (token.empty() || token.front() == '#') continue;
    tokens.emplace_back(token);
  }
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": read error"));
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": holds no token"));
  }
  return tokens;
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Every byte of `a` is compared, whatever differs first; a length mismatch only shows in the
  // result. Volatile keeps the compiler from turning the loop into an early-exit memcmp.
  volatile unsigned char diff = a.size() != b.size() ? 1 : 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const unsigned char other = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = diff | (static_cast<unsigned char>(a[i]) ^ other);
  }
  return diff == 0;
}

absl::StatusOr<std::shared_ptr<TokenAuthenticator>> TokenAuthenticator::Load(
    const std::string& path, absl::string_view flag) {
  std::shared_ptr<TokenAuthenticator> auth(new TokenAuthenticator(path, flag));
  if (absl::Status status = auth->Reload(); !status.ok()) return status;
  return auth;
}

std::string TokenAuthenticator::FileStamp() const {
  struct stat st {};
  if (stat(path_.c_str(), &st) != 0) return "";
  return absl::StrCat(st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, "/", st.st_size, "/", st.st_ino);
}

absl::Status TokenAuthenticator::Reload() {
  const std::string stamp = FileStamp();
  absl::StatusOr<std::vector<std::string>> tokens = ReadTokenFile(path_, flag_);
  std::lock_guard lock(mu_);
  stamp_ = stamp;  // a bad file is reported once, not on every poll
  if (!tokens.ok()) return tokens.status();
  tokens_ = *std::move(tokens);
  return absl::OkStatus();
}

void TokenAuthenticator::ReloadIfChanged() {
  {
    std::lock_guard lock(mu_);
    if (FileStamp() == stamp_) return;
  }
  if (absl::Status status = Reload(); !status.ok()) {
    Log(LogLevel::kWarn, "auth tokens not reloaded; the previous ones stay in force",
        {{"error", std::string(status.message())}});
    return;
  }
  Log(LogLevel::kInfo, "auth tokens reloaded", {{"tokens", token_count()}});
}

int TokenAuthenticator::token_count() const {
  std::lock_guard lock(mu_);
  return static_cast<int>(tokens_.size());
}

bool TokenAuthenticator::Accepts(absl::string_view presented) const {
  bool match = false;
  std::lock_guard lock(mu_);
  // No early exit: the time does not tell which token (or whether any) matched.
  for (const std::string& token : tokens_) match |= ConstantTimeEquals(presented, token);
  return match;
}

absl::Status TokenAuthenticator::Check(const absl::string_view* authorization) const {
  if (authorization == nullptr) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer TOKEN' metadata");
  }
  if (!absl::StartsWith(*authorization, kBearer)) {
    return absl::UnauthenticatedError("the authorization metadata must be 'Bearer TOKEN'");
  }
  const absl::string_view presented = authorization->substr(kBearer.size());
  // An admin token is let through too: the repository API (AdminAuthorizer) checks it again.
  if (!Accepts(presented) && (admin_ == nullptr || !admin_->Accepts(presented))) {
    return absl::UnauthenticatedError("unknown bearer token");
  }
  return absl::OkStatus();
}

grpc::Status TokenAuthenticator::Process(const InputMetadata& auth_metadata,
                                         grpc::AuthContext* /*context*/,
                                         OutputMetadata* consumed_auth_metadata,
                                         OutputMetadata* /*response_metadata*/) {
  auto header = auth_metadata.find("authorization");
  absl::string_view value;
  if (header != auth_metadata.end()) value = {header->second.data(), header->second.size()};
  // An admin token passes and stays on the call: the repository API checks it again.
  if (admin_ != nullptr && absl::StartsWith(value, kBearer) &&
      admin_->Accepts(value.substr(kBearer.size()))) {
    return grpc::Status::OK;
  }
  const absl::Status status = Check(header != auth_metadata.end() ? &value : nullptr);
  if (!status.ok()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(status.message()));
  }
  // Handlers never see the token, so nothing downstream can log it.
  consumed_auth_metadata->emplace("authorization", std::string(value));
  return grpc::Status::OK;
}

}  // namespace attnserve::server
