// attnserve-client bench against a real attnserve on loopback: the open loop past capacity,
// sweeps, mixed workloads, the CSV, and the server split from a real HTTP /metrics endpoint.
#include <cmath>
#include <fstream>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/process.h"
#include "tests/client/shared_server.h"

namespace attnserve::test {
namespace {

constexpr int kInvalidArgument = 3;
constexpr int kNotFound = 5;
constexpr int kResourceExhausted = 8;
constexpr int kUnavailable = 14;

// Failed calls of a step or run, summed over its status codes.
int64_t Failed(const nlohmann::json& report) {
  int64_t n = 0;
  for (const auto& [code, count] : report["errors"].items()) n += count.get<int64_t>();
  return n;
}

// `attnserve-client bench` against the demo model, one server (its log quiet) for the suite.
class BenchServerTest : public SharedServerTest {
 protected:
  static void SetUpTestSuite() { StartServer({"--threads", "2", "--log-level", "warn"}); }
  // Runs `attnserve-client --target SERVER bench ARGS`.
  ProgramResult Bench(std::vector<std::string> args, const std::string& target = "") {
    std::vector<std::string> argv = {ATTNSERVE_CLIENT_BIN, "--target",
                                     target.empty() ? server_->target() : target, "bench"};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProgram(argv);
  }
  // Runs a bench that must print JSON (exit 0, or RESOURCE_EXHAUSTED when `overload`).
  nlohmann::json BenchJson(std::vector<std::string> args, bool overload = false) {
    args.push_back("--json");
    ProgramResult r = Bench(args);
    EXPECT_TRUE(r.exit_code == 0 || (overload && r.exit_code == kResourceExhausted)) << Describe(r);
    nlohmann::json json = nlohmann::json::parse(r.out, nullptr, false);
    EXPECT_FALSE(json.is_discarded()) << Describe(r);
    return json;
  }
};

TEST_F(BenchServerTest, OpenLoopPastCapacitySendsOnScheduleAndShowsTheQueue) {
  const std::vector<std::string> call = {"--random", "8,64", "--warmup-seconds", "0.2"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), call.begin(), call.end());
    return more;
  };
  // The service time, at a rate the server answers with nothing queued.
  nlohmann::json low = BenchJson(with({"--rate", "20", "--duration", "1"}));
  const double service_ms = low["latency_ms"]["p50"].get<double>();
  ASSERT_GT(service_ms, 0) << low.dump();
  // What the server answers at most (16 in flight lets it batch), then twice that. Where a call
  // takes long (a sanitizer build), 16 queued calls are past the server's target delay, and it
  // refuses some (RESOURCE_EXHAUSTED): what it answers is still its capacity.
  nlohmann::json closed =
      BenchJson(with({"--concurrency", "16", "--duration", "1"}), /*overload=*/true);
  const double capacity = closed["requests_per_second"].get<double>();
  ASSERT_GT(capacity, 0) << closed.dump();
  const double rate = std::round(std::max(60.0, 2 * capacity)), seconds = 1;
  nlohmann::json open = BenchJson(with({"--rate", absl::StrCat(rate), "--duration",
                                        absl::StrCat(seconds), "--max-in-flight", "100000"}),
                                  /*overload=*/true);
  SCOPED_TRACE(
      absl::StrCat("unloaded: ", low.dump(), "\nclosed: ", closed.dump(), "\nopen: ", open.dump()));
  EXPECT_EQ(open["mode"], "open");
  EXPECT_DOUBLE_EQ(open["offered_rate"].get<double>(), rate);
  const auto scheduled = open["scheduled"].get<int64_t>();
  const auto sent = open["sent"].get<int64_t>();
  EXPECT_NEAR(static_cast<double>(scheduled), rate * seconds, 1.0);
  EXPECT_EQ(sent + open["unsent"].get<int64_t>(), scheduled);
  EXPECT_GE(static_cast<double>(sent), 0.98 * rate * seconds);
  EXPECT_EQ(open["ok"].get<int64_t>() + Failed(open), sent);  // every call accounted for
  // Timed from the scheduled send, the queue shows: p99 far above the unloaded service time.
  EXPECT_GT(open["latency_ms"]["p99"].get<double>(), 5 * service_ms);
  ASSERT_EQ(open["steps"].size(), 1u);
  EXPECT_EQ(open["steps"][0]["sent"], sent);

  // With room for 4 calls in flight, calls wait for room: they are late, or unsent when the
  // window closes, and still counted.
  nlohmann::json capped =
      BenchJson(with({"--rate", absl::StrCat(rate), "--duration", "0.5", "--max-in-flight", "4"}),
                /*overload=*/true);
  EXPECT_EQ(capped["max_in_flight"], 4) << capped.dump();
  EXPECT_GT(capped["late"].get<int64_t>() + capped["unsent"].get<int64_t>(), 0);
  EXPECT_EQ(capped["sent"].get<int64_t>() + capped["unsent"].get<int64_t>(),
            capped["scheduled"].get<int64_t>());
  EXPECT_NEAR(capped["scheduled"].get<double>(), rate * 0.5, 1.0);
  EXPECT_EQ(capped["ok"].get<int64_t>() + Failed(capped), capped["sent"].get<int64_t>());
}

TEST_F(BenchServerTest, OpenLoopCountBoundIsExactWhateverTheSenders) {
  // 60000 calls/s takes three sender threads; the bound still counts each call once.
  for (const char* arrival : {"constant", "poisson"}) {
    nlohmann::json run = BenchJson(
        {"--random", "1,16", "--rate", "60000", "--arrival", arrival, "--requests", "3000",
         "--duration", "20", "--warmup-seconds", "0.05", "--max-in-flight", "100000"},
        /*overload=*/true);
    EXPECT_EQ(run["scheduled"], 3000) << run.dump();
    EXPECT_EQ(run["sent"], 3000);
    EXPECT_EQ(run["ok"].get<int64_t>() + Failed(run), 3000);
    // 3000 calls at 60000/s are scheduled over 0.05 s, whatever the server answers.
    EXPECT_NEAR(run["window_seconds"].get<double>(), 0.05, 0.02) << arrival;
  }
}

TEST_F(BenchServerTest, ConcurrencySweepGivesOneEntryPerStep) {
  nlohmann::json run = BenchJson({"--random", "1,16", "--concurrency-range", "1:3", "--duration",
                                  "0.3", "--warmup-seconds", "0.1"});
  EXPECT_EQ(run["sweep"], "concurrency");
  EXPECT_EQ(run["mode"], "closed");
  ASSERT_EQ(run["steps"].size(), 3u) << run.dump();
  int64_t sent = 0;
  for (int i = 0; i < 3; ++i) {
    const nlohmann::json& step = run["steps"][i];
    EXPECT_EQ(step["concurrency"], i + 1);
    EXPECT_GT(step["ok"].get<int64_t>(), 0);
    EXPECT_EQ(step["ok"].get<int64_t>() + Failed(step), step["sent"].get<int64_t>());
    EXPECT_LE(step["latency_ms"]["p50"].get<double>(), step["latency_ms"]["p99"].get<double>());
    EXPECT_LE(step["latency_ms"]["p99"].get<double>(), step["latency_ms"]["max"].get<double>());
    sent += step["sent"].get<int64_t>();
  }
  EXPECT_EQ(run["sent"], sent);
}

TEST_F(BenchServerTest, StabilityCheckRepeatsTheWindowUntilThreeAgree) {
  const std::vector<std::string> step = {"--random",     "1,16", "--rate",           "100",
                                         "--duration",   "0.2",  "--warmup-seconds", "0",
                                         "--max-trials", "4"};
  auto with = [&](const std::string& percent) {
    std::vector<std::string> args = step;
    args.insert(args.end(), {"--stability-percent", percent});
    return args;
  };
  // Any three windows agree within 1000 %: the first three are reported, merged.
  nlohmann::json loose = BenchJson(with("1000"));
  EXPECT_EQ(loose["trials_run"], 3) << loose.dump();
  EXPECT_EQ(loose["trials"], 3);
  EXPECT_EQ(loose["stable"], true);
  EXPECT_NEAR(loose["window_seconds"].get<double>(), 0.6, 0.05);
  EXPECT_NEAR(loose["sent"].get<double>(), 60, 1);
  // No two windows' p99 agree within a millionth: every trial runs, the step is not stable.
  nlohmann::json strict = BenchJson(with("0.0001"));
  EXPECT_EQ(strict["trials_run"], 4) << strict.dump();
  EXPECT_EQ(strict["trials"], 3);
  EXPECT_EQ(strict["stable"], false);
}

TEST_F(BenchServerTest, RateSweepAsCsvAndTheLatencyLimit) {
  ProgramResult r = Bench({"--random", "1,16", "--rate-range", "50:200:x2", "--duration", "0.4",
                           "--warmup-seconds", "0", "--arrival", "poisson", "--csv"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  std::vector<std::string> lines = absl::StrSplit(r.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u) << r.out;
  std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  const auto column = [&](const std::string& name) {
    return std::find(header.begin(), header.end(), name) - header.begin();
  };
  for (size_t i = 1; i < lines.size(); ++i) {
    std::vector<std::string> cells = absl::StrSplit(lines[i], ',');
    ASSERT_EQ(cells.size(), header.size()) << lines[i];
    double offered = 0, sent = 0, ok = 0, failed = 0, p99 = 0;
    ASSERT_TRUE(absl::SimpleAtod(cells[column("offered_rate")], &offered)) << lines[i];
    ASSERT_TRUE(absl::SimpleAtod(cells[column("sent")], &sent));
    ASSERT_TRUE(absl::SimpleAtod(cells[column("ok")], &ok));
    ASSERT_TRUE(absl::SimpleAtod(cells[column("failed")], &failed));
    ASSERT_TRUE(absl::SimpleAtod(cells[column("p99_ms")], &p99));
    EXPECT_EQ(offered, 50 << (i - 1));
    EXPECT_EQ(ok + failed, sent);
    EXPECT_GT(p99, 0);
    // "errors": CODE=n pairs, ';'-separated, adding up to "failed".
    double by_code = 0;
    for (absl::string_view pair : absl::StrSplit(cells[column("errors")], ';', absl::SkipEmpty())) {
      double n = 0;
      ASSERT_TRUE(absl::SimpleAtod(pair.substr(pair.find('=') + 1), &n)) << lines[i];
      by_code += n;
    }
    EXPECT_EQ(by_code, failed) << lines[i];
  }
  // A limit every step passes stops the sweep after its first step.
  nlohmann::json run = BenchJson({"--random", "1,16", "--rate-range", "50:200:x2", "--duration",
                                  "0.3", "--warmup-seconds", "0", "--latency-limit-ms", "0.001"});
  EXPECT_EQ(run["steps"].size(), 1u) << run.dump();
  EXPECT_EQ(run["stopped_by_latency_limit"], true);
}

TEST_F(BenchServerTest, MixedWorkloadsCountValidTokens) {
  // Lengths 3 or 5 in [2, 8] padded arrays: 6, 8 or 10 valid tokens a call, never the 16 padded.
  nlohmann::json mix =
      BenchJson({"--random", "2,8", "--lengths-list", "3,5", "--kinds", "bidirectional,causal",
                 "--requests", "30", "--duration", "20", "--warmup-seconds", "0"});
  const auto ok = mix["ok"].get<int64_t>();
  EXPECT_EQ(ok, 30) << mix.dump();
  EXPECT_GE(mix["tokens"].get<int64_t>(), 6 * ok);
  EXPECT_LE(mix["tokens"].get<int64_t>(), 10 * ok);
  EXPECT_LT(mix["tokens"].get<int64_t>(), 10 * ok);  // the pool holds other sums than 10

  const std::string file = dir_ + "/workload.jsonl";
  std::ofstream(file) << "# two kinds, one twice as often\n"
                      << "{\"kind\": \"causal\", \"lengths\": [4, 2], \"weight\": 2}\n"
                      << "{\"kind\": \"cross\", \"lengths\": [6], \"context_lengths\": [3]}\n";
  nlohmann::json from_file = BenchJson({"--workload", file, "--concurrency", "3", "--requests",
                                        "30", "--duration", "20", "--warmup-seconds", "0"});
  EXPECT_EQ(from_file["ok"], 30) << from_file.dump();
  // The pool cycles [6, 6, 6] tokens in some order: 30 calls carry 180 valid tokens.
  EXPECT_EQ(from_file["tokens"], 180);

  std::ofstream(dir_ + "/bad.jsonl") << "{\"kind\": \"causal\"}\n";
  ProgramResult r = Bench({"--workload", dir_ + "/bad.jsonl", "--duration", "1"});
  EXPECT_EQ(r.exit_code, kInvalidArgument) << Describe(r);
  EXPECT_NE(r.err.find("bad.jsonl:1"), std::string::npos) << r.err;
  r = Bench({"--workload", dir_ + "/missing.jsonl", "--duration", "1"});
  EXPECT_EQ(r.exit_code, kNotFound) << Describe(r);
  r = Bench({"--kinds", "causal,cross", "--lengths-uniform", "1:4", "--duration", "1"});
  EXPECT_EQ(r.exit_code, kInvalidArgument) << Describe(r);  // cross needs --context-random
}

TEST_F(BenchServerTest, ConnectionsAndRoundRobinTargets) {
  nlohmann::json run = BenchJson({"--random", "1,16", "--connections", "3", "--rate", "200",
                                  "--duration", "0.5", "--warmup-seconds", "0"});
  EXPECT_EQ(run["connections"], 3);
  EXPECT_EQ(run["ok"], run["sent"]) << run.dump();
  const std::string port = server_->target().substr(server_->target().rfind(':') + 1);
  ProgramResult r = RunProgram({ATTNSERVE_CLIENT_BIN, "--target",
                                absl::StrCat("ipv4:127.0.0.1:", port, ",127.0.0.1:", port),
                                "--lb-policy", "round_robin", "bench", "--random", "1,16",
                                "--connections", "2", "--requests", "20", "--json"});
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
  EXPECT_EQ(nlohmann::json::parse(r.out)["ok"], 20);
}

TEST_F(BenchServerTest, BadFlagsAreRefusedWithAClearStatus) {
  for (std::vector<std::string> args : {std::vector<std::string>{"--rate-range", "5:1"},
                                        {"--concurrency-range", "1:4:x1"},
                                        {"--json", "--csv"},
                                        {"--rate", "10", "--concurrency-range", "1:2"},
                                        {"--rate-range", "1:2", "--concurrency-range", "1:2"},
                                        {"--lengths-uniform", "9:3"},
                                        {"--connections", "0"},
                                        {"--metrics-url", "ftp://x/metrics", "--requests", "2"},
                                        {"--rate", "1e12"},
                                        {"--rate", "0"},
                                        {"--rate", "nan"},
                                        {"--rate", "10", "--concurrency", "4"},
                                        {"--arrival", "poisson", "--concurrency", "4"},
                                        {"--latency-limit-ms", "5", "--rate", "10"},
                                        {"--rate-range", "1000:1e9"}}) {
    ProgramResult r = Bench(args);
    EXPECT_EQ(r.exit_code, kInvalidArgument) << absl::StrJoin(args, " ") << "\n" << Describe(r);
  }
  EXPECT_NE(Bench({"--rate", "-5"}).exit_code, 0);
  EXPECT_NE(Bench({"--warmup", "-1"}).exit_code, 0);
  // A report that cannot be written is refused before any call is sent, not after the run.
  ProgramResult html = Bench({"--html", "/nonexistent-dir/report.html", "--duration", "30"});
  EXPECT_EQ(html.exit_code, 7) << Describe(html);  // PERMISSION_DENIED
  EXPECT_NE(html.err.find("cannot write /nonexistent-dir/report.html"), std::string::npos);
  EXPECT_NE(Bench({"--arrival", "bursty", "--rate", "5"}).exit_code, 0);
}

// The server split, from a real HTTP server answering Prometheus text: the first scrape (as the
// window opens) gets `before`, the one after the step gets `after`.
TEST_F(BenchServerTest, MetricsUrlReportsTheServersQueueComputeSplit) {
  const std::string before = dir_ + "/before.prom", after = dir_ + "/after.prom";
  auto exposition = [](double calls, double queue_s, double compute_s, double batches,
                       double batched_calls, double tokens) {
    return absl::StrCat(
        "# TYPE attnserve_queue_duration_seconds histogram\n"
        "attnserve_queue_duration_seconds_bucket{model=\"demo\",le=\"0.001\"} 0\n"
        "attnserve_queue_duration_seconds_bucket{model=\"demo\",le=\"+Inf\"} ",
        calls,
        "\n"
        "attnserve_queue_duration_seconds_sum{model=\"demo\"} ",
        queue_s,
        "\n"
        "attnserve_queue_duration_seconds_count{model=\"demo\"} ",
        calls,
        "\n"
        "attnserve_compute_duration_seconds_sum{model=\"demo\"} ",
        compute_s,
        "\n"
        "attnserve_compute_duration_seconds_count{model=\"demo\"} ",
        calls,
        "\n"
        "attnserve_batch_calls_sum{model=\"demo\"} ",
        batched_calls,
        "\n"
        "attnserve_batch_calls_count{model=\"demo\"} ",
        batches,
        "\n"
        "attnserve_batch_tokens_sum{model=\"demo\"} ",
        tokens,
        "\n"
        "attnserve_batch_tokens_count{model=\"demo\"} ",
        batches,
        "\n"
        "attnserve_requests_total{model=\"demo\",kind=\"bidirectional\",code=\"OK\"} ",
        calls, "\n");
  };
  // Over the step: 40 calls, 0.2 s queued (5 ms each), 0.08 s computing (2 ms each), in 10
  // batches (4 calls, 64 tokens each).
  std::ofstream(before) << exposition(100, 1.0, 0.5, 50, 100, 1600);
  std::ofstream(after) << exposition(140, 1.2, 0.58, 60, 140, 2240);
  absl::StatusOr<std::unique_ptr<ServerProcess>> stub =
      ServerProcess::Start(METRICS_STUB_SERVER, {"--exposition", before, "--exposition", after});
  ASSERT_TRUE(stub.ok()) << stub.status();
  const std::string url = absl::StrCat("http://", (*stub)->target(), "/metrics");

  nlohmann::json run = BenchJson({"--random", "1,16", "--requests", "10", "--duration", "20",
                                  "--warmup-seconds", "0", "--metrics-url", url});
  SCOPED_TRACE(run.dump());
  ASSERT_TRUE(run.contains("server"));
  const nlohmann::json& server = run["server"];
  EXPECT_EQ(server["found"], true);
  EXPECT_NEAR(server["queue_ms"]["mean"].get<double>(), 5.0, 1e-6);
  EXPECT_NEAR(server["compute_ms"]["mean"].get<double>(), 2.0, 1e-6);
  EXPECT_NEAR(server["mean_batch_calls"].get<double>(), 4.0, 1e-9);
  EXPECT_NEAR(server["mean_batch_tokens"].get<double>(), 64.0, 1e-9);
  EXPECT_EQ(server["requests_by_code"]["OK"], 40);
  ProgramResult text = Bench({"--random", "1,16", "--requests", "5", "--metrics-url", url});
  EXPECT_NE(text.out.find("server       queue mean"), std::string::npos) << Describe(text);
  (*stub)->Stop();

  ProgramResult r = Bench({"--random", "1,16", "--requests", "5", "--metrics-url",
                           absl::StrCat("http://127.0.0.1:", ClosedLoopbackPort(), "/metrics")});
  EXPECT_EQ(r.exit_code, kUnavailable) << Describe(r);
  EXPECT_NE(r.err.find("--metrics-url"), std::string::npos) << r.err;
}

TEST_F(BenchServerTest, DecodeSessionsReportTokensFirstOutputAndInterTokenLatency) {
  // 3 sessions of B=2: a 16-token prompt in two messages, then 10 steps of 2 tokens fed back.
  nlohmann::json run =
      BenchJson({"--decode", "--sessions", "3", "--batch", "2", "--prompt", "16", "--prompt-chunk",
                 "8", "--steps", "10", "--tokens-per-step", "2"});
  SCOPED_TRACE(run.dump());
  EXPECT_EQ(run["sent"], 3 * (2 + 10));
  EXPECT_EQ(run["ok"], run["sent"]);
  EXPECT_EQ(Failed(run), 0);
  EXPECT_EQ(run["tokens"], 3 * 2 * (16 + 10 * 2));
  const nlohmann::json& d = run["decode"];
  ASSERT_TRUE(d.is_object());
  EXPECT_EQ(d["sessions"], 3);
  EXPECT_EQ(d["batch"], 2);
  EXPECT_EQ(d["prompt"], 16);
  EXPECT_EQ(d["prompt_tokens"], 3 * 2 * 16);
  EXPECT_EQ(d["step_tokens"], 3 * 10 * 2 * 2);
  EXPECT_GT(d["tokens_per_second"].get<double>(), 0);
  const nlohmann::json& first = d["time_to_first_output_ms"];
  const nlohmann::json& itl = d["inter_token_latency_ms"];
  EXPECT_GT(first["p50"].get<double>(), 0);
  EXPECT_LE(first["p50"].get<double>(), first["p99"].get<double>());
  EXPECT_GT(itl["p50"].get<double>(), 0);
  EXPECT_LE(itl["p50"].get<double>(), itl["p90"].get<double>());
  EXPECT_LE(itl["p90"].get<double>(), itl["p99"].get<double>());
  // Two tokens a step: the inter-token latency is half a step's.
  EXPECT_NEAR(itl["p50"].get<double>(), run["latency_ms"]["p50"].get<double>() / 2,
              0.02 * run["latency_ms"]["p50"].get<double>() + 0.002);
  ASSERT_EQ(run["steps"].size(), 1u);
  EXPECT_EQ(run["steps"][0]["decode"]["step_tokens"], d["step_tokens"]);

  // The same figures in the summary, the CSV and the HTML page; other modes' reports stay as
  // they were (decode null, its CSV cells empty).
  ProgramResult text = Bench({"--decode", "--sessions", "2", "--prompt", "4", "--steps", "3",
                              "--html", dir_ + "/decode.html"});
  ASSERT_EQ(text.exit_code, 0) << Describe(text);
  EXPECT_NE(text.out.find("inter-token ms"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("first output ms"), std::string::npos) << text.out;
  std::ifstream html_file(dir_ + "/decode.html");
  const std::string html((std::istreambuf_iterator<char>(html_file)),
                         std::istreambuf_iterator<char>());
  EXPECT_NE(html.find("\"inter_token_latency_ms\""), std::string::npos);
  ProgramResult csv = Bench({"--decode", "--sessions", "2", "--prompt", "4", "--steps", "3",
                             "--feed", "random", "--csv"});
  ASSERT_EQ(csv.exit_code, 0) << Describe(csv);
  std::vector<std::string> lines = absl::StrSplit(csv.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << csv.out;
  std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  std::vector<std::string> cells = absl::StrSplit(lines[1], ',');
  ASSERT_EQ(cells.size(), header.size()) << csv.out;
  const auto cell = [&](const std::string& name) {
    auto it = std::find(header.begin(), header.end(), name);
    return it == header.end() ? std::string("missing") : cells[it - header.begin()];
  };
  EXPECT_EQ(cell("decode_sessions"), "2");
  double p99 = 0;
  EXPECT_TRUE(absl::SimpleAtod(cell("inter_token_p99_ms"), &p99)) << csv.out;
  EXPECT_GT(p99, 0);
  nlohmann::json plain = BenchJson({"--random", "1,16", "--requests", "3", "--duration", "20"});
  EXPECT_TRUE(plain["decode"].is_null()) << plain.dump();
}

TEST_F(BenchServerTest, DecodeSessionsPastOneConnectionsStreamsOpenMoreConnections) {
  // 150 sessions: more streams than the server takes on one connection (128). On one connection
  // the last 22 would wait for a place while the rest waited at the prompts' barrier for them,
  // until the step timeout; at most 100 a connection, they all run at once.
  nlohmann::json run =
      BenchJson({"--decode", "--sessions", "150", "--prompt", "2", "--steps", "2"});
  SCOPED_TRACE(run.dump());
  EXPECT_EQ(run["connections"], 2);
  EXPECT_EQ(run["sent"], 150 * (1 + 2));
  EXPECT_EQ(run["ok"], run["sent"]);
  EXPECT_EQ(run["decode"]["step_tokens"], 150 * 2);
  EXPECT_LT(run["decode"]["prefill_seconds"].get<double>(), 10) << "the prompts waited";
}

TEST_F(BenchServerTest, DecodeRefusesFlagsItWouldIgnoreAndReportsStreamErrors) {
  for (const std::vector<std::string>& extra : {std::vector<std::string>{"--rate", "10"},
                                                {"--random", "1,16"},
                                                {"--tokens-per-step", "0"},
                                                {"--concurrency-range", "1:3"},
                                                {"--kind", "bidirectional"}}) {
    std::vector<std::string> args = {"--decode", "--prompt", "4", "--steps", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    ProgramResult r = Bench(args);
    EXPECT_EQ(r.exit_code, kInvalidArgument) << absl::StrJoin(extra, " ") << Describe(r);
  }
  ProgramResult r = Bench({"--decode", "--model", "nope", "--prompt", "4", "--steps", "2"});
  EXPECT_EQ(r.exit_code, kNotFound) << Describe(r);
}

}  // namespace
}  // namespace attnserve::test
