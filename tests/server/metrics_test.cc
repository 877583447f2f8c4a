// The Metrics class on its real HTTP endpoint: what is recorded is what a scrape of /metrics
// reads back, series by series.

#include "server/observability/metrics.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/scrape.h"

namespace attnserve::server {
namespace {

using testing::Scrape;
using testing::SeriesKey;

ModelSummary Summary(std::string name, std::string layout, std::string precision, int64_t d_model,
                     int64_t d_context, int64_t num_heads, int64_t head_dim) {
  ModelSummary summary;
  summary.name = std::move(name);
  summary.layout = std::move(layout);
  summary.precision = std::move(precision);
  summary.d_model = d_model;
  summary.d_context = d_context;
  summary.num_heads = num_heads;
  summary.head_dim = head_dim;
  return summary;
}

std::vector<ModelSummary> TwoModels() {
  return {Summary("enc", "torch_mha", "f32", /*d_model=*/768, /*d_context=*/768,
                  /*num_heads=*/12, /*head_dim=*/64),
          Summary("dec", "fused_qkv", "bf16", /*d_model=*/256, /*d_context=*/512,
                  /*num_heads=*/4, /*head_dim=*/64)};
}

// Metrics for the two models, each added and described as the server does at start-up.
std::unique_ptr<Metrics> TwoModelMetrics() {
  std::unique_ptr<Metrics> metrics = Metrics::Create();
  for (const ModelSummary& labels : TwoModels()) {
    metrics->AddModel(labels.name);
    metrics->SetModelInfo(labels);
  }
  return metrics;
}

// User + system CPU seconds of this process, from getrusage (not /proc).
double CpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// The value of `key`, or -1 when the scrape does not hold it.
double Value(const std::map<std::string, double>& samples, const std::string& key) {
  auto it = samples.find(key);
  return it == samples.end() ? -1 : it->second;
}

TEST(MetricsTest, ScrapeReadsBackWhatWasRecorded) {
  std::unique_ptr<Metrics> metrics = TwoModelMetrics();
  absl::StatusOr<int> port = metrics->Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  ModelMetrics& enc = metrics->ForModel("enc");

  for (int i = 0; i < 3; ++i) metrics->CallArrived();
  metrics->CallAnswered(enc, CallProtocol::kGrpc, core::AttentionKind::kCausalCross,
                        absl::StatusCode::kOk, 16, 2e-3);
  metrics->CallAnswered(enc, CallProtocol::kHttp, core::AttentionKind::kCausalCross,
                        absl::StatusCode::kOk, 5, 30e-6);
  metrics->CallAnswered(metrics->ForModel("no-such-model"), CallProtocol::kGrpc, std::nullopt,
                        absl::StatusCode::kNotFound, 0, 1e-4);
  enc.SetQueueDepth(2);
  enc.SetQueueDepth(1);
  enc.SetSequenceRequestsWaiting(3);
  enc.QueueWait(7e-4);
  enc.ComputeRun(3, 48, 3e-3);

  absl::StatusOr<std::map<std::string, double>> s = Scrape(*port);
  ASSERT_TRUE(s.ok()) << s.status();
  const testing::SeriesLabels enc_cc = {{"model", "enc"}, {"kind", "causal_cross"}};
  auto with = [](testing::SeriesLabels labels, std::string key, std::string value) {
    labels.emplace_back(std::move(key), std::move(value));
    return labels;
  };
  // One call each way: the protocol label tells them apart; the other series sum them.
  for (const std::string protocol : {"grpc", "http"}) {
    EXPECT_EQ(Value(*s, SeriesKey("attnserve_requests_total",
                                  with(with(enc_cc, "code", "OK"), "protocol", protocol))),
              1)
        << protocol;
  }
  EXPECT_EQ(
      Value(*s,
            SeriesKey("attnserve_requests_total",
                      {{"model", ""}, {"kind", ""}, {"code", "NOT_FOUND"}, {"protocol", "grpc"}})),
      1);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_tokens_total", enc_cc)), 21);
  // A refused call's tokens are not counted, and its kind is not known.
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_tokens_total", {{"model", ""}, {"kind", ""}})), -1);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_request_duration_seconds_count", enc_cc)), 2);
  // 30 µs is under the first bound (50 µs), 2 ms between 1 ms and 2.5 ms.
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_request_duration_seconds_bucket",
                                with(enc_cc, "le", "5e-05"))),
            1);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_request_duration_seconds_bucket",
                                with(enc_cc, "le", "0.001"))),
            1);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_request_duration_seconds_bucket",
                                with(enc_cc, "le", "0.0025"))),
            2);
  EXPECT_EQ(
      Value(*s, SeriesKey("attnserve_request_duration_seconds_bucket", with(enc_cc, "le", "60"))),
      2);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_inflight_requests")), 0);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_queue_depth", {{"model", "enc"}})), 1);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_queue_depth", {{"model", "dec"}})), 0);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_sequence_requests_waiting", {{"model", "enc"}})), 3);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_sequence_requests_waiting", {{"model", "dec"}})), 0);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_queue_duration_seconds_count", {{"model", "enc"}})), 1);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_queue_duration_seconds_bucket",
                                {{"model", "enc"}, {"le", "0.0005"}})),
            0);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_queue_duration_seconds_bucket",
                                {{"model", "enc"}, {"le", "0.001"}})),
            1);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_compute_duration_seconds_count", {{"model", "enc"}})),
            1);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_batch_calls_bucket", {{"model", "enc"}, {"le", "2"}})),
            0);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_batch_calls_bucket", {{"model", "enc"}, {"le", "3"}})),
            1);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_batch_tokens_sum", {{"model", "enc"}})), 48);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_model_info", {{"model", "dec"},
                                                         {"layout", "fused_qkv"},
                                                         {"precision", "bf16"},
                                                         {"d_model", "256"},
                                                         {"d_context", "512"},
                                                         {"num_heads", "4"},
                                                         {"head_dim", "64"}})),
            1);
  // The model a client named is never a label value.
  for (const auto& [key, value] : *s) {
    EXPECT_EQ(key.find("no-such-model"), std::string::npos) << key;
  }
}

TEST(MetricsTest, ProcessFiguresComeFromProc) {
  std::unique_ptr<Metrics> metrics = TwoModelMetrics();
  absl::StatusOr<int> port = metrics->Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  // Two more descriptors than before must show in process_open_fds.
  absl::StatusOr<std::map<std::string, double>> before = Scrape(*port);
  ASSERT_TRUE(before.ok()) << before.status();
  const int a = socket(AF_INET, SOCK_STREAM, 0);
  const int b = socket(AF_INET, SOCK_STREAM, 0);
  // Some CPU time to see, between two readings of this process's own clock.
  volatile double sink = 0;
  for (int i = 0; CpuSeconds() < 0.2 && i < 1000000000; ++i) sink = sink + std::sqrt(i);
  const double cpu_before = CpuSeconds();
  absl::StatusOr<std::map<std::string, double>> s = Scrape(*port);
  const double cpu_after = CpuSeconds();
  close(a);
  close(b);
  ASSERT_TRUE(s.ok()) << s.status();
  // /proc counts user and system time in whole clock ticks (10 ms), each rounded down on its
  // own: the sum may be up to two ticks below getrusage's clock (one tick of slack above).
  EXPECT_GE(Value(*s, "process_cpu_seconds_total"), cpu_before - 0.021);
  EXPECT_LE(Value(*s, "process_cpu_seconds_total"), cpu_after + 0.011);
  EXPECT_EQ(Value(*s, "process_open_fds"), Value(*before, "process_open_fds") + 2);
  EXPECT_GT(Value(*s, "process_resident_memory_bytes"), 1 << 20);
  EXPECT_GT(Value(*s, "process_max_fds"), 0);
  // This test process started less than a test run ago.
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  EXPECT_LE(Value(*s, "process_start_time_seconds"), now + 1);
  EXPECT_GT(Value(*s, "process_start_time_seconds"), now - 3600);
}

TEST(MetricsTest, CodesPastGrpcsAreInternalAsOnTheWire) {
  std::unique_ptr<Metrics> metrics = TwoModelMetrics();
  absl::StatusOr<int> port = metrics->Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  metrics->CallArrived();
  metrics->CallAnswered(metrics->ForModel("dec"), CallProtocol::kGrpc,
                        core::AttentionKind::kBidirectional, static_cast<absl::StatusCode>(20), 0,
                        1e-3);
  absl::StatusOr<std::map<std::string, double>> s = Scrape(*port);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_requests_total", {{"model", "dec"},
                                                             {"kind", "bidirectional"},
                                                             {"code", "INTERNAL"},
                                                             {"protocol", "grpc"}})),
            1);
}

TEST(MetricsTest, SeriesMadeByRacingThreadsCountEveryCall) {
  std::unique_ptr<Metrics> metrics = TwoModelMetrics();
  absl::StatusOr<int> port = metrics->Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  constexpr int kThreads = 4;
  constexpr int kCalls = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kCalls; ++i) {
        metrics->CallArrived();
        metrics->CallAnswered(metrics->ForModel("enc"), CallProtocol::kGrpc,
                              core::AttentionKind::kCausal, absl::StatusCode::kOk, 3, 1e-4);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  absl::StatusOr<std::map<std::string, double>> s = Scrape(*port);
  ASSERT_TRUE(s.ok()) << s.status();
  const testing::SeriesLabels labels = {{"model", "enc"}, {"kind", "causal"}};
  EXPECT_EQ(
      Value(*s, SeriesKey(
                    "attnserve_requests_total",
                    {{"model", "enc"}, {"kind", "causal"}, {"code", "OK"}, {"protocol", "grpc"}})),
      kThreads * kCalls);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_tokens_total", labels)), 3 * kThreads * kCalls);
  EXPECT_EQ(Value(*s, SeriesKey("attnserve_request_duration_seconds_count", labels)),
            kThreads * kCalls);
  EXPECT_EQ(Value(*s, "attnserve_inflight_requests"), 0);
}

TEST(MetricsTest, ServesOnlyMetricsPath) {
  std::unique_ptr<Metrics> metrics = TwoModelMetrics();
  absl::StatusOr<int> port = metrics->Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  const absl::Status root = testing::HttpGet(*port, "/").status();
  EXPECT_EQ(root.code(), absl::StatusCode::kFailedPrecondition) << root;
  EXPECT_NE(root.message().find("HTTP 404"), std::string::npos) << root;
  EXPECT_TRUE(testing::HttpGet(*port, "/metrics").ok());
}

TEST(MetricsTest, BusyPortIsUnavailable) {
  std::unique_ptr<Metrics> first = TwoModelMetrics();
  absl::StatusOr<int> port = first->Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  std::unique_ptr<Metrics> second = TwoModelMetrics();
  absl::StatusOr<int> again = second->Serve("127.0.0.1:" + std::to_string(*port));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
}

TEST(MetricsTest, DisabledRecordsNothingAndServesNothing) {
  std::unique_ptr<Metrics> metrics = Metrics::Disabled();
  ModelMetrics& model = metrics->AddModel("enc");
  metrics->SetModelInfo(TwoModels().front());
  metrics->CallArrived();
  metrics->CallAnswered(model, CallProtocol::kGrpc, core::AttentionKind::kCausal,
                        absl::StatusCode::kOk, 3, 1e-4);
  model.SetQueueDepth(1);
  model.QueueWait(1e-4);
  model.ComputeRun(1, 3, 1e-4);
  EXPECT_EQ(metrics->Serve("127.0.0.1:0").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(MetricsTest, DurationBucketsResolveFiftyMicrosecondsToAMinute) {
  const std::vector<double>& buckets = Metrics::DurationBuckets();
  ASSERT_FALSE(buckets.empty());
  EXPECT_DOUBLE_EQ(buckets.front(), 50e-6);
  EXPECT_DOUBLE_EQ(buckets.back(), 60);
  // No two neighbours further apart than 2.5x: each decade is resolved.
  for (size_t i = 1; i < buckets.size(); ++i) EXPECT_LE(buckets[i] / buckets[i - 1], 2.5 + 1e-9);
}

}  // namespace
}  // namespace attnserve::server
