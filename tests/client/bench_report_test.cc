// The load test's arithmetic: percentiles, rates and token counts.
#include "client/bench.h"
#include "gtest/gtest.h"

namespace attnserve::client {
namespace {

BenchReport ReportOf(std::vector<double> latencies_ms, absl::Duration elapsed) {
  BenchReport report;
  report.latencies_ms = std::move(latencies_ms);
  report.ok = static_cast<int64_t>(report.latencies_ms.size());
  report.elapsed = elapsed;
  return report;
}

TEST(BenchReportTest, PercentilesAreNearestRank) {
  std::vector<double> latencies;
  for (int i = 1; i <= 100; ++i) latencies.push_back(i);
  BenchReport report = ReportOf(latencies, absl::Seconds(1));
  EXPECT_EQ(report.LatencyMs(0.5), 50);
  EXPECT_EQ(report.LatencyMs(0.9), 90);
  EXPECT_EQ(report.LatencyMs(0.99), 99);
  EXPECT_EQ(report.LatencyMs(1.0), 100);
  EXPECT_EQ(report.LatencyMs(0.0), 1);
  EXPECT_EQ(ReportOf({7}, absl::Seconds(1)).LatencyMs(0.99), 7);
  EXPECT_EQ(ReportOf({}, absl::Seconds(1)).LatencyMs(0.5), 0);
}

TEST(BenchReportTest, RatesCountSuccessfulCallsOnly) {
  BenchReport report = ReportOf({1, 2, 3, 4}, absl::Seconds(2));
  report.errors[absl::StatusCode::kResourceExhausted] = 6;
  report.tokens_per_request = 10;
  EXPECT_EQ(report.total(), 10);
  EXPECT_DOUBLE_EQ(report.requests_per_second(), 2.0);
  EXPECT_DOUBLE_EQ(report.tokens_per_second(), 20.0);
  EXPECT_NE(FormatReport(report).find("RESOURCE_EXHAUSTED: 6"), std::string::npos);
}

TEST(BenchReportTest, QueryTokensAreTheLengthsOrEveryRow) {
  v1::ForwardRequest request;
  for (int64_t dim : {3, 8, 16}) request.mutable_input()->add_shape(dim);
  EXPECT_EQ(QueryTokens(request), 24);
  for (int32_t len : {8, 2, 5}) request.add_lengths(len);
  EXPECT_EQ(QueryTokens(request), 15);
}

TEST(BenchTest, RefusesAnUnboundedRunBeforeAnyCall) {
  // Nothing listens there: the options must be refused before a call is tried.
  std::unique_ptr<AttentionClient> client = AttentionClient::Connect("127.0.0.1:1");
  BenchOptions unbounded;
  unbounded.duration = absl::ZeroDuration();
  unbounded.max_requests = 0;
  EXPECT_EQ(RunBench(*client, {}, unbounded).status().code(), absl::StatusCode::kInvalidArgument);
  BenchOptions no_callers;
  no_callers.concurrency = 0;
  EXPECT_EQ(RunBench(*client, {}, no_callers).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve::client
