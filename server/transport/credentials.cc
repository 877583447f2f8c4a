#include "server/transport/credentials.h"

#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpc/grpc_security.h"
#include "grpc/slice.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace attnserve::server {
namespace {

// Reads a PEM file only to refuse a wrong path at start rather than fail every handshake later.
absl::Status CheckPemFile(const std::string& flag, const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read it"));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": not a PEM file"));
  }
  return absl::OkStatus();
}

// What gRPC core's hook is given, and owns (it outlives the C++ credentials, which the server
// builder drops): the processor, set before the port exists and only read after.
struct ProcessorState {
  std::shared_ptr<grpc::AuthMetadataProcessor> processor;
};

void DestroyProcessorState(void* state) { delete static_cast<ProcessorState*>(state); }

// Runs a C++ AuthMetadataProcessor from gRPC core's C hook, synchronously (our processor does
// not block). It gets no AuthContext: a plaintext connection has no peer identity to show.
void ProcessWithCppProcessor(void* state, grpc_auth_context* /*context*/, const grpc_metadata* md,
                             size_t num_md, grpc_process_auth_metadata_done_cb done,
                             void* user_data) {
  grpc::AuthMetadataProcessor* processor = static_cast<ProcessorState*>(state)->processor.get();
  grpc::AuthMetadataProcessor::InputMetadata input;
  auto ref = [](const grpc_slice& s) {
    return grpc::string_ref(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(s)),
                            GRPC_SLICE_LENGTH(s));
  };
  for (size_t i = 0; i < num_md; ++i) input.emplace(ref(md[i].key), ref(md[i].value));
  grpc::AuthMetadataProcessor::OutputMetadata consumed;
  grpc::AuthMetadataProcessor::OutputMetadata response;
  const grpc::Status status = processor->Process(input, nullptr, &consumed, &response);
  // Consumed entries are handed back as the caller's own metadata elements.
  std::vector<grpc_metadata> consumed_md;
  for (size_t i = 0; i < num_md; ++i) {
    auto range = consumed.equal_range(std::string(ref(md[i].key).data(), ref(md[i].key).size()));
    for (auto it = range.first; it != range.second; ++it) {
      if (ref(md[i].value) == grpc::string_ref(it->second)) consumed_md.push_back(md[i]);
    }
  }
  done(user_data, consumed_md.data(), consumed_md.size(), nullptr, 0,
       static_cast<grpc_status_code>(status.error_code()),
       status.ok() ? nullptr : status.error_message().c_str());
}

// Plaintext credentials that still run an auth metadata processor. gRPC C++ 1.51's
// InsecureServerCredentials() cannot take one; gRPC core's insecure credentials can (they go
// through the same server auth filter as TLS). So tokens are checked in the same place, before
// the request is read, whether the port speaks TLS or not (e.g. behind a TLS-terminating
// sidecar).
class PlaintextCredentialsWithAuth final : public grpc::ServerCredentials {
 public:
  PlaintextCredentialsWithAuth() : c_creds_(grpc_insecure_server_credentials_create()) {}
  ~PlaintextCredentialsWithAuth() override { grpc_server_credentials_release(c_creds_); }

  void SetAuthMetadataProcessor(
      const std::shared_ptr<grpc::AuthMetadataProcessor>& processor) override {
    auto state = std::make_unique<ProcessorState>();
    state->processor = processor;
    grpc_server_credentials_set_auth_metadata_processor(
        c_creds_, {ProcessWithCppProcessor, DestroyProcessorState, state.release()});
  }

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    return grpc_server_add_http2_port(server, addr.c_str(), c_creds_);
  }

  grpc_server_credentials* c_creds_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files, std::shared_ptr<grpc::AuthMetadataProcessor> auth) {
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (files.cert.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    if (auth == nullptr) return grpc::InsecureServerCredentials();
    auto creds = std::make_shared<PlaintextCredentialsWithAuth>();
    creds->SetAuthMetadataProcessor(auth);
    return creds;
  }
  if (absl::Status s = CheckPemFile("--tls-cert", files.cert); !s.ok()) return s;
  if (absl::Status s = CheckPemFile("--tls-key", files.key); !s.ok()) return s;
  if (!files.client_ca.empty()) {
    if (absl::Status s = CheckPemFile("--tls-client-ca", files.client_ca); !s.ok()) return s;
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key, files.cert, files.client_ca, files.refresh_seconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.client_ca.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  std::shared_ptr<grpc::ServerCredentials> creds =
      grpc::experimental::TlsServerCredentials(options);
  if (auth != nullptr) creds->SetAuthMetadataProcessor(auth);
  return creds;
}

}  // namespace attnserve::server
