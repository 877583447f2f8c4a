// attnserve-client against a real attnserve on a loopback port: every subcommand, its files, its
// exit codes, and its numbers against the PyTorch golden fixtures.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/npy.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/process.h"
#include "tests/client/shared_server.h"
#include "tests/common/golden.h"

namespace attnserve::test {
namespace {

using client::FloatArray;

// Exit codes are the gRPC status codes' numbers.
constexpr int kInvalidArgument = 3;
constexpr int kDeadlineExceeded = 4;
constexpr int kNotFound = 5;
constexpr int kUnavailable = 14;

// Runs attnserve-client with `args` against `target`.
ProgramResult Client(const std::string& target, std::vector<std::string> args) {
  std::vector<std::string> argv = {ATTNSERVE_CLIENT_BIN, "--target", target, "--timeout", "60"};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProgram(argv);
}

FloatArray ReadOrDie(const std::string& path) {
  absl::StatusOr<FloatArray> array = client::ReadNpy(path);
  EXPECT_TRUE(array.ok()) << array.status();
  return array.ok() ? *std::move(array) : FloatArray{};
}

float MaxAbsDiff(const FloatArray& a, const FloatArray& b) {
  EXPECT_EQ(a.shape, b.shape);
  float worst = 0;
  for (size_t i = 0; i < std::min(a.values.size(), b.values.size()); ++i) {
    worst = std::max(worst, std::fabs(a.values[i] - b.values[i]));
  }
  return worst;
}

// Writes a [1, 2, 256] array of zeros (the demo model's width) and returns its path.
std::string WriteZeros(const std::string& path) {
  EXPECT_TRUE(
      client::WriteNpy(path, {.shape = {1, 2, 256}, .values = std::vector<float>(512)}).ok());
  return path;
}

// attnserve-client's subcommands against the demo model, one server for the whole suite.
class DemoServerTest : public SharedServerTest {
 protected:
  static void SetUpTestSuite() { StartServer({"--threads", "2"}); }
  ProgramResult Run(std::vector<std::string> args) { return Client(server_->target(), args); }
};

TEST_F(DemoServerTest, HealthIsServing) {
  ProgramResult r = Run({"health"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(r.out, "SERVING\n");
}

TEST_F(DemoServerTest, HealthOfOneService) {
  ProgramResult r = Run({"health", "--service", "attnserve.v1.AttentionService"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = RunProgram({ATTNSERVE_CLIENT_BIN, "--target", "dns:///" + server_->target(), "--lb-policy",
                  "round_robin", "health"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  r = Run({"health", "--service", "no.such.Service"});
  EXPECT_EQ(r.exit_code, kNotFound) << Describe(r);
}

TEST_F(DemoServerTest, ExpiredDeadlineExitsWithDeadlineExceeded) {
  ProgramResult r = RunProgram({ATTNSERVE_CLIENT_BIN, "--target", server_->target(), "--timeout",
                                "0.000001", "infer", "--input", WriteZeros(dir_ + "/z.npy")});
  EXPECT_EQ(r.exit_code, kDeadlineExceeded) << Describe(r);
}

TEST_F(DemoServerTest, ModelsListsTheDemo) {
  ProgramResult r = Run({"models"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("demo"), std::string::npos) << r.out;
  r = Run({"models", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  nlohmann::json models = nlohmann::json::parse(r.out);
  ASSERT_EQ(models.size(), 1u);
  EXPECT_EQ(models[0]["name"], "demo");
  EXPECT_EQ(models[0]["d_model"], 256);
  EXPECT_EQ(models[0]["num_heads"], 4);
}

TEST_F(DemoServerTest, InferWritesOutputNpyWithZeroPadding) {
  const std::string out = dir_ + "/out.npy";
  ProgramResult r = Run({"infer", "--random", "2,5", "--lengths", "5,3", "--output", out});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  FloatArray output = ReadOrDie(out);
  ASSERT_EQ(output.shape, (std::vector<int64_t>{2, 5, 256}));
  const auto padded_rows = output.values.begin() + (5 + 3) * 256;
  EXPECT_TRUE(std::all_of(padded_rows, output.values.end(), [](float v) { return v == 0; }));
  EXPECT_TRUE(std::any_of(output.values.begin(), padded_rows, [](float v) { return v != 0; }));
}

TEST_F(DemoServerTest, InferPrintsShapeAndValuesWithoutOutputFile) {
  ProgramResult r = Run({"infer", "--random", "1,4", "--kind", "causal"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("output [1, 4, 256]"), std::string::npos) << r.out;
}

TEST_F(DemoServerTest, PackedValuesAndRawPaddedAgree) {
  const std::string padded = dir_ + "/padded.npy", packed = dir_ + "/packed.npy";
  const std::vector<std::string> call = {"infer", "--random", "3,6",   "--lengths",
                                         "6,2,4", "--kind",   "causal"};
  std::vector<std::string> a = call, b = call;
  a.insert(a.end(), {"--output", padded});
  b.insert(b.end(), {"--output", packed, "--packed", "--encoding", "values"});
  ProgramResult ra = Run(a), rb = Run(b);
  ASSERT_EQ(ra.exit_code, 0) << Describe(ra);
  ASSERT_EQ(rb.exit_code, 0) << Describe(rb);
  EXPECT_LT(MaxAbsDiff(ReadOrDie(padded), ReadOrDie(packed)), 1e-5f);
}

TEST_F(DemoServerTest, InferReadsNpyInputAndReturnsAttention) {
  const std::string in = dir_ + "/in.npy", ctx = dir_ + "/ctx.npy", att = dir_ + "/att.npy";
  FloatArray input{.shape = {2, 3, 256}, .values = {}};
  for (int i = 0; i < 2 * 3 * 256; ++i) input.values.push_back(std::sin(0.01f * i));
  FloatArray context{.shape = {2, 7, 256}, .values = {}};
  for (int i = 0; i < 2 * 7 * 256; ++i) context.values.push_back(std::cos(0.02f * i));
  ASSERT_TRUE(client::WriteNpy(in, input).ok());
  ASSERT_TRUE(client::WriteNpy(ctx, context).ok());
  ProgramResult r = Run({"infer", "--kind", "cross", "--input", in, "--lengths", "3,2", "--context",
                         ctx, "--context-lengths", "7,4", "--attention-output", att});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  FloatArray probabilities = ReadOrDie(att);
  ASSERT_EQ(probabilities.shape, (std::vector<int64_t>{2, 4, 3, 7}));
  // Each valid query row of sequence 1 spreads its attention over its 4 visible keys only.
  const float* row = probabilities.values.data() + ((1 * 4 + 0) * 3 + 0) * 7;
  EXPECT_NEAR(row[0] + row[1] + row[2] + row[3], 1.0f, 1e-5f);
  EXPECT_EQ(row[4] + row[5] + row[6], 0.0f);
}

TEST_F(DemoServerTest, UnknownModelExitsWithNotFound) {
  ProgramResult r = Run({"infer", "--model", "nope", "--input", "/dev/null"});
  EXPECT_NE(r.exit_code, 0);  // the file is refused first: a local error is an error too
  const std::string in = dir_ + "/in.npy";
  ASSERT_TRUE(client::WriteNpy(in, {.shape = {1, 2, 256}, .values = std::vector<float>(512)}).ok());
  r = Run({"infer", "--model", "nope", "--input", in});
  EXPECT_EQ(r.exit_code, kNotFound) << Describe(r);
  EXPECT_NE(r.err.find("NOT_FOUND"), std::string::npos) << r.err;
  r = Run({"infer", "--model", "nope", "--random", "1,2"});
  EXPECT_EQ(r.exit_code, kNotFound) << Describe(r);
}

TEST_F(DemoServerTest, BadCallsExitWithInvalidArgument) {
  ProgramResult r = Run({"infer", "--random", "2,4", "--lengths", "4,9"});  // 9 > S
  EXPECT_EQ(r.exit_code, kInvalidArgument) << Describe(r);
  EXPECT_NE(r.err.find("INVALID_ARGUMENT"), std::string::npos) << r.err;
  r = Run({"infer", "--random", "100000,100000"});  // 10 TB: refused, not allocated
  EXPECT_EQ(r.exit_code, kInvalidArgument) << Describe(r);
  r = Run({"infer", "--random", "2,4", "--input", "x.npy"});  // two inputs
  EXPECT_EQ(r.exit_code, kInvalidArgument) << Describe(r);
  r = Run({"infer", "--kind", "cross", "--random", "2,4"});  // no context
  EXPECT_EQ(r.exit_code, kInvalidArgument) << Describe(r);
  const std::string wrong_width = dir_ + "/w.npy";
  ASSERT_TRUE(
      client::WriteNpy(wrong_width, {.shape = {1, 2, 8}, .values = std::vector<float>(16)}).ok());
  r = Run({"infer", "--input", wrong_width});
  EXPECT_EQ(r.exit_code, kInvalidArgument) << Describe(r);
}

TEST_F(DemoServerTest, MissingInputFileExitsWithNotFound) {
  ProgramResult r = Run({"infer", "--input", dir_ + "/missing.npy"});
  EXPECT_EQ(r.exit_code, kNotFound) << Describe(r);
}

TEST_F(DemoServerTest, MalformedCommandLineFails) {
  EXPECT_NE(Run({"infer", "--kind", "sideways", "--random", "1,2"}).exit_code, 0);
  EXPECT_NE(Run({"frobnicate"}).exit_code, 0);
  EXPECT_NE(Run({}).exit_code, 0);
}

TEST_F(DemoServerTest, BenchShortRunReportsThroughputAndLatency) {
  ProgramResult r = Run({"bench", "--random", "2,16", "--concurrency", "2", "--duration", "30",
                         "--requests", "40", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  nlohmann::json report = nlohmann::json::parse(r.out);
  EXPECT_EQ(report["ok"], 40) << r.out;  // the count bound ends the run, long before 30 s
  EXPECT_TRUE(report["errors"].empty());
  EXPECT_EQ(report["tokens"], 40 * 32);  // valid tokens of the successful calls
  EXPECT_GT(report["requests_per_second"].get<double>(), 0);
  EXPECT_LE(report["latency_ms"]["p50"].get<double>(), report["latency_ms"]["p99"].get<double>());
  EXPECT_LE(report["latency_ms"]["p99"].get<double>(), report["latency_ms"]["max"].get<double>());

  r = Run({"bench", "--random", "1,8", "--kind", "causal", "--duration", "0.5", "-c", "3"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_NE(r.out.find("req/s"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("p99"), std::string::npos) << r.out;
}

TEST_F(DemoServerTest, BenchStopsAtOnceOnAWrongCall) {
  ProgramResult r = Run({"bench", "--model", "nope", "--random", "1,8", "--duration", "30"});
  EXPECT_EQ(r.exit_code, kNotFound) << Describe(r);
}

// bench --http drives the REST port with the same workloads: JSON and binary tensors, a mixed
// pool, the model found through the REST metadata; every call answered 200, and a wrong model
// stops the run at once with NOT_FOUND, as over gRPC.
class HttpBenchTest : public SharedServerTest {
 protected:
  static void SetUpTestSuite() {
    http_port_ = ClosedLoopbackPort();
    StartServer({"--threads", "2", "--http-listen", absl::StrCat("127.0.0.1:", http_port_)});
  }
  ProgramResult Run(std::vector<std::string> args) {
    return Client(absl::StrCat("127.0.0.1:", http_port_), args);
  }
  inline static int http_port_ = 0;
};

TEST_F(HttpBenchTest, JsonAndBinaryCallsAreAllAnswered) {
  for (const std::string encoding : {"json", "binary"}) {
    ProgramResult r =
        Run({"bench", "--http", "--http-encoding", encoding, "--random", "2,16", "--lengths",
             "16,9", "--concurrency", "3", "--duration", "30", "--requests", "30", "--json"});
    ASSERT_EQ(r.exit_code, 0) << Describe(r);
    nlohmann::json report = nlohmann::json::parse(r.out);
    EXPECT_EQ(report["protocol"], "http-" + encoding);
    EXPECT_EQ(report["ok"], 30) << r.out;
    EXPECT_TRUE(report["errors"].empty()) << r.out;
    EXPECT_EQ(report["tokens"], 30 * 25);
    EXPECT_EQ(report["connections"], 3);  // one a call in flight
  }
  ProgramResult r =
      Run({"bench", "--http", "--kinds", "cross,causal", "--lengths-list", "4,32",
           "--context-random", "2,8", "--duration", "30", "--requests", "20", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(nlohmann::json::parse(r.out)["ok"], 20) << r.out;
}

TEST_F(HttpBenchTest, AWrongModelStopsTheRunWithNotFound) {
  ProgramResult r = Run({"bench", "--http", "--model", "nope", "--random", "1,8"});
  EXPECT_EQ(r.exit_code, kNotFound) << Describe(r);
  EXPECT_NE(r.err.find("nope"), std::string::npos) << r.err;
  r = Run({"bench", "--http", "--decode"});
  EXPECT_EQ(r.exit_code, kInvalidArgument) << Describe(r);
}

TEST(ClientWithoutServerTest, UnreachableServerExitsWithUnavailable) {
  const std::string target = absl::StrCat("127.0.0.1:", ClosedLoopbackPort());
  ProgramResult r =
      RunProgram({ATTNSERVE_CLIENT_BIN, "--target", target, "--timeout", "5", "health"});
  EXPECT_EQ(r.exit_code, kUnavailable) << Describe(r);
  EXPECT_NE(r.err.find("UNAVAILABLE"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace attnserve::test
