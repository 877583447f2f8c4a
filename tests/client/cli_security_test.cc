// attnserve-client against a real attnserve that serves mTLS and asks for a bearer token
// (certificates made by openssl at test time): every subcommand, bench included, connects with
// --tls-ca/--tls-cert/--tls-key and takes the token from --token or ATTNSERVE_TOKEN.
#include <cstdlib>
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/client/process.h"
#include "tests/common/certificates.h"
#include "tests/common/temp_dir.h"

namespace attnserve::test {
namespace {

constexpr char kToken[] = "cli-test-token";
constexpr int kUnauthenticated = 16;
constexpr int kUnavailable = 14;

class SecureServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = MakeTempDir("client");
    absl::StatusOr<Certificates> made = MakeCertificates(dir);
    ASSERT_TRUE(made.ok()) << made.status();
    certs_ = new Certificates(*std::move(made));
    std::ofstream(dir + "/tokens") << kToken << "\n";
    absl::StatusOr<std::unique_ptr<ServerProcess>> started = ServerProcess::Start(
        ATTNSERVE_SERVER_BIN, {"--threads", "2", "--tls-cert", certs_->server_cert_path,
                               "--tls-key", certs_->server_key_path, "--tls-client-ca",
                               certs_->ca_path, "--auth-token-file", dir + "/tokens"});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = started->release();
    // The certificate names localhost; the process helper reports 127.0.0.1 (also named).
    target_ = server_->target();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete certs_;
  }
  void TearDown() override { unsetenv("ATTNSERVE_TOKEN"); }

  // attnserve-client with mTLS flags, then `args`.
  static ProgramResult Client(std::vector<std::string> args, bool client_cert = true) {
    std::vector<std::string> argv = {
        ATTNSERVE_CLIENT_BIN, "--target", target_, "--timeout", "30", "--tls-ca", certs_->ca_path};
    if (client_cert) {
      argv.insert(argv.end(),
                  {"--tls-cert", certs_->client_cert_path, "--tls-key", certs_->client_key_path});
    }
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProgram(argv);
  }

  static std::string Describe(const ProgramResult& r) {
    return absl::StrCat("exit ", r.exit_code, "\nstdout:\n", r.out, "\nstderr:\n", r.err,
                        "\nserver:\n", server_->Log());
  }

  static Certificates* certs_;
  static ServerProcess* server_;
  static std::string target_;
};

Certificates* SecureServerTest::certs_ = nullptr;
ServerProcess* SecureServerTest::server_ = nullptr;
std::string SecureServerTest::target_;

TEST_F(SecureServerTest, EverySubcommandWorksWithTheTokenFromTheEnvironment) {
  setenv("ATTNSERVE_TOKEN", kToken, 1);
  ProgramResult r = Client({"models"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("demo"), std::string::npos) << Describe(r);
  r = Client({"health"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = Client({"infer", "--random", "2,8", "--kind", "causal"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = Client({"bench", "--random", "1,8", "--requests", "20", "--concurrency", "2", "--json"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
}

TEST_F(SecureServerTest, TokenFlagWorksAndAMissingOrWrongTokenIsUnauthenticated) {
  ProgramResult r = Client({"--token", kToken, "models"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = Client({"models"});
  EXPECT_EQ(r.exit_code, kUnauthenticated) << Describe(r);
  r = Client({"--token", "not-the-token", "bench", "--random", "1,8", "--requests", "5"});
  EXPECT_EQ(r.exit_code, kUnauthenticated) << Describe(r);
}

TEST_F(SecureServerTest, WithoutTheClientCertificateOrTlsTheCallDoesNotConnect) {
  ProgramResult r = Client({"--token", kToken, "models"}, /*client_cert=*/false);
  EXPECT_EQ(r.exit_code, kUnavailable) << Describe(r);
  r = RunProgram(
      {ATTNSERVE_CLIENT_BIN, "--target", target_, "--timeout", "30", "--token", kToken, "models"});
  EXPECT_EQ(r.exit_code, kUnavailable) << Describe(r);
  r = RunProgram(
      {ATTNSERVE_CLIENT_BIN, "--target", target_, "--tls-ca", "/no/such/ca.pem", "models"});
  EXPECT_EQ(r.exit_code, 3) << Describe(r);  // INVALID_ARGUMENT, before any call
}

}  // namespace
}  // namespace attnserve::test
