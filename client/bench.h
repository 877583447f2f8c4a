#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace attnserve::client {

// How hard and how long to load the server. At least one of the two bounds must be set, and
// the time bound always applies when given, so a run can never go on forever.
struct BenchOptions {
  int concurrency = 4;                          // callers, each with one call in flight
  absl::Duration duration = absl::Seconds(10);  // zero: bounded by max_requests only
  int64_t max_requests = 0;                     // zero: bounded by duration only
  int warmup_requests = 2;                      // sent first, not counted
};

// What a load test measured.
struct BenchReport {
  int concurrency = 0;
  int64_t ok = 0;
  std::map<absl::StatusCode, int64_t> errors;  // failed calls by status code
  absl::Duration elapsed;
  int64_t tokens_per_request = 0;    // query tokens (sum of lengths) in one request
  std::vector<double> latencies_ms;  // of the successful calls, sorted

  // Calls made, successful or not.
  int64_t total() const;
  // Successful calls per second of the run.
  double requests_per_second() const;
  // Query tokens of the successful calls per second of the run.
  double tokens_per_second() const;
  // Latency at quantile q in [0, 1] (nearest rank), 0 without successful calls.
  double LatencyMs(double q) const;
};

// Sends `request` from options.concurrency threads until a bound is reached.
absl::StatusOr<BenchReport> RunBench(const AttentionClient& client,
                                     const v1::ForwardRequest& request,
                                     const BenchOptions& options);

// Query tokens one request carries: its lengths' sum, or every row when lengths are empty.
int64_t QueryTokens(const v1::ForwardRequest& request);

// The report as a few human-readable lines.
std::string FormatReport(const BenchReport& report);

}  // namespace attnserve::client
