#include "client/bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace attnserve::client {
namespace {

// What one caller saw; merged into the report when every caller is done.
struct CallerTally {
  std::vector<double> latencies_ms;
  std::map<absl::StatusCode, int64_t> errors;
};

using Clock = std::chrono::steady_clock;

// One caller: sends until the shared request budget or the deadline runs out.
void RunCaller(const AttentionClient& client, const v1::ForwardRequest& request,
               std::atomic<int64_t>& budget, Clock::time_point deadline, CallerTally& tally) {
  while (budget.fetch_sub(1) > 0 && Clock::now() < deadline) {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<v1::ForwardResponse> response = client.Send(request);
    const std::chrono::duration<double, std::milli> took = Clock::now() - start;
    if (response.ok()) {
      tally.latencies_ms.push_back(took.count());
    } else {
      ++tally.errors[response.status().code()];
    }
  }
}

}  // namespace

int64_t BenchReport::total() const {
  int64_t count = ok;
  for (const auto& [code, n] : errors) count += n;
  return count;
}

double BenchReport::requests_per_second() const {
  const double seconds = absl::ToDoubleSeconds(elapsed);
  return seconds > 0 ? static_cast<double>(ok) / seconds : 0.0;
}

double BenchReport::tokens_per_second() const {
  return requests_per_second() * static_cast<double>(tokens_per_request);
}

double BenchReport::LatencyMs(double q) const {
  if (latencies_ms.empty()) return 0.0;
  const auto n = static_cast<double>(latencies_ms.size());
  const auto rank = static_cast<size_t>(std::max(1.0, std::ceil(q * n)));
  return latencies_ms[std::min(rank, latencies_ms.size()) - 1];
}

int64_t QueryTokens(const v1::ForwardRequest& request) {
  if (request.lengths_size() > 0) {
    int64_t sum = 0;
    for (int32_t len : request.lengths()) sum += len;
    return sum;
  }
  const auto& shape = request.input().shape();
  int64_t rows = 1;
  for (int i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return rows;
}

absl::StatusOr<BenchReport> RunBench(const AttentionClient& client,
                                     const v1::ForwardRequest& request,
                                     const BenchOptions& options) {
  if (options.concurrency < 1) return absl::InvalidArgumentError("concurrency must be >= 1");
  if (options.duration <= absl::ZeroDuration() && options.max_requests <= 0) {
    return absl::InvalidArgumentError("a load test needs a duration or a request count");
  }
  for (int i = 0; i < options.warmup_requests; ++i) {
    // A warm-up failure (wrong model, bad shape) would fail every timed call too: stop here.
    if (absl::StatusOr<v1::ForwardResponse> r = client.Send(request); !r.ok()) return r.status();
  }
  std::atomic<int64_t> budget(options.max_requests > 0 ? options.max_requests : INT64_MAX);
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = options.duration > absl::ZeroDuration()
                                         ? start + absl::ToChronoMilliseconds(options.duration)
                                         : Clock::time_point::max();
  std::vector<CallerTally> tallies(options.concurrency);
  std::vector<std::thread> callers;
  for (CallerTally& tally : tallies) {
    callers.emplace_back(RunCaller, std::cref(client), std::cref(request), std::ref(budget),
                         deadline, std::ref(tally));
  }
  for (std::thread& caller : callers) caller.join();

  BenchReport report;
  report.elapsed = absl::FromChrono(Clock::now() - start);
  report.concurrency = options.concurrency;
  report.tokens_per_request = QueryTokens(request);
  for (CallerTally& tally : tallies) {
    report.latencies_ms.insert(report.latencies_ms.end(), tally.latencies_ms.begin(),
                               tally.latencies_ms.end());
    for (const auto& [code, n] : tally.errors) report.errors[code] += n;
  }
  std::sort(report.latencies_ms.begin(), report.latencies_ms.end());
  report.ok = static_cast<int64_t>(report.latencies_ms.size());
  return report;
}

std::string FormatReport(const BenchReport& report) {
  std::string text = absl::StrFormat(
      "requests     %d ok, %d failed in %.2f s with %d callers\n"
      "throughput   %.1f req/s, %.0f tokens/s (%d query tokens per request)\n"
      "latency ms   p50 %.2f  p90 %.2f  p99 %.2f  max %.2f\n",
      report.ok, report.total() - report.ok, absl::ToDoubleSeconds(report.elapsed),
      report.concurrency, report.requests_per_second(), report.tokens_per_second(),
      report.tokens_per_request, report.LatencyMs(0.5), report.LatencyMs(0.9),
      report.LatencyMs(0.99), report.LatencyMs(1.0));
  for (const auto& [code, n] : report.errors) {
    absl::StrAppend(&text, "errors       ", absl::StatusCodeToString(code), ": ", n, "\n");
  }
  return text;
}

}  // namespace attnserve::client
