#include "tests/common/certificates.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace attnserve::test {
namespace {

absl::Status Run(const std::string& dir, const std::string& command) {
  const std::string line = absl::StrCat("cd '", dir, "' && ", command, " >openssl.log 2>&1");
  if (std::system(line.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("openssl failed: ", command, "\n", ReadFile(dir + "/openssl.log")));
  }
  return absl::OkStatus();
}

// A key and a certificate `name` for `subject`, signed by the CA in the same folder.
absl::Status Issue(const std::string& dir, const std::string& name, const std::string& subject,
                   const std::string& extensions) {
  if (absl::Status s = Run(dir, absl::StrCat("openssl req -newkey rsa:2048 -nodes -keyout ", name,
                                             ".key -out ", name, ".csr -subj ", subject));
      !s.ok()) {
    return s;
  }
  std::ofstream(dir + "/" + name + ".ext") << extensions << "\n";
  return Run(dir, absl::StrCat("openssl x509 -req -in ", name,
                               ".csr -CA ca.pem -CAkey ca.key "
                               "-CAcreateserial -days 2 -out ",
                               name, ".pem -extfile ", name, ".ext"));
}

}  // namespace

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<Certificates> MakeCertificates(const std::string& dir, const std::string& ca_name) {
  std::filesystem::create_directories(dir);
  if (absl::Status s = Run(dir, absl::StrCat("openssl req -x509 -newkey rsa:2048 -nodes "
                                             "-keyout ca.key -out ca.pem -days 2 -subj /CN=",
                                             ca_name));
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          Issue(dir, "server", "/CN=localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1");
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          Issue(dir, "client", "/CN=attnserve-test-client", "extendedKeyUsage=clientAuth");
      !s.ok()) {
    return s;
  }
  Certificates c;
  c.ca_path = dir + "/ca.pem";
  c.server_cert_path = dir + "/server.pem";
  c.server_key_path = dir + "/server.key";
  c.client_cert_path = dir + "/client.pem";
  c.client_key_path = dir + "/client.key";
  c.ca = ReadFile(c.ca_path);
  c.server_cert = ReadFile(c.server_cert_path);
  c.server_key = ReadFile(c.server_key_path);
  c.client_cert = ReadFile(c.client_cert_path);
  c.client_key = ReadFile(c.client_key_path);
  return c;
}

}  // namespace attnserve::test
