// What an operator sees of a running server: /metrics after a known sequence of calls, read
// over HTTP from a real server, and the log of a real attnserve process under a flood of bad
// calls (every line JSON, few lines).

#include <signal.h>

#include <chrono>
#include <cmath>
#include <future>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server/scrape.h"
#include "tests/server/test_util.h"

namespace attnserve::server::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

grpc::StatusCode Call(v1::AttentionService::Stub* stub, const v1::ForwardRequest& request) {
  v1::ForwardResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(30));
  return stub->Forward(&context, request, &response).error_code();
}

// The sum of every sample of `name` whose labels include each of `match` (name="value").
double Sum(const std::map<std::string, double>& samples, const std::string& name,
           const std::vector<std::string>& match = {}) {
  double sum = 0;
  for (const auto& [key, value] : samples) {
    if (key != name && key.rfind(name + "{", 0) != 0) continue;
    bool all = true;
    for (const std::string& m : match) all = all && key.find(m) != std::string::npos;
    if (all) sum += value;
  }
  return sum;
}

TEST(MetricsServiceTest, ScrapeAfterAKnownSequenceOfCalls) {
  ServerOptions options;
  ModelConfig demo;
  demo.name = "demo";
  options.models = {demo};
  options.max_queue = 1;
  options.max_batch_tokens = 0;  // one compute run per call: runs are countable
  options.metrics_listen = "127.0.0.1:0";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->metrics_port(), 0);
  auto stub = v1::AttentionService::NewStub(Connect(server->port()));

  // 3 OK calls of 16 tokens; 2 with a width the model does not have; 1 for a missing model.
  for (int i = 0; i < 3; ++i) ASSERT_EQ(Call(stub.get(), DemoRequest(1, 16)), grpc::StatusCode::OK);
  v1::ForwardRequest narrow = DemoRequest(1, 4);
  *narrow.mutable_input() = MakeTensor({1, 4, 7}, std::vector<float>(28, 0.5f), true);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(Call(stub.get(), narrow), grpc::StatusCode::INVALID_ARGUMENT);
  }
  v1::ForwardRequest missing = DemoRequest(1, 4);
  missing.set_model("no-such-model");
  ASSERT_EQ(Call(stub.get(), missing), grpc::StatusCode::NOT_FOUND);

  // 12 heavy calls at once against a queue of 1: some run, the rest find the queue full.
  constexpr int kHeavy = 12;
  std::vector<grpc::StatusCode> codes(kHeavy);
  std::vector<std::thread> threads;
  for (int i = 0; i < kHeavy; ++i) {
    threads.emplace_back([&, i] {
      auto own = v1::AttentionService::NewStub(Connect(server->port()));
      codes[i] = Call(own.get(), DemoRequest(4, 256));
    });
  }
  for (std::thread& t : threads) t.join();
  int heavy_ok = 0, exhausted = 0;
  for (grpc::StatusCode code : codes) {
    heavy_ok += code == grpc::StatusCode::OK;
    exhausted += code == grpc::StatusCode::RESOURCE_EXHAUSTED;
  }
  ASSERT_EQ(heavy_ok + exhausted, kHeavy);
  ASSERT_GE(exhausted, 1);

  const int answered = 3 + 2 + 1 + kHeavy;
  const int computed = 3 + heavy_ok;
  // The client hears the answer as the server records it: wait for the last to land.
  absl::StatusOr<std::map<std::string, double>> s;
  for (int i = 0; i < 100; ++i) {
    s = Scrape(server->metrics_port());
    ASSERT_TRUE(s.ok()) << s.status();
    if (Sum(*s, "attnserve_requests_total") == answered &&
        Sum(*s, "attnserve_compute_duration_seconds_count") == computed) {
      break;
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  const std::string demo_label = "model=\"demo\"";
  EXPECT_EQ(Sum(*s, "attnserve_requests_total"), answered);
  EXPECT_EQ(
      Sum(*s, "attnserve_requests_total", {demo_label, "kind=\"bidirectional\"", "code=\"OK\""}),
      computed);
  EXPECT_EQ(Sum(*s, "attnserve_requests_total", {demo_label, "code=\"INVALID_ARGUMENT\""}), 2);
  EXPECT_EQ(Sum(*s, "attnserve_requests_total", {"model=\"\"", "kind=\"\"", "code=\"NOT_FOUND\""}),
            1);
  EXPECT_EQ(Sum(*s, "attnserve_requests_total", {demo_label, "code=\"RESOURCE_EXHAUSTED\""}),
            exhausted);
  EXPECT_EQ(Sum(*s, "attnserve_tokens_total", {demo_label, "kind=\"bidirectional\""}),
            3 * 16 + heavy_ok * 4 * 256);
  EXPECT_EQ(Sum(*s, "attnserve_request_duration_seconds_count"), answered);
  EXPECT_EQ(Sum(*s, "attnserve_request_duration_seconds_bucket", {"le=\"+Inf\""}), answered);
  // Only calls that were queued waited in the queue, and each ran alone.
  EXPECT_EQ(Sum(*s, "attnserve_queue_duration_seconds_count", {demo_label}), computed);
  EXPECT_EQ(Sum(*s, "attnserve_compute_duration_seconds_count", {demo_label}), computed);
  EXPECT_EQ(Sum(*s, "attnserve_batch_calls_count", {demo_label}), computed);
  EXPECT_EQ(Sum(*s, "attnserve_batch_calls_bucket", {demo_label, "le=\"1\""}), computed);
  EXPECT_EQ(Sum(*s, "attnserve_batch_tokens_sum", {demo_label}), 3 * 16 + heavy_ok * 4 * 256);
  EXPECT_EQ(Sum(*s, "attnserve_queue_depth", {demo_label}), 0);
  EXPECT_EQ(Sum(*s, "attnserve_inflight_requests"), 0);
  EXPECT_EQ(Sum(*s, "attnserve_model_info",
                {demo_label, "layout=\"built_in\"", "d_model=\"256\"", "num_heads=\"4\""}),
            1);
  for (const auto& [key, value] : *s) {
    EXPECT_EQ(key.find("no-such-model"), std::string::npos) << key;
  }
}

// A call whose body is `bytes`, not a ForwardRequest the client library made.
grpc::StatusCode RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& bytes) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + seconds(10));
  grpc::Slice slice(bytes);
  const grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/attnserve.v1.AttentionService/Forward", grpc::StubOptions(), &request,
                 &response, [&done](grpc::Status s) { done.set_value(s); });
  return done.get_future().get().error_code();
}

TEST(LogAbuseTest, AFloodOfBadCallsLeavesFewJsonLines) {
  const std::string port_file = TempPath("abuse.port");
  ChildServer child({"--listen", "127.0.0.1:0", "--port-file", port_file, "--log-format", "json"},
                    TempPath("abuse.log"));
  const int port = child.WaitForPort(port_file, seconds(20));
  ASSERT_GT(port, 0) << child.Output();
  std::shared_ptr<grpc::Channel> channel = Connect(port);
  auto stub = v1::AttentionService::NewStub(channel);

  std::map<grpc::StatusCode, int> seen;
  v1::ForwardRequest narrow = DemoRequest(1, 4);
  *narrow.mutable_input() = MakeTensor({1, 4, 7}, std::vector<float>(28, 0.5f), true);
  for (int i = 0; i < 100; ++i) ++seen[Call(stub.get(), narrow)];
  // Invalid UTF-8 in a proto3 string: protobuf itself complains about each one.
  v1::ForwardRequest bad_utf8 = DemoRequest(1, 4);
  bad_utf8.set_model("\xff\xfe\xc3\x28 model");
  const std::string bad_utf8_bytes = bad_utf8.SerializeAsString();
  for (int i = 0; i < 100; ++i) ++seen[RawCall(channel, bad_utf8_bytes)];
  for (int i = 0; i < 50; ++i) {
    v1::ForwardRequest missing = DemoRequest(1, 4);
    missing.set_model("missing-" + std::to_string(i));
    ++seen[Call(stub.get(), missing)];
  }
  for (int i = 0; i < 50; ++i)
    ++seen[RawCall(channel, "\xff\xff\xff garbage " + std::to_string(i))];
  EXPECT_EQ(seen[grpc::StatusCode::OK], 0);
  EXPECT_GE(seen[grpc::StatusCode::NOT_FOUND], 50);
  EXPECT_GE(seen[grpc::StatusCode::INVALID_ARGUMENT], 150);

  child.Signal(SIGTERM);
  EXPECT_EQ(child.Wait(seconds(20)), 0);
  const std::string output = child.Output();
  std::istringstream lines(output);
  int count = 0;
  std::map<std::string, int64_t> counted;  // by code, from the summary lines
  for (std::string line; std::getline(lines, line);) {
    ++count;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(j.is_object()) << "not JSON: " << line;
    if (j.contains("code") && j.contains("count")) {
      counted[j["code"].get<std::string>()] += j["count"].get<int64_t>();
    }
  }
  // Start-up, shutdown, and at most a couple of lines per code and per library source line;
  // 300 lines would be one per call.
  EXPECT_LE(count, 30) << output;
  // Refusals are counted, not dropped: per code, the summaries add up to what the client saw.
  for (const auto& [code, calls] : seen) {
    const std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
    EXPECT_EQ(counted[name], calls) << name << "\n" << output;
  }
}

}  // namespace
}  // namespace attnserve::server::testing
