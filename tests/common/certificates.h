#pragma once

// Real TLS material for tests, made by the openssl command at test time: a CA, a server
// certificate for localhost / 127.0.0.1 and a client certificate, both signed by the CA.

#include <string>

#include "absl/status/statusor.h"

namespace attnserve::test {

// Paths of the PEM files MakeCertificates wrote, and their contents.
struct Certificates {
  std::string ca_path, server_cert_path, server_key_path, client_cert_path, client_key_path;
  std::string ca, server_cert, server_key, client_cert, client_key;
};

// Writes a fresh CA (named `ca_name`) and the two certificates it signs into `dir` (created
// if missing). Fails when openssl does.
absl::StatusOr<Certificates> MakeCertificates(const std::string& dir,
                                              const std::string& ca_name = "attnserve-test-ca");

// The contents of a file ("" when it cannot be read).
std::string ReadFile(const std::string& path);

}  // namespace attnserve::test
