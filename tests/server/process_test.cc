// The real attnserve binary as a process: graceful SIGTERM with calls in flight, start-up
// failures, JSON logs, --help.

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "google/protobuf/descriptor.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server/test_util.h"

namespace attnserve::server::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

TEST(ProcessTest, SigtermFinishesCallsInFlightAndExitsZero) {
  const std::string port_file = TempPath("sigterm.port");
  ChildServer child({"--listen", "127.0.0.1:0", "--port-file", port_file, "--log-level", "trace",
                     "--max-batch-tokens", "0"},
                    TempPath("sigterm.log"));
  const int port = child.WaitForPort(port_file, seconds(20));
  ASSERT_GT(port, 0) << child.Output();

  constexpr int kCalls = 12;
  std::vector<grpc::StatusCode> codes(kCalls, grpc::StatusCode::UNKNOWN);
  // Not vector<bool>: its elements share words, and the callers write them from their threads.
  std::vector<char> answered_correctly(kCalls, 0);
  std::atomic<bool> signalled{false};
  std::vector<std::thread> callers;
  for (int i = 0; i < kCalls; ++i) {
    callers.emplace_back([&, i] {
      auto stub = v1::AttentionService::NewStub(Connect(port));
      if (i >= kCalls / 2) {  // after SIGTERM
        while (!signalled.load()) std::this_thread::sleep_for(milliseconds(5));
      }
      v1::ForwardResponse response;
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + seconds(30));
      const grpc::Status status =
          stub->Forward(&context, DemoRequest(4, 256, v1::ATTENTION_KIND_CAUSAL), &response);
      codes[i] = status.error_code();
      if (status.ok()) {
        const std::string& raw = response.output().raw();
        bool finite = raw.size() == 4 * 256 * 256 * sizeof(float);
        for (size_t k = 0; finite && k < raw.size(); k += 4) {
          float v;
          std::memcpy(&v, raw.data() + k, 4);
          finite = std::isfinite(v);
        }
        answered_correctly[i] = finite;
      }
    });
  }
  // SIGTERM once the first calls are queued or running (the server logs each at trace).
  auto queued = [&child] {
    const std::string out = child.Output();
    int n = 0;
    for (size_t at = out.find("forward queued"); at != std::string::npos;
         at = out.find("forward queued", at + 1)) {
      ++n;
    }
    return n;
  };
  for (int i = 0; i < 1000 && queued() < kCalls / 2; ++i) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(queued(), kCalls / 2);
  child.Signal(SIGTERM);
  // The late calls go once the drain has begun: on a loaded machine they could otherwise all
  // arrive before the signal thread ran.
  child.WaitForOutput("shutting down");
  signalled.store(true);
  for (auto& t : callers) t.join();
  const int exit_code = child.Wait(seconds(30));
  EXPECT_EQ(exit_code, 0) << child.Output();

  int ok = 0;
  for (int i = 0; i < kCalls; ++i) {
    EXPECT_TRUE(codes[i] == grpc::StatusCode::OK || codes[i] == grpc::StatusCode::UNAVAILABLE)
        << "call " << i << " got " << codes[i];
    if (codes[i] == grpc::StatusCode::OK) {
      ++ok;
      EXPECT_TRUE(answered_correctly[i]) << "call " << i;
    }
  }
  EXPECT_GE(ok, 1) << "no call was in flight when SIGTERM came";
  // Calls sent after SIGTERM are refused (one racing the signal's delivery may still be served).
  int refused = 0;
  for (int i = kCalls / 2; i < kCalls; ++i) refused += codes[i] == grpc::StatusCode::UNAVAILABLE;
  EXPECT_GE(refused, 1);
  EXPECT_NE(child.Output().find("shutting down"), std::string::npos) << child.Output();
}

TEST(ProcessTest, AModelThatFailsToLoadStopsStartUpWithTheLoadersMessage) {
  {
    ChildServer child({"--listen", "127.0.0.1:0", "--model", "x=/nonexistent/w.safetensors"},
                      TempPath("missing.log"));
    EXPECT_NE(child.Wait(seconds(20)), 0);
    EXPECT_NE(child.Output().find("/nonexistent/w.safetensors"), std::string::npos)
        << child.Output();
  }
  {
    const std::string garbage = TempPath("garbage.safetensors");
    std::ofstream(garbage) << "this is not a safetensors file";
    ChildServer child({"--listen", "127.0.0.1:0", "--model", "g=" + garbage},
                      TempPath("garbage.log"));
    EXPECT_NE(child.Wait(seconds(20)), 0);
    EXPECT_NE(child.Output().find(garbage), std::string::npos) << child.Output();
  }
  {
    ChildServer child({"--model", "bad-flag-without-path"}, TempPath("badflag.log"));
    EXPECT_NE(child.Wait(seconds(20)), 0);
    EXPECT_NE(child.Output().find("NAME=PATH"), std::string::npos) << child.Output();
  }
}

TEST(ProcessTest, ABusyPortStopsStartUp) {
  const std::string port_file = TempPath("busy.port");
  ChildServer first({"--listen", "127.0.0.1:0", "--port-file", port_file}, TempPath("busy1.log"));
  const int port = first.WaitForPort(port_file, seconds(20));
  ASSERT_GT(port, 0) << first.Output();
  ChildServer second({"--listen", "127.0.0.1:" + std::to_string(port)}, TempPath("busy2.log"));
  EXPECT_NE(second.Wait(seconds(20)), 0) << second.Output();
  EXPECT_NE(second.Output().find("cannot listen"), std::string::npos) << second.Output();
  first.Signal(SIGTERM);
  EXPECT_EQ(first.Wait(seconds(20)), 0);
}

// Holds 0.0.0.0:`port` for as long as it lives (or finds it held already: busy either way).
class PortHolder {
 public:
  explicit PortHolder(int port) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) listen(fd_, 1);
  }
  ~PortHolder() { close(fd_); }

 private:
  int fd_;
};

// The REST and metrics ports left to their defaults may be busy (a second server on the machine):
// the server starts without them, and says so. Named on the command line, even as the default's
// value (as the Kubernetes manifests name them), they must bind.
TEST(ProcessTest, AListenAddressGivenMustBindEvenWhenItIsTheDefault) {
  PortHolder rest(8000), metrics(8002);
  {
    ServerOptions options;  // both left to their defaults
    options.listen = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ((*server)->http_port(), 0);
    EXPECT_EQ((*server)->metrics_port(), 0);
  }
  {
    ChildServer child(
        {"--listen", "127.0.0.1:0", "--metrics-listen", "off", "--http-listen", "0.0.0.0:8000"},
        TempPath("rest-given.log"));
    EXPECT_GT(child.Wait(seconds(20)), 0) << child.Output();  // exited, and not serving
    EXPECT_NE(child.Output().find("cannot listen on 0.0.0.0:8000"), std::string::npos)
        << child.Output();
  }
  {
    ChildServer child(
        {"--listen", "127.0.0.1:0", "--http-listen", "off", "--metrics-listen", "0.0.0.0:8002"},
        TempPath("metrics-given.log"));
    EXPECT_GT(child.Wait(seconds(20)), 0) << child.Output();
    EXPECT_NE(child.Output().find("cannot serve metrics on 0.0.0.0:8002"), std::string::npos)
        << child.Output();
  }
}

TEST(ProcessTest, JsonLogsAreOneObjectPerLine) {
  const std::string port_file = TempPath("json.port");
  ChildServer child({"--listen", "127.0.0.1:0", "--port-file", port_file, "--log-format", "json",
                     "--log-level", "debug"},
                    TempPath("json.log"));
  const int port = child.WaitForPort(port_file, seconds(20));
  ASSERT_GT(port, 0) << child.Output();
  auto stub = v1::AttentionService::NewStub(Connect(port));
  {
    v1::ForwardResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(
        stub->Forward(&context, DemoRequest(1, 8, v1::ATTENTION_KIND_CAUSAL), &response).ok());
  }
  child.Signal(SIGINT);
  EXPECT_EQ(child.Wait(seconds(20)), 0);
  std::istringstream lines(child.Output());
  std::string line;
  bool saw_forward = false, saw_listening = false;
  int count = 0;
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    ++count;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(j.is_object()) << line;
    EXPECT_TRUE(j.contains("ts") && j.contains("level") && j.contains("msg")) << line;
    if (j.value("msg", "") == "forward") {
      saw_forward = true;
      EXPECT_EQ(j.value("model", ""), "demo");
      EXPECT_EQ(j.value("tokens", 0), 8);
    }
    if (j.value("msg", "") == "attnserve listening") {
      saw_listening = true;
      EXPECT_TRUE(j.contains("onednn") && j.contains("isa")) << line;
    }
  }
  EXPECT_GT(count, 2);
  EXPECT_TRUE(saw_forward && saw_listening) << child.Output();
}

TEST(ProcessTest, HelpDocumentsTheModelOptions) {
  ChildServer child({"--help"}, TempPath("help.log"));
  EXPECT_EQ(child.Wait(seconds(20)), 0);
  const std::string help = child.Output();
  for (const char* flag :
       {"--listen", "--model", "num_heads=N", "prefix=P", "precision=f32|bf16", "--threads",
        "--log-level", "--log-format", "--max-message-mib", "--port-file", "--max-queue"}) {
    EXPECT_NE(help.find(flag), std::string::npos) << flag;
  }
}

// A rolling update: 64 callers keep calling through SIGTERM until the process is gone. Each call
// ends OK (computed) or UNAVAILABLE (refused: the one code a retry policy retries, so a client
// moves to another replica), never CANCELLED or anything else, whenever in the drain it
// arrives, including when the listener closes.
TEST(ProcessTest, EveryCallInADrainEndsOkOrUnavailable) {
  const std::string port_file = TempPath("drain.port");
  // No overload shedding: on a slow machine 64 callers could be refused RESOURCE_EXHAUSTED,
  // a right answer but not the one this test looks for. Nor refusals for a deadline (below).
  ChildServer child({"--listen", "127.0.0.1:0", "--port-file", port_file, "--metrics-listen", "off",
                     "--shutdown-grace", "5", "--queue-delay-target-ms", "0"},
                    TempPath("drain.log"));
  const int port = child.WaitForPort(port_file, seconds(20));
  ASSERT_GT(port, 0) << child.Output();
  constexpr int kCallers = 64;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < 8; ++i) channels.push_back(Connect(port));
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::map<grpc::StatusCode, int> codes;
  std::map<std::string, int> odd;  // the messages of codes other than OK and UNAVAILABLE
  std::vector<std::thread> callers;
  for (int i = 0; i < kCallers; ++i) {
    callers.emplace_back([&, i] {
      auto stub = v1::AttentionService::NewStub(channels[i % channels.size()]);
      const v1::ForwardRequest request = DemoRequest(1, 16 << (i % 4));
      while (!stop.load()) {
        grpc::ClientContext context;
        // Far past what the queue can hold: under TSan on a CPU without AVX-512, a run of the
        // 64 calls took long enough that admission refused calls whose 20 s it would pass
        // (DEADLINE_EXCEEDED at once, the right answer to such a call).
        context.set_deadline(std::chrono::system_clock::now() + seconds(120));
        v1::ForwardResponse response;
        const grpc::Status status = stub->Forward(&context, request, &response);
        std::lock_guard lock(mu);
        ++codes[status.error_code()];
        if (!status.ok() && status.error_code() != grpc::StatusCode::UNAVAILABLE) {
          ++odd[std::to_string(status.error_code()) + " " + status.error_message()];
        }
      }
    });
  }
  // The signal comes once the load runs, however slow the machine.
  WaitFor(
      [&] {
        std::lock_guard lock(mu);
        return codes[grpc::StatusCode::OK] > kCallers;
      },
      seconds(20));
  child.Signal(SIGTERM);
  const int exit_code = child.Wait(seconds(30));
  // The callers go on past the exit: calls after it find no server (UNAVAILABLE).
  std::this_thread::sleep_for(milliseconds(300));
  stop.store(true);
  for (auto& t : callers) t.join();
  EXPECT_EQ(exit_code, 0) << child.Output();
  EXPECT_GT(codes[grpc::StatusCode::OK], kCallers) << "the load did not run before the signal";
  EXPECT_GT(codes[grpc::StatusCode::UNAVAILABLE], 0);
  for (const auto& [what, count] : odd) ADD_FAILURE() << count << " calls ended " << what;
}

// grpcurl-style clients find a method by reflection: every service the binary lists must be
// described (its file and methods), grpc.health.v1.Health included, which gRPC serves from
// code of its own rather than from generated descriptors.
TEST(ProcessTest, ReflectionDescribesEveryServiceItLists) {
  const std::string port_file = TempPath("reflection.port");
  ChildServer child(
      {"--listen", "127.0.0.1:0", "--port-file", port_file, "--metrics-listen", "off"},
      TempPath("reflection.log"));
  const int port = child.WaitForPort(port_file, seconds(20));
  ASSERT_GT(port, 0) << child.Output();
  auto stub = grpc::reflection::v1::ServerReflection::NewStub(Connect(port));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(10));
  auto stream = stub->ServerReflectionInfo(&context);
  grpc::reflection::v1::ServerReflectionRequest request;
  grpc::reflection::v1::ServerReflectionResponse response;
  request.set_list_services("*");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> services;
  for (const auto& service : response.list_services_response().service()) {
    services.push_back(service.name());
  }
  EXPECT_NE(std::find(services.begin(), services.end(), "grpc.health.v1.Health"), services.end());
  for (const std::string& service : services) {
    request.set_file_containing_symbol(service);
    ASSERT_TRUE(stream->Write(request));
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_FALSE(response.has_error_response())
        << service << ": " << response.error_response().error_message();
    // Files already sent on this stream are not sent again: the service may be in an earlier
    // reply's file, so only a reply that carries files is searched.
    bool described = response.file_descriptor_response().file_descriptor_proto_size() == 0;
    for (const std::string& bytes : response.file_descriptor_response().file_descriptor_proto()) {
      google::protobuf::FileDescriptorProto file;
      ASSERT_TRUE(file.ParseFromString(bytes));
      for (const auto& described_service : file.service()) {
        described |= file.package() + "." + described_service.name() == service &&
                     described_service.method_size() > 0;
      }
    }
    EXPECT_TRUE(described) << service << " is listed but its methods are not described";
  }
  // The message a health check sends, by name, as grpcurl asks for it.
  request.set_file_containing_symbol("grpc.health.v1.HealthCheckRequest");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_FALSE(response.has_error_response()) << response.error_response().error_message();
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

}  // namespace
}  // namespace attnserve::server::testing
