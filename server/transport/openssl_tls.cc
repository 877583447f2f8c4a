#include "server/transport/openssl_tls.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "server/observability/logging.h"

namespace attnserve::server {

// One generation of the files, as OpenSSL objects.
struct OpenSslTls::Material {
  X509* cert = nullptr;
  STACK_OF(X509) * chain = nullptr;
  EVP_PKEY* key = nullptr;
  X509_STORE* client_ca = nullptr;  // null: no mTLS

  ~Material() {
    X509_free(cert);
    sk_X509_pop_free(chain, X509_free);
    EVP_PKEY_free(key);
    X509_STORE_free(client_ca);
  }
};

namespace {

std::string FileStamp(const std::string& path) {
  struct stat st {};
  if (path.empty() || stat(path.c_str(), &st) != 0) return "-";
  return absl::StrCat(st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, "/", st.st_size, "/", st.st_ino);
}

absl::Status FileError(const char* flag, const std::string& path, const char* what) {
  ERR_clear_error();
  return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": ", what));
}

absl::StatusOr<std::unique_ptr<OpenSslTls::Material>> ReadMaterial(const TlsFiles& files) {
  auto material = std::make_unique<OpenSslTls::Material>();
  BIO* bio = BIO_new_file(files.cert.c_str(), "r");
  if (bio == nullptr) return FileError("--tls-cert", files.cert, "cannot read it");
  material->cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  material->chain = sk_X509_new_null();
  while (X509* extra = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) {
    sk_X509_push(material->chain, extra);
  }
  BIO_free(bio);
  if (material->cert == nullptr)
    return FileError("--tls-cert", files.cert, "not a PEM certificate");
  bio = BIO_new_file(files.key.c_str(), "r");
  if (bio == nullptr) return FileError("--tls-key", files.key, "cannot read it");
  material->key = PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  if (material->key == nullptr) return FileError("--tls-key", files.key, "not a PEM private key");
  if (X509_check_private_key(material->cert, material->key) != 1) {
    return FileError("--tls-key", files.key, "does not match --tls-cert");
  }
  if (!files.client_ca.empty()) {
    material->client_ca = X509_STORE_new();
    if (X509_STORE_load_file(material->client_ca, files.client_ca.c_str()) != 1) {
      return FileError("--tls-client-ca", files.client_ca, "not a PEM CA bundle");
    }
  }
  ERR_clear_error();
  return material;
}

}  // namespace

absl::StatusOr<std::unique_ptr<OpenSslTls>> OpenSslTls::Load(const TlsFiles& files) {
  std::unique_ptr<OpenSslTls> tls(new OpenSslTls(files));
  if (absl::Status status = tls->Reload(); !status.ok()) return status;
  return tls;
}

OpenSslTls::~OpenSslTls() = default;

absl::Status OpenSslTls::Reload() {
  const std::string stamp =
      absl::StrCat(FileStamp(files_.cert), FileStamp(files_.key), FileStamp(files_.client_ca));
  absl::StatusOr<std::unique_ptr<Material>> material = ReadMaterial(files_);
  std::lock_guard lock(mu_);
  stamp_ = stamp;  // a bad generation is reported once, not on every handshake
  checked_ = std::chrono::steady_clock::now();
  if (!material.ok()) return material.status();
  material_ = *std::move(material);
  return absl::OkStatus();
}

std::shared_ptr<const OpenSslTls::Material> OpenSslTls::Current() {
  {
    std::lock_guard lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (now - checked_ < std::chrono::seconds(files_.refresh_seconds)) return material_;
    checked_ = now;
    const std::string stamp =
        absl::StrCat(FileStamp(files_.cert), FileStamp(files_.key), FileStamp(files_.client_ca));
    if (stamp == stamp_) return material_;
  }
  if (absl::Status status = Reload(); !status.ok()) {
    // Caught mid-rotation, say: the previous generation stays in force.
    Log(LogLevel::kWarn, "TLS files not reloaded for the HTTP port; the previous ones stay",
        {{"error", std::string(status.message())}});
  } else {
    Log(LogLevel::kInfo, "TLS files reloaded for the HTTP port");
  }
  std::lock_guard lock(mu_);
  return material_;
}

int OpenSslTls::OnCertificate(void* ssl_ptr, void* self_ptr) {
  SSL* ssl = static_cast<SSL*>(ssl_ptr);
  std::shared_ptr<const Material> material = static_cast<OpenSslTls*>(self_ptr)->Current();
  if (SSL_use_cert_and_key(ssl, material->cert, material->key, material->chain, 1) != 1) {
    return 0;
  }
  if (material->client_ca != nullptr && SSL_set1_verify_cert_store(ssl, material->client_ca) != 1) {
    return 0;
  }
  return 1;
}

bool OpenSslTls::Configure(void* ssl_ctx) {
  SSL_CTX* ctx = static_cast<SSL_CTX*>(ssl_ctx);
  if (SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) != 1) return false;
  SSL_CTX_set_cert_cb(
      ctx, [](SSL* ssl, void* self) { return OnCertificate(ssl, self); }, this);
  static const unsigned char kSessionContext[] = "attnserve-http";
  SSL_CTX_set_session_id_context(ctx, kSessionContext, sizeof(kSessionContext) - 1);
  if (!files_.client_ca.empty()) {
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
    STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(files_.client_ca.c_str());
    if (names != nullptr) SSL_CTX_set_client_CA_list(ctx, names);
  } else {
    SSL_CTX_set_verify(ctx, SSL_VERIFY_NONE, nullptr);
  }
  ERR_clear_error();
  return true;
}

}  // namespace attnserve::server
