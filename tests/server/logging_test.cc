// The log as an operator reads it: floods summarised (LogSummarizer), and gRPC's and
// protobuf's own lines written by our logger, as JSON and at our level.

#include "server/observability/logging.h"

#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "attnserve/v1/attention.pb.h"
#include "grpc/support/log.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/observability/log_setup.h"
#include "server/observability/log_summary.h"
#include "server/serving/call_reporter.h"
#include "tests/server/test_util.h"

namespace attnserve::server {
namespace {

using testing::Connect;
using testing::DemoRequest;
using testing::StartServer;

// Every line of `text` parsed as JSON (a line that is not JSON fails the test).
std::vector<nlohmann::json> JsonLines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    EXPECT_TRUE(parsed.is_object()) << "not a JSON object: " << line;
    if (parsed.is_object()) lines.push_back(parsed);
  }
  return lines;
}

class LoggingTest : public ::testing::Test {
 protected:
  void TearDown() override { InitLogging(LogLevel::kOff, LogFormat::kText); }
};

TEST_F(LoggingTest, SummarizerWritesOneLinePerKeyPerInterval) {
  InitLogging(LogLevel::kInfo, LogFormat::kJson);
  ::testing::internal::CaptureStderr();
  {
    LogSummarizer summarizer(std::chrono::milliseconds(300));
    for (int i = 0; i < 100; ++i) {
      summarizer.Add(LogLevel::kInfo, "NOT_FOUND", "forward refused",
                     {{"code", "NOT_FOUND"}, {"error", "model " + std::to_string(i)}});
    }
    for (int i = 0; i < 50; ++i) {
      summarizer.Add(LogLevel::kWarn, "INTERNAL", "forward failed",
                     {{"code", "INTERNAL"}, {"error", "boom " + std::to_string(i)}});
    }
    // The thread writes the counts once the interval has passed.
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
  }
  const std::vector<nlohmann::json> lines = JsonLines(::testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 4u);
  // The first of each key at once, with its own example.
  EXPECT_EQ(lines[0]["msg"], "forward refused");
  EXPECT_EQ(lines[0]["level"], "info");
  EXPECT_EQ(lines[0]["count"], 1);
  EXPECT_EQ(lines[0]["error"], "model 0");
  EXPECT_EQ(lines[1]["msg"], "forward failed");
  EXPECT_EQ(lines[1]["level"], "warning");
  EXPECT_EQ(lines[1]["count"], 1);
  // Then the rest, counted, with the first of them as the example.
  int64_t refused = 0;
  int64_t failed = 0;
  for (size_t i = 2; i < 4; ++i) {
    if (lines[i]["code"] == "NOT_FOUND") {
      refused = lines[i]["count"];
      EXPECT_EQ(lines[i]["error"], "model 1");
    } else {
      failed = lines[i]["count"];
      EXPECT_EQ(lines[i]["error"], "boom 1");
    }
    EXPECT_GE(lines[i]["seconds"].get<double>(), 0.3);
  }
  EXPECT_EQ(refused, 99);
  EXPECT_EQ(failed, 49);
}

// A decode session's refused or failed message is logged as a failed call is: a warning for what
// needs the operator (a limit reached), information for a caller's mistake, nothing when it ran.
TEST_F(LoggingTest, RefusedSessionMessagesAreLoggedAsFailedCallsAre) {
  InitLogging(LogLevel::kInfo, LogFormat::kJson);
  ::testing::internal::CaptureStderr();
  {
    CallReporter reporter;
    reporter.SessionMessageAnswered("m", absl::OkStatus());
    reporter.SessionMessageAnswered(
        "m", absl::ResourceExhaustedError("all 8 sessions --max-sessions allows are open"));
    reporter.SessionMessageAnswered("m", absl::InvalidArgumentError("truncate_to 9 is past"));
    reporter.FlushLog();
  }
  const std::vector<nlohmann::json> lines = JsonLines(::testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["msg"], "session message failed");
  EXPECT_EQ(lines[0]["level"], "warning");
  EXPECT_EQ(lines[0]["code"], "RESOURCE_EXHAUSTED");
  EXPECT_EQ(lines[0]["model"], "m");
  EXPECT_EQ(lines[1]["level"], "info");
  EXPECT_EQ(lines[1]["code"], "INVALID_ARGUMENT");
}

// In text lines, a value a caller chose (a model name) cannot write control codes, broken UTF-8
// or a fake field: anything but plain printable ASCII is quoted with JSON's escapes.
TEST_F(LoggingTest, TextValuesWithControlCodesOrInvalidUtf8AreQuotedAndEscaped) {
  InitLogging(LogLevel::kInfo, LogFormat::kText);
  ::testing::internal::CaptureStderr();
  Log(LogLevel::kInfo, "forward failed",
      {{"code", "NOT_FOUND"},
       {"model", std::string("\xff\xfe\x1b[31mred")},
       {"spoof", "a code=OK"},
       {"name", "caf\xc3\xa9"}});
  const std::string line = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(line.find(" code=NOT_FOUND"), std::string::npos) << line;
  EXPECT_EQ(line.find('\x1b'), std::string::npos) << "a raw escape code was written";
  EXPECT_EQ(line.find('\xff'), std::string::npos) << "invalid UTF-8 was written";
  EXPECT_NE(line.find("\\u001b[31mred"), std::string::npos) << line;
  EXPECT_NE(line.find(" spoof=\"a code=OK\""), std::string::npos) << line;
  EXPECT_NE(line.find(" name=\"caf\xc3\xa9\""), std::string::npos) << line;
}

// A call naming no model the server has is logged with the name it sent (clipped), though its
// metrics count it under "" (a client's text is never a label).
TEST_F(LoggingTest, ACallToAnUnknownModelIsLoggedWithTheNameItSent) {
  const ServerOptions options;  // the built-in demo model
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  InitLogging(LogLevel::kInfo, LogFormat::kJson);  // after StartServer's (quiet) set-up
  ::testing::internal::CaptureStderr();
  {
    auto stub = v1::AttentionService::NewStub(Connect(server->port()));
    v1::ForwardRequest request = DemoRequest(1, 4, v1::ATTENTION_KIND_CAUSAL);
    request.set_model("no-such-model");
    v1::ForwardResponse response;
    grpc::ClientContext context;
    EXPECT_EQ(stub->Forward(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
    server.reset();  // its reporter writes what it still counts
  }
  const std::vector<nlohmann::json> lines = JsonLines(::testing::internal::GetCapturedStderr());
  int found = 0;
  for (const nlohmann::json& line : lines) {
    if (line.value("msg", "") != "forward failed") continue;
    ++found;
    EXPECT_EQ(line.value("model", ""), "no-such-model") << line;
    EXPECT_EQ(line.value("code", ""), "NOT_FOUND") << line;
  }
  EXPECT_EQ(found, 1);
}

TEST_F(LoggingTest, SummarizerWritesEachEventAtDebug) {
  InitLogging(LogLevel::kDebug, LogFormat::kJson);
  ::testing::internal::CaptureStderr();
  {
    LogSummarizer summarizer(std::chrono::seconds(60));
    for (int i = 0; i < 20; ++i) {
      summarizer.Add(LogLevel::kInfo, "INVALID_ARGUMENT", "forward refused",
                     {{"code", "INVALID_ARGUMENT"}});
    }
  }  // the destructor writes what is still counted
  const std::vector<nlohmann::json> lines = JsonLines(::testing::internal::GetCapturedStderr());
  int debug = 0;
  int64_t summarised = 0;
  for (const nlohmann::json& line : lines) {
    if (line["level"] == "debug") {
      ++debug;
    } else {
      summarised += line["count"].get<int64_t>();
    }
  }
  EXPECT_EQ(debug, 20);
  EXPECT_EQ(summarised, 20);
}

TEST_F(LoggingTest, SummarizerIsSilentBelowItsLevel) {
  InitLogging(LogLevel::kWarn, LogFormat::kJson);
  ::testing::internal::CaptureStderr();
  {
    LogSummarizer summarizer(std::chrono::milliseconds(10));
    for (int i = 0; i < 20; ++i) summarizer.Add(LogLevel::kInfo, "k", "forward refused", {});
  }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST_F(LoggingTest, ProtobufLinesAreOursAndSummarised) {
  InitLogging(LogLevel::kInfo, LogFormat::kJson);
  v1::ForwardRequest request;
  request.set_model("\xff\xfe not UTF-8");
  ::testing::internal::CaptureStderr();
  const std::string bytes = request.SerializeAsString();  // logs too, from the same source line
  for (int i = 0; i < 200; ++i) {
    v1::ForwardRequest parsed;
    EXPECT_FALSE(parsed.ParseFromString(bytes));
  }
  const std::vector<nlohmann::json> lines = JsonLines(::testing::internal::GetCapturedStderr());
  // One line per source line of protobuf per 10 s, and it says what happened.
  ASSERT_EQ(lines.size(), 1u);
  for (const nlohmann::json& line : lines) {
    EXPECT_EQ(line["level"], "error");
    EXPECT_NE(line["msg"].get<std::string>().find("invalid UTF-8"), std::string::npos) << line;
    EXPECT_EQ(line["source"].get<std::string>().rfind("protobuf ", 0), 0u) << line;
  }
}

TEST_F(LoggingTest, ProtobufLinesFollowOurLevel) {
  InitLogging(LogLevel::kOff, LogFormat::kJson);
  v1::ForwardRequest request;
  request.set_model("\xc3\x28");
  ::testing::internal::CaptureStderr();
  const std::string bytes = request.SerializeAsString();
  v1::ForwardRequest parsed;
  EXPECT_FALSE(parsed.ParseFromString(bytes));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST_F(LoggingTest, GrpcLinesAreOurs) {
  InitLogging(LogLevel::kInfo, LogFormat::kJson);
  ::testing::internal::CaptureStderr();
  gpr_log("logging_test_a.cc", 7, GPR_LOG_SEVERITY_ERROR, "a gRPC complaint: %d", 42);
  gpr_log("logging_test_a.cc", 7, GPR_LOG_SEVERITY_ERROR, "a gRPC complaint: %d", 43);
  const std::vector<nlohmann::json> lines = JsonLines(::testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 1u);  // the second is counted, not written
  EXPECT_EQ(lines[0]["msg"], "a gRPC complaint: 42");
  EXPECT_EQ(lines[0]["level"], "error");
  EXPECT_EQ(lines[0]["source"], "grpc logging_test_a.cc:7");

  InitLogging(LogLevel::kCritical, LogFormat::kJson);
  ::testing::internal::CaptureStderr();
  gpr_log("logging_test_b.cc", 9, GPR_LOG_SEVERITY_ERROR, "below critical");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

}  // namespace
}  // namespace attnserve::server
