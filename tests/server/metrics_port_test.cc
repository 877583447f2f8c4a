// The metrics port against what its clients may do, over real sockets on 127.0.0.1: connections
// held open slowly must not stop a scrape, TLS with the main port's certificate, and scrape
// tokens.

#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/http_connection.h"
#include "gtest/gtest.h"
#include "server/observability/metrics.h"
#include "server/options.h"
#include "server/server.h"
#include "tests/common/certificates.h"
#include "tests/server/test_util.h"

namespace attnserve::server {
namespace {

using testing::StartServer;
using testing::TempPath;

// A TCP connection to 127.0.0.1:`port` whose reads and writes give up after 3 s; -1 on failure.
int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  timeval timeout{.tv_sec = 3, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// The text of a GET of `path`, with an Authorization header when `authorization` is set.
std::string GetRequest(const std::string& path, const std::string& authorization = "") {
  return absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                      authorization.empty() ? "" : "Authorization: " + authorization + "\r\n",
                      "Connection: close\r\n\r\n");
}

// Sends `request` in plain HTTP; the whole response, read to the server's close.
absl::StatusOr<std::string> PlainExchange(int port, const std::string& request) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return absl::UnavailableError("cannot connect");
  std::string response;
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
      static_cast<ssize_t>(request.size())) {
    char buffer[16384];
    ssize_t n;
    while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, n);
  }
  close(fd);
  if (response.empty()) return absl::UnavailableError("no response");
  return response;
}

// Sends `request` over TLS, trusting only the CA in `ca_path` and checking that the server's
// certificate names localhost; the whole response.
absl::StatusOr<std::string> TlsExchange(int port, const std::string& request,
                                        const std::string& ca_path) {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()),
                                                        SSL_CTX_free);
  if (ctx == nullptr || SSL_CTX_load_verify_locations(ctx.get(), ca_path.c_str(), nullptr) != 1) {
    return absl::InternalError("client TLS context");
  }
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  const int fd = ConnectLoopback(port);
  if (fd < 0) return absl::UnavailableError("cannot connect");
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), SSL_free);
  SSL_set_fd(ssl.get(), fd);
  SSL_set_tlsext_host_name(ssl.get(), "localhost");
  SSL_set1_host(ssl.get(), "localhost");
  std::string response;
  absl::Status status = absl::OkStatus();
  if (SSL_connect(ssl.get()) != 1) {
    char text[256];
    ERR_error_string_n(ERR_get_error(), text, sizeof(text));
    status = absl::UnavailableError(absl::StrCat("TLS handshake: ", text));
  } else if (SSL_write(ssl.get(), request.data(), static_cast<int>(request.size())) > 0) {
    char buffer[16384];
    int n;
    while ((n = SSL_read(ssl.get(), buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  }
  ERR_clear_error();
  ssl.reset();
  close(fd);
  if (!status.ok()) return status;
  if (response.empty()) return absl::UnavailableError("no response");
  return response;
}

// The status code of an HTTP/1.1 response (0 when it is not one).
int StatusCode(const std::string& response) {
  if (response.size() < 12 || response.compare(0, 9, "HTTP/1.1 ") != 0) return 0;
  return std::atoi(response.substr(9, 3).c_str());
}

class MetricsPortTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<test::Certificates> made = test::MakeCertificates(TempPath("metrics-certs"));
    ASSERT_TRUE(made.ok()) << made.status();
    certs_ = new test::Certificates(*std::move(made));
  }
  static void TearDownTestSuite() { delete certs_; }

  // A server with metrics on 127.0.0.1:0 and the main port's TLS files set.
  static ServerOptions TlsOptions() {
    ServerOptions options;
    options.metrics_listen = "127.0.0.1:0";
    options.tls.cert = certs_->server_cert_path;
    options.tls.key = certs_->server_key_path;
    return options;
  }

  static test::Certificates* certs_;
};

test::Certificates* MetricsPortTest::certs_ = nullptr;

// civetweb's 2 threads answered none of 12 scrapes under this; one polling thread answers each
// at once, and the slow connections stay open meanwhile (they are not simply dropped).
TEST_F(MetricsPortTest, HundredSlowConnectionsDoNotStopAScrape) {
  std::unique_ptr<Metrics> metrics = Metrics::Create();
  metrics->AddModel("enc");
  absl::StatusOr<int> port = metrics->Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  const auto start = std::chrono::steady_clock::now();

  // Half of them idle, half sending one byte of a request head that never ends, every 500 ms.
  constexpr int kSlow = 100;
  std::vector<int> slow;
  for (int i = 0; i < kSlow; ++i) {
    const int fd = ConnectLoopback(*port);
    ASSERT_GE(fd, 0) << "connection " << i;
    slow.push_back(fd);
  }
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    const std::string head = GetRequest("/metrics");
    for (size_t byte = 0; !stop.load(); ++byte) {
      for (int i = 0; i < kSlow; i += 2) send(slow[i], &head[byte % 16], 1, MSG_NOSIGNAL);
      for (int wait = 0; wait < 5 && !stop.load(); ++wait) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  });

  const std::string url = absl::StrCat("http://127.0.0.1:", *port, "/metrics");
  for (int round = 0; round < 4; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    const auto before = std::chrono::steady_clock::now();
    absl::StatusOr<std::string> body = client::HttpGet(url, absl::Seconds(2));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - before).count();
    ASSERT_TRUE(body.ok()) << "round " << round << ": " << body.status();
    EXPECT_NE(body->find("attnserve_queue_depth{model=\"enc\"}"), std::string::npos);
    EXPECT_LT(seconds, 1.0) << "round " << round;
  }
  stop.store(true);
  trickle.join();

  // Within the 5 s a request head may take, the server still holds every slow connection: no
  // byte and no close has come back on any of them.
  if (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(4500)) {
    int open = 0;
    for (int fd : slow) {
      char byte;
      open += recv(fd, &byte, 1, MSG_DONTWAIT) < 0 && errno == EAGAIN;
    }
    EXPECT_EQ(open, kSlow);
  }
  for (int fd : slow) close(fd);
}

TEST_F(MetricsPortTest, TlsWithTheMainPortsCertificateByDefault) {
  std::unique_ptr<Server> server = StartServer(TlsOptions());
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->metrics_port(), 0);
  absl::StatusOr<std::string> response =
      TlsExchange(server->metrics_port(), GetRequest("/metrics"), certs_->ca_path);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(StatusCode(*response), 200) << *response;
  EXPECT_NE(response->find("attnserve_model_info{"), std::string::npos);

  // Plain HTTP gets no answer, and a CA that did not sign the certificate is not trusted.
  absl::StatusOr<std::string> plain = PlainExchange(server->metrics_port(), GetRequest("/metrics"));
  EXPECT_FALSE(plain.ok() && StatusCode(*plain) == 200) << *plain;
  absl::StatusOr<test::Certificates> other =
      test::MakeCertificates(TempPath("metrics-other"), "other-ca");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_FALSE(TlsExchange(server->metrics_port(), GetRequest("/metrics"), other->ca_path).ok());
}

TEST_F(MetricsPortTest, TlsOffServesPlainHttpBesideATlsMainPort) {
  ServerOptions options = TlsOptions();
  options.metrics_tls = "off";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::string> plain = PlainExchange(server->metrics_port(), GetRequest("/metrics"));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(StatusCode(*plain), 200);
}

TEST_F(MetricsPortTest, TlsOnWithoutACertificateIsRefused) {
  ServerOptions options;
  options.metrics_listen = "127.0.0.1:0";
  options.metrics_tls = "on";
  EXPECT_EQ(CheckOptions(options).code(), absl::StatusCode::kInvalidArgument);
  options.metrics_tls = "yes";
  options.tls.cert = certs_->server_cert_path;
  options.tls.key = certs_->server_key_path;
  EXPECT_EQ(CheckOptions(options).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(MetricsPortTest, ScrapeNeedsABearerTokenFromTheFile) {
  const std::string tokens = TempPath("metrics-tokens");
  std::ofstream(tokens) << "# scrapers\nfirst-token\n";
  ServerOptions options;
  options.metrics_listen = "127.0.0.1:0";
  options.metrics_token_file = tokens;
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto code = [&](const std::string& path, const std::string& authorization) {
    absl::StatusOr<std::string> response =
        PlainExchange(server->metrics_port(), GetRequest(path, authorization));
    return response.ok() ? StatusCode(*response) : 0;
  };
  EXPECT_EQ(code("/metrics", ""), 401);
  EXPECT_EQ(code("/metrics", "Bearer wrong-token"), 401);
  EXPECT_EQ(code("/metrics", "Basic Zmlyc3QtdG9rZW4="), 401);
  EXPECT_EQ(code("/metrics", "first-token"), 401);
  EXPECT_EQ(code("/", ""), 401);  // without a token, not even which paths exist
  EXPECT_EQ(code("/metrics", "Bearer first-token"), 200);
  EXPECT_EQ(code("/", "Bearer first-token"), 404);

  // A rotated file is read again at the next scrape.
  std::ofstream(tokens) << "second-token\n";
  EXPECT_EQ(code("/metrics", "Bearer first-token"), 401);
  EXPECT_EQ(code("/metrics", "Bearer second-token"), 200);
}

TEST_F(MetricsPortTest, TokenFileThatCannotBeReadStopsTheStart) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "127.0.0.1:0";
  options.metrics_token_file = TempPath("no-such-token-file");
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(server.status().message().find("--metrics-token-file"), std::string::npos)
      << server.status();
}

TEST_F(MetricsPortTest, OversizedOrMalformedRequestsAreRefused) {
  std::unique_ptr<Metrics> metrics = Metrics::Create();
  absl::StatusOr<int> port = metrics->Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  const std::string huge =
      absl::StrCat("GET /metrics HTTP/1.1\r\nX-Pad: ", std::string(10000, 'x'), "\r\n\r\n");
  absl::StatusOr<std::string> response = PlainExchange(*port, huge);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(StatusCode(*response), 431);
  response = PlainExchange(*port, "NONSENSE\r\n\r\n");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(StatusCode(*response), 400);
  response = PlainExchange(*port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(StatusCode(*response), 405);
}

}  // namespace
}  // namespace attnserve::server
