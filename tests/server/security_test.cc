// Transport security on real servers at 127.0.0.1:0 with openssl-made certificates: TLS, mTLS,
// certificate rotation, bearer tokens (TLS and plaintext), the plaintext health-only port and
// server reflection v1.

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "google/protobuf/descriptor.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "tests/common/certificates.h"
#include "tests/server/test_util.h"

namespace attnserve::server::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr char kToken[] = "s3cret-token-for-tests";
constexpr char kOtherToken[] = "second-token";

// A channel to 127.0.0.1:`port` over TLS trusting `ca`, with a client certificate when given.
std::shared_ptr<grpc::Channel> TlsChannel(int port, const std::string& ca,
                                          const std::string& client_cert = "",
                                          const std::string& client_key = "") {
  grpc::SslCredentialsOptions tls;
  tls.pem_root_certs = ca;
  tls.pem_cert_chain = client_cert;
  tls.pem_private_key = client_key;
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);  // rotation test reconnects
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), grpc::SslCredentials(tls),
                                   args);
}

void Prepare(grpc::ClientContext* context, const std::string& token) {
  context->set_deadline(std::chrono::system_clock::now() + seconds(10));
  if (!token.empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
}

grpc::StatusCode ListModelsCode(grpc::Channel* channel, const std::string& token = "") {
  auto stub = v1::AttentionService::NewStub(channel->shared_from_this());
  grpc::ClientContext context;
  Prepare(&context, token);
  v1::ListModelsResponse response;
  return stub->ListModels(&context, {}, &response).error_code();
}

grpc::StatusCode ForwardCode(grpc::Channel* channel, const std::string& token = "") {
  auto stub = v1::AttentionService::NewStub(channel->shared_from_this());
  grpc::ClientContext context;
  Prepare(&context, token);
  v1::ForwardRequest request;
  request.set_kind(v1::ATTENTION_KIND_CAUSAL);
  *request.mutable_input() = MakeTensor({1, 4, 256}, std::vector<float>(4 * 256, 0.25f), true);
  v1::ForwardResponse response;
  const grpc::Status status = stub->Forward(&context, request, &response);
  if (status.ok() && response.output().raw().size() != 4 * 256 * sizeof(float)) {
    return grpc::StatusCode::INTERNAL;  // answered, but not with the output asked for
  }
  return status.error_code();
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<test::Certificates> made = test::MakeCertificates(TempPath("certs"));
    ASSERT_TRUE(made.ok()) << made.status();
    certs_ = new test::Certificates(*std::move(made));
  }
  static void TearDownTestSuite() { delete certs_; }

  static ServerOptions TlsOptions(bool mtls) {
    ServerOptions options;
    options.tls.cert = certs_->server_cert_path;
    options.tls.key = certs_->server_key_path;
    if (mtls) options.tls.client_ca = certs_->ca_path;
    return options;
  }

  static std::string WriteTokens(const std::string& name, const std::string& content) {
    const std::string path = TempPath(name);
    std::ofstream(path) << content;
    return path;
  }

  static test::Certificates* certs_;
};

test::Certificates* SecurityTest::certs_ = nullptr;

TEST_F(SecurityTest, TlsServerRefusesPlaintextAndAnswersCallerTrustingItsCa) {
  std::unique_ptr<Server> server = StartServer(TlsOptions(/*mtls=*/false));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(ListModelsCode(Connect(server->port()).get()), grpc::StatusCode::UNAVAILABLE);
  auto tls = TlsChannel(server->port(), certs_->ca);
  EXPECT_EQ(ListModelsCode(tls.get()), grpc::StatusCode::OK);
  EXPECT_EQ(ForwardCode(tls.get()), grpc::StatusCode::OK);
  // A CA that did not sign the server's certificate is not trusted.
  absl::StatusOr<test::Certificates> other = test::MakeCertificates(TempPath("other"), "other-ca");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(ListModelsCode(TlsChannel(server->port(), other->ca).get()),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(SecurityTest, MutualTlsNeedsAClientCertificateSignedByTheClientCa) {
  std::unique_ptr<Server> server = StartServer(TlsOptions(/*mtls=*/true));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(ListModelsCode(TlsChannel(server->port(), certs_->ca).get()),
            grpc::StatusCode::UNAVAILABLE);
  auto with_cert = TlsChannel(server->port(), certs_->ca, certs_->client_cert, certs_->client_key);
  EXPECT_EQ(ListModelsCode(with_cert.get()), grpc::StatusCode::OK);
  EXPECT_EQ(ForwardCode(with_cert.get()), grpc::StatusCode::OK);
}

TEST_F(SecurityTest, ServerCertificateRotatesWithoutRestart) {
  // Serve copies, so the rotation below does not touch the suite's files.
  const std::string cert = TempPath("rotating.pem");
  const std::string key = TempPath("rotating.key");
  std::filesystem::copy_file(certs_->server_cert_path, cert);
  std::filesystem::copy_file(certs_->server_key_path, key);
  ServerOptions options;
  options.tls = {.cert = cert, .key = key, .client_ca = "", .refresh_seconds = 1};
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(ListModelsCode(TlsChannel(server->port(), certs_->ca).get()), grpc::StatusCode::OK);

  absl::StatusOr<test::Certificates> next = test::MakeCertificates(TempPath("next"), "next-ca");
  ASSERT_TRUE(next.ok()) << next.status();
  // Key first, then certificate, each by rename: the watcher never reads half a file.
  std::filesystem::copy_file(next->server_key_path, key + ".new");
  std::filesystem::copy_file(next->server_cert_path, cert + ".new");
  std::filesystem::rename(key + ".new", key);
  std::filesystem::rename(cert + ".new", cert);
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  const auto end = std::chrono::steady_clock::now() + seconds(10);
  while (code != grpc::StatusCode::OK && std::chrono::steady_clock::now() < end) {
    code = ListModelsCode(TlsChannel(server->port(), next->ca).get());
    if (code != grpc::StatusCode::OK) std::this_thread::sleep_for(milliseconds(200));
  }
  EXPECT_EQ(code, grpc::StatusCode::OK) << "new certificate not served within 10 s";
  EXPECT_EQ(ListModelsCode(TlsChannel(server->port(), certs_->ca).get()),
            grpc::StatusCode::UNAVAILABLE);
}

// Tokens over TLS (the auth processor on TLS credentials) and over plaintext (on gRPC core's
// insecure credentials): the same answers.
class TokenTest : public SecurityTest, public ::testing::WithParamInterface<bool> {
 protected:
  bool tls() const { return GetParam(); }
  std::shared_ptr<grpc::Channel> Channel(int port) const {
    return tls() ? TlsChannel(port, certs_->ca) : Connect(port);
  }
};

TEST_P(TokenTest, EveryCallNeedsAKnownBearerToken) {
  ServerOptions options = tls() ? TlsOptions(false) : ServerOptions{};
  options.auth_token_file =
      WriteTokens("tokens", absl::StrCat("# comment\n", kToken, "\n\n  ", kOtherToken, "  \n"));
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto channel = Channel(server->port());
  for (const std::string bad : {"", "wrong", "s3cret-token-for-test", "s3cret-token-for-tests2"}) {
    EXPECT_EQ(ListModelsCode(channel.get(), bad), grpc::StatusCode::UNAUTHENTICATED) << bad;
    EXPECT_EQ(ForwardCode(channel.get(), bad), grpc::StatusCode::UNAUTHENTICATED) << bad;
  }
  EXPECT_EQ(ListModelsCode(channel.get(), kToken), grpc::StatusCode::OK);
  EXPECT_EQ(ForwardCode(channel.get(), kToken), grpc::StatusCode::OK);
  EXPECT_EQ(ForwardCode(channel.get(), kOtherToken), grpc::StatusCode::OK);
  // Not "Bearer": refused too.
  auto stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Basic ", kToken));
  v1::ListModelsResponse response;
  EXPECT_EQ(stub->ListModels(&context, {}, &response).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // Health and reflection on the main port are calls like any other.
  EXPECT_EQ(HealthCheck(channel.get(), "").status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_P(TokenTest, ChangedTokenFileIsReadWithoutRestart) {
  ServerOptions options = tls() ? TlsOptions(false) : ServerOptions{};
  options.auth_token_file = WriteTokens(tls() ? "rotate-tls" : "rotate-plain", kToken);
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto channel = Channel(server->port());
  ASSERT_EQ(ListModelsCode(channel.get(), kToken), grpc::StatusCode::OK);
  // As a Secret update does: a new file renamed over the old one.
  WriteTokens("new-tokens", kOtherToken);
  std::filesystem::rename(TempPath("new-tokens"), options.auth_token_file);
  const auto end = std::chrono::steady_clock::now() + seconds(5);
  while (ListModelsCode(channel.get(), kOtherToken) != grpc::StatusCode::OK &&
         std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(milliseconds(100));
  }
  EXPECT_EQ(ListModelsCode(channel.get(), kOtherToken), grpc::StatusCode::OK);
  EXPECT_EQ(ListModelsCode(channel.get(), kToken), grpc::StatusCode::UNAUTHENTICATED);
  // An emptied file (a rotation caught half way) keeps the tokens in force.
  std::ofstream(options.auth_token_file, std::ios::trunc).close();
  server->ReloadTokens();
  EXPECT_EQ(ListModelsCode(channel.get(), kOtherToken), grpc::StatusCode::OK);
}

// The token is checked on the call's headers, before its body is read: a body that is not a
// ForwardRequest at all is refused UNAUTHENTICATED without a token, and only with the token
// does decoding get to say INVALID_ARGUMENT.
TEST_P(TokenTest, RefusalComesBeforeTheBodyIsDecoded) {
  ServerOptions options = tls() ? TlsOptions(false) : ServerOptions{};
  options.auth_token_file = WriteTokens(tls() ? "decode-tls" : "decode-plain", kToken);
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  grpc::GenericStub stub(Channel(server->port()));
  auto call = [&stub](const std::string& token) {
    grpc::ClientContext context;
    Prepare(&context, token);
    grpc::Slice garbage(std::string(64 * 1024, '\xff'));
    const grpc::ByteBuffer request(&garbage, 1);
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, "/attnserve.v1.AttentionService/Forward", grpc::StubOptions(),
                   &request, &response, [&done](grpc::Status s) { done.set_value(s); });
    return done.get_future().get().error_code();
  };
  EXPECT_EQ(call(""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call("wrong"), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call(kToken), grpc::StatusCode::INVALID_ARGUMENT);
}

INSTANTIATE_TEST_SUITE_P(TlsAndPlaintext, TokenTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Tls" : "Plaintext"; });

TEST_F(SecurityTest, StartRefusesMissingOrHalfConfiguredSecurity) {
  ServerOptions options;
  options.tls.cert = certs_->server_cert_path;  // no key
  EXPECT_EQ(Server::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = TlsOptions(false);
  options.tls.key = TempPath("no-such.key");
  EXPECT_EQ(Server::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options = ServerOptions{};
  options.listen = "127.0.0.1:0";
  options.auth_token_file = WriteTokens("empty-tokens", "# only a comment\n\n");
  EXPECT_EQ(Server::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SecurityTest, HealthPortIsPlaintextHealthOnlyAndFollowsServingStatus) {
  // The main port asks for TLS, mTLS and a token: the health port asks for nothing.
  ServerOptions options = TlsOptions(/*mtls=*/true);
  options.auth_token_file = WriteTokens("health-tokens", kToken);
  options.health_listen = "127.0.0.1:0";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->health_port(), 0);
  auto health = Connect(server->health_port());
  EXPECT_EQ(HealthCheck(health.get(), "").value_or(-1), 1);  // SERVING
  EXPECT_EQ(HealthCheck(health.get(), kServiceName).value_or(-1), 1);
  EXPECT_EQ(ForwardCode(health.get(), kToken), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(ListModelsCode(health.get(), kToken), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(ReflectionServices(health.get()).status().code(), absl::StatusCode::kUnavailable);

  // While the server drains (and its lame duck lasts), probes see NOT_SERVING.
  std::thread shutdown([&server] { server->Shutdown(seconds(5), milliseconds(1500)); });
  int status = 1;
  const auto end = std::chrono::steady_clock::now() + seconds(1);
  while (status == 1 && std::chrono::steady_clock::now() < end) {
    status = HealthCheck(health.get(), "").value_or(-1);
  }
  EXPECT_EQ(status, 2);  // NOT_SERVING
  shutdown.join();
}

TEST_F(SecurityTest, ReflectionV1ListsServicesAndDescribesThem) {
  std::unique_ptr<Server> server = StartServer({});
  ASSERT_NE(server, nullptr);
  auto stub = grpc::reflection::v1::ServerReflection::NewStub(Connect(server->port()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(10));
  auto stream = stub->ServerReflectionInfo(&context);
  grpc::reflection::v1::ServerReflectionRequest request;
  request.set_list_services("*");
  ASSERT_TRUE(stream->Write(request));
  grpc::reflection::v1::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> names;
  for (const auto& service : response.list_services_response().service()) {
    names.push_back(service.name());
  }
  for (const char* expected : {kServiceName, "grpc.reflection.v1.ServerReflection",
                               "grpc.reflection.v1alpha.ServerReflection"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  }

  request.set_file_containing_symbol(kServiceName);
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_TRUE(response.has_file_descriptor_response()) << response.DebugString();
  bool found = false;
  for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
    google::protobuf::FileDescriptorProto file;
    ASSERT_TRUE(file.ParseFromString(bytes));
    for (const auto& service : file.service()) {
      if (file.package() == "attnserve.v1" && service.name() == "AttentionService") {
        found = service.method_size() >= 2;
      }
    }
  }
  EXPECT_TRUE(found) << "no attnserve.v1.AttentionService with its methods in the reply";

  request.set_file_containing_symbol("no.such.Symbol");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.error_response().error_code(), grpc::StatusCode::NOT_FOUND);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

}  // namespace
}  // namespace attnserve::server::testing
